"""KV cache with sequence ids (llama.cpp ``llama_kv_cache``, per-sequence storage).

All sequences share one tensor per layer (see ``KVCache``). Positions of a sequence are
``0..len-1``: a ubatch appends rows at ``len, len+1, ...`` (what llama-server does), and
``seq_rm`` truncates (``llama_memory_seq_rm`` with ``p1 = -1``). Sliding-window layers keep
the whole history and mask by distance at attention time, so one buffer serves both kinds.

Snapshots (``export``/``import_``) copy a prefix out and back in: the prefix cache stores
them, keyed by adapter-set fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from loraplane.compute_spec import KV_CACHE_DTYPE_NAMES
from worker.runtime.device import DTYPES


def kv_cache_dtype(name: str, compute: torch.dtype, weight_form: str = "packed") -> torch.dtype:
    """The CPU KV cache's storage dtype for ``--kv-cache-dtype`` ``name``, the compute dtype and
    the weight form (``LoadedModel.weight_form``).

    "auto": f16 on the packed (kernel) path under f32 compute — llama.cpp's default ``type_k`` /
    ``type_v`` (``common.h`` ``cache_type_k = GGML_TYPE_F16``), half the bytes the attention
    reads per key, within the fidelity bounds against llama.cpp (which stores f16 itself); the
    compute dtype otherwise (16-bit compute, and the dequantized reference form, which stays f32
    end to end). "f32" / "f16" / "bf16": that dtype (the attention kernel reads all three in
    place; values are converted to the cache's dtype when written, as ``ggml_cpy`` does).

    Raises:
        ValueError: a name outside `KV_CACHE_DTYPE_NAMES`.
    """
    if name == "auto":
        return torch.float16 if compute == torch.float32 and weight_form == "packed" else compute
    if name not in KV_CACHE_DTYPE_NAMES:
        raise ValueError(f"unknown KV cache dtype '{name}' (expected one of {', '.join(KV_CACHE_DTYPE_NAMES)})")
    return DTYPES[name]


class KVStore(Protocol):
    """What the scheduler, the prefix cache and the benches call on a context's KV cache: this
    module's ``KVCache`` (CPU engine) and ``worker.gpu.kv.PagedKV`` (GPU engine)."""

    n_ctx_seq: int
    n_layer: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int
    dtype: torch.dtype

    def seq_len(self, seq_id: int) -> int: ...

    def seq_ids(self) -> list[int]: ...

    def seq_rm(self, seq_id: int, p0: int = 0) -> None: ...

    def clear(self) -> None: ...

    def begin_append(self, seq_id: int, pos0: int, n: int) -> None: ...

    def commit(self, seq_id: int, n_total: int) -> None: ...

    def export(self, seq_id: int, n: int) -> KVSnapshot: ...

    def import_(self, seq_id: int, snap: KVSnapshot, n: int | None = None) -> int: ...


class KVCacheError(ValueError):
    """A ubatch or cache operation does not fit the sequence's state (names seq and pos)."""


@dataclass
class KVSnapshot:
    """A copy of the first ``n`` positions of one sequence: per layer K and V."""

    n: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def n_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class KVCache:
    """KV storage for every layer, all sequences in one tensor per layer (llama.cpp's unified
    ``llama_kv_cache`` with one stream per sequence).

    Layout (torch order): layer ``il`` holds K ``(n_rows, cap, n_head_kv, n_embd_head_k)`` and
    V ``(n_rows, cap, n_head_kv, n_embd_head_v)``; sequence ``s`` lives in row ``row_of[s]``
    (rows are handed out on first use and recycled by ``seq_rm(s)``), its positions
    ``0..len-1`` in ``[:len]``. ``cap`` and ``n_rows`` grow by doubling, so a decode step
    allocates nothing that grows with context, and decode attention for many sequences reads
    ``k[rows, :L]`` in one batched op (a plain view when the rows are ``0..B-1``).

    The layer tensors are inference tensors (every method that allocates or writes them runs
    under ``torch.inference_mode``), so the scheduler may import prefix snapshots between
    decodes without an autograd context.

    Args:
        n_layer, n_head_kv, n_embd_head_k, n_embd_head_v: from the model hparams.
        n_ctx_seq: most positions one sequence may hold (raises beyond it).
        dtype / device: storage.
        n_seq_hint: sequences to make room for at once (the slot count).
    """

    def __init__(
        self,
        *,
        n_layer: int,
        n_head_kv: int,
        n_embd_head_k: int,
        n_embd_head_v: int,
        n_ctx_seq: int,
        dtype: torch.dtype,
        device: torch.device,
        n_seq_hint: int = 1,
    ):
        self.n_layer = n_layer
        self.n_head_kv = n_head_kv
        self.n_embd_head_k = n_embd_head_k
        self.n_embd_head_v = n_embd_head_v
        self.n_ctx_seq = n_ctx_seq
        self.dtype = dtype
        self.device = device
        self._len: dict[int, int] = {}  # seq id → positions held
        self.row_of: dict[int, int] = {}  # seq id → row of the layer tensors
        self._free_rows: list[int] = []
        self._n_seq_hint = max(1, n_seq_hint)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._alloc(self._n_seq_hint, min(64, n_ctx_seq))

    @torch.inference_mode()
    def _alloc(self, n_rows: int, cap: int) -> None:
        """(Re)allocate every layer to ``(n_rows, cap, ...)``, keeping what is stored."""
        old_k, old_v = self.k, self.v
        self.k = [
            torch.zeros((n_rows, cap, self.n_head_kv, self.n_embd_head_k), dtype=self.dtype, device=self.device)
            for _ in range(self.n_layer)
        ]
        self.v = [
            torch.zeros((n_rows, cap, self.n_head_kv, self.n_embd_head_v), dtype=self.dtype, device=self.device)
            for _ in range(self.n_layer)
        ]
        if old_k:
            r, c = min(n_rows, old_k[0].shape[0]), min(cap, old_k[0].shape[1])
            for il in range(self.n_layer):
                self.k[il][:r, :c] = old_k[il][:r, :c]
                self.v[il][:r, :c] = old_v[il][:r, :c]
        self._free_rows = sorted(set(range(n_rows)) - set(self.row_of.values()))

    @property
    def cap(self) -> int:
        """Positions each row can hold before the next doubling."""
        return int(self.k[0].shape[1])

    def seq_len(self, seq_id: int) -> int:
        return self._len.get(seq_id, 0)

    def seq_ids(self) -> list[int]:
        return list(self._len)

    def _row(self, seq_id: int) -> int:
        row = self.row_of.get(seq_id)
        if row is None:
            if not self._free_rows:
                self._alloc(2 * self.k[0].shape[0], self.cap)
            row = self._free_rows.pop(0)
            self.row_of[seq_id] = row
            self._len[seq_id] = 0
        return row

    def seq_rm(self, seq_id: int, p0: int = 0) -> None:
        """Drop positions ``>= p0`` of ``seq_id`` (``p0 = 0`` clears the sequence)."""
        if seq_id not in self._len:
            return
        if p0 <= 0:
            del self._len[seq_id]
            self._free_rows.append(self.row_of.pop(seq_id))
            self._free_rows.sort()
        else:
            self._len[seq_id] = min(self._len[seq_id], p0)

    def clear(self) -> None:
        self._len.clear()
        self.row_of.clear()
        self._free_rows = list(range(self.k[0].shape[0]))

    def begin_append(self, seq_id: int, pos0: int, n: int) -> None:
        """Check that ``n`` rows at positions ``pos0..pos0+n-1`` append to ``seq_id`` and make room.

        Raises:
            KVCacheError: positions do not continue the sequence, or exceed ``n_ctx_seq``.
        """
        cur = self.seq_len(seq_id)
        if pos0 != cur:
            raise KVCacheError(f"seq {seq_id}: ubatch starts at pos {pos0} but the sequence holds {cur} positions")
        if pos0 + n > self.n_ctx_seq:
            raise KVCacheError(f"seq {seq_id}: {pos0 + n} positions exceed the context size {self.n_ctx_seq}")
        self._row(seq_id)
        if pos0 + n > self.cap:
            self._alloc(self.k[0].shape[0], min(self.n_ctx_seq, max(pos0 + n, 2 * self.cap)))

    @torch.inference_mode()
    def store(
        self, il: int, seq_id: int, pos0: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write K/V rows ``(t, n_head_kv, d)`` at ``pos0`` of layer ``il``; return the
        sequence's K and V views ``(pos0 + t, n_head_kv, d)``."""
        row = self.row_of[seq_id]
        t = k.shape[0]
        self.k[il][row, pos0 : pos0 + t] = k.to(self.dtype)
        self.v[il][row, pos0 : pos0 + t] = v.to(self.dtype)
        return self.k[il][row, : pos0 + t], self.v[il][row, : pos0 + t]

    @torch.inference_mode()
    def store_rows(self, il: int, rows: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one K/V row per sequence: ``k``/``v`` ``(B, n_head_kv, d)`` at cache rows
        ``rows`` int64 ``(B,)`` and positions ``pos`` int64 ``(B,)`` of layer ``il``: one
        ``index_copy_`` per tensor over the cache viewed as ``(n_rows·cap, n_head_kv, d)``."""
        for cache, x in ((self.k[il], k), (self.v[il], v)):
            flat = rows * cache.shape[1] + pos
            cache.view(-1, *cache.shape[2:]).index_copy_(0, flat, x.to(self.dtype))

    def rows_view(
        self, il: int, rows: torch.Tensor, lo: int, hi: int, contiguous_from: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of cache rows ``rows`` at positions ``lo..hi-1``: ``(B, hi-lo, n_head_kv, d)``.

        ``contiguous_from`` = r when ``rows`` is ``r..r+B-1`` (then the result is a view, no
        copy); None gathers.
        """
        if contiguous_from is not None:
            b = rows.shape[0]
            return (
                self.k[il][contiguous_from : contiguous_from + b, lo:hi],
                self.v[il][contiguous_from : contiguous_from + b, lo:hi],
            )
        return self.k[il][rows, lo:hi], self.v[il][rows, lo:hi]

    def commit(self, seq_id: int, n_total: int) -> None:
        self._row(seq_id)
        self._len[seq_id] = n_total

    def export(self, seq_id: int, n: int) -> KVSnapshot:
        """Copy of the first ``n`` positions of ``seq_id``."""
        held = self.seq_len(seq_id)
        if seq_id not in self._len or n > held:
            raise KVCacheError(f"seq {seq_id}: cannot export {n} positions, it holds {held}")
        row = self.row_of[seq_id]
        return KVSnapshot(n, [t[row, :n].clone() for t in self.k], [t[row, :n].clone() for t in self.v])

    @torch.inference_mode()
    def import_(self, seq_id: int, snap: KVSnapshot, n: int | None = None) -> int:
        """Replace ``seq_id`` with the first ``n`` (default all) positions of ``snap``."""
        n = snap.n if n is None else min(n, snap.n)
        self.seq_rm(seq_id)
        self.begin_append(seq_id, 0, max(n, 1))
        row = self.row_of[seq_id]
        for il in range(self.n_layer):
            self.k[il][row, :n] = snap.k[il][:n]
            self.v[il][row, :n] = snap.v[il][:n]
        self._len[seq_id] = n
        return n
