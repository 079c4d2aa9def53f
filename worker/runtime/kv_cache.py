"""KV cache with sequence ids (llama.cpp ``llama_kv_cache``, per-sequence storage).

Each sequence owns a growable buffer per layer: K f-dtype ``(cap, n_head_kv, n_embd_head_k)``
and V ``(cap, n_head_kv, n_embd_head_v)`` (torch order). Positions of a sequence are
``0..len-1``: a ubatch appends rows at ``len, len+1, ...`` (what llama-server does), and
``seq_rm`` truncates (``llama_memory_seq_rm`` with ``p1 = -1``). Sliding-window layers keep
the whole history and mask by distance at attention time, so one buffer serves both kinds.

Snapshots (``export``/``import_``) copy a prefix out and back in: the prefix cache stores
them, keyed by adapter-set fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


class _SeqKV:
    def __init__(self, cache: "KVCache", cap: int):
        self.n = 0
        self.k = [torch.empty((cap, cache.n_head_kv, cache.n_embd_head_k), dtype=cache.dtype, device=cache.device)
                  for _ in range(cache.n_layer)]
        self.v = [torch.empty((cap, cache.n_head_kv, cache.n_embd_head_v), dtype=cache.dtype, device=cache.device)
                  for _ in range(cache.n_layer)]

    @property
    def cap(self) -> int:
        return self.k[0].shape[0]

    def reserve(self, n: int) -> None:
        if n <= self.cap:
            return
        new_cap = max(n, 2 * self.cap)
        for lst in (self.k, self.v):
            for i, t in enumerate(lst):
                grown = torch.empty((new_cap,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
                grown[: self.n] = t[: self.n]
                lst[i] = grown


class KVCache:
    """Per-sequence KV storage for every layer.

    Args:
        n_layer, n_head_kv, n_embd_head_k, n_embd_head_v: from the model hparams.
        n_ctx_seq: most positions one sequence may hold (raises beyond it).
        dtype / device: storage.
    """

    def __init__(self, *, n_layer: int, n_head_kv: int, n_embd_head_k: int, n_embd_head_v: int,
                 n_ctx_seq: int, dtype: torch.dtype, device: torch.device):
        self.n_layer = n_layer
        self.n_head_kv = n_head_kv
        self.n_embd_head_k = n_embd_head_k
        self.n_embd_head_v = n_embd_head_v
        self.n_ctx_seq = n_ctx_seq
        self.dtype = dtype
        self.device = device
        self._seqs: dict[int, _SeqKV] = {}

    def seq_len(self, seq_id: int) -> int:
        s = self._seqs.get(seq_id)
        return s.n if s is not None else 0

    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    def _seq(self, seq_id: int) -> _SeqKV:
        s = self._seqs.get(seq_id)
        if s is None:
            s = self._seqs[seq_id] = _SeqKV(self, 64)
        return s

    def seq_rm(self, seq_id: int, p0: int = 0) -> None:
        """Drop positions ``>= p0`` of ``seq_id`` (``p0 = 0`` clears the sequence)."""
        s = self._seqs.get(seq_id)
        if s is None:
            return
        if p0 <= 0:
            del self._seqs[seq_id]
        else:
            s.n = min(s.n, p0)

    def clear(self) -> None:
        self._seqs.clear()

    def begin_append(self, seq_id: int, pos0: int, n: int) -> None:
        """Check that ``n`` rows at positions ``pos0..pos0+n-1`` append to ``seq_id``.

        Raises:
            KVCacheError: positions do not continue the sequence, or exceed ``n_ctx_seq``.
        """
        cur = self.seq_len(seq_id)
        if pos0 != cur:
            raise KVCacheError(f"seq {seq_id}: ubatch starts at pos {pos0} but the sequence holds {cur} positions")
        if pos0 + n > self.n_ctx_seq:
            raise KVCacheError(f"seq {seq_id}: {pos0 + n} positions exceed the context size {self.n_ctx_seq}")
        self._seq(seq_id).reserve(pos0 + n)

    def store(self, il: int, seq_id: int, pos0: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write K/V rows ``(t, n_head_kv, d)`` at ``pos0`` of layer ``il``; return the
        sequence's K and V views ``(pos0 + t, n_head_kv, d)``."""
        s = self._seq(seq_id)
        t = k.shape[0]
        s.k[il][pos0: pos0 + t] = k.to(self.dtype)
        s.v[il][pos0: pos0 + t] = v.to(self.dtype)
        return s.k[il][: pos0 + t], s.v[il][: pos0 + t]

    def commit(self, seq_id: int, n_total: int) -> None:
        self._seq(seq_id).n = n_total

    def export(self, seq_id: int, n: int) -> KVSnapshot:
        """Copy of the first ``n`` positions of ``seq_id``."""
        s = self._seqs[seq_id]
        if n > s.n:
            raise KVCacheError(f"seq {seq_id}: cannot export {n} positions, it holds {s.n}")
        return KVSnapshot(n, [t[:n].clone() for t in s.k], [t[:n].clone() for t in s.v])

    def import_(self, seq_id: int, snap: KVSnapshot, n: int | None = None) -> int:
        """Replace ``seq_id`` with the first ``n`` (default all) positions of ``snap``."""
        n = snap.n if n is None else min(n, snap.n)
        self.seq_rm(seq_id)
        s = self._seq(seq_id)
        s.reserve(max(n, 1))
        for il in range(self.n_layer):
            s.k[il][:n] = snap.k[il][:n]
            s.v[il][:n] = snap.v[il][:n]
        s.n = n
        return n
