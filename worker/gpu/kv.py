"""The paged KV cache behind the interface the scheduler and the prefix cache already use.

``worker.runtime.kv_cache.KVCache`` is what the CPU context, the scheduler
(``seq_len``, ``seq_rm``, ``n_ctx_seq``) and the keyed prefix cache (``export``/``import_``)
call. On the GPU the storage is ``worker.gpu.paged_kv.PagedKVCache``: blocks of
``block_size`` positions with per-sequence block tables, so a captured decode graph reads the
same buffers however sequences come and go. :class:`PagedKV` maps one onto the other:

- sequence ids of the scheduler (any ints) are mapped to rows of the block table on first use
  and the row returns to the free list on ``seq_rm(s)``;
- ``export(s, n)`` is ``PagedKVCache.share``: the prefix cache entry holds references to the
  blocks of the first ``n`` positions (no copy); ``import_`` is ``attach`` (references; the first
  write into a shared partial block copies that block, copy-on-write); the references are
  dropped when the entry is dropped (the snapshot object is garbage-collected);
- ``begin_append`` checks a ubatch's positions, ``reserve`` allocates them and returns their
  slots (``slot_mapping``), ``commit`` confirms the new length.

The keyed-by-adapter rule stays in the prefix cache's key (the adapter-set fingerprint).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from worker.gpu.paged_kv import PagedKVCache, SharedPrefix
from worker.runtime.kv_cache import KVCacheError, KVSnapshot

BLOCK_SIZE = 16
"""Positions per KV block (vLLM's default page size)."""


@dataclass
class PagedSnapshot(KVSnapshot):
    """A prefix-cache entry's KV on pages: references to the blocks of the first ``n`` positions
    of a sequence (``k``/``v`` stay empty: nothing is copied). ``n_bytes`` is what the blocks
    hold."""

    prefix: SharedPrefix | None = None
    block_bytes: int = 0
    _finalizer: weakref.finalize | None = field(default=None, repr=False)

    @property
    def n_bytes(self) -> int:
        return 0 if self.prefix is None else len(self.prefix.blocks) * self.block_bytes


class PagedKV:
    """``KVCache``'s interface over a :class:`PagedKVCache` (module docstring).

    Args:
        n_layer, n_head_kv, n_embd_head_k, n_embd_head_v: from the model hparams.
        n_ctx_seq: most positions one sequence may hold.
        n_seq: sequences at once (rows of the block table; one spare row is kept for callers
            that use an extra sequence id, such as benches).
        prefix_tokens: positions the prefix cache may keep beside the live sequences (blocks
            are sized for both).
        dtype / device: of the pools.
        block_size: positions per block.
    """

    def __init__(
        self,
        *,
        n_layer: int,
        n_head_kv: int,
        n_embd_head_k: int,
        n_embd_head_v: int,
        n_ctx_seq: int,
        n_seq: int,
        dtype: torch.dtype,
        device: torch.device,
        prefix_tokens: int = 65536,
        block_size: int = BLOCK_SIZE,
    ):
        self.n_layer = n_layer
        self.n_head_kv = n_head_kv
        self.n_embd_head_k = n_embd_head_k
        self.n_embd_head_v = n_embd_head_v
        self.n_ctx_seq = n_ctx_seq
        self.dtype = dtype
        self.device = device
        max_seqs = max(1, n_seq) + 1
        per_seq = -(-n_ctx_seq // block_size)
        n_blocks = 1 + max_seqs * per_seq + -(-prefix_tokens // block_size) + max_seqs
        elem = torch.empty((), dtype=dtype).element_size()
        self.block_bytes = n_layer * block_size * n_head_kv * (n_embd_head_k + n_embd_head_v) * elem
        self.pages = PagedKVCache(
            n_layer=n_layer,
            n_head_kv=n_head_kv,
            head_dim_k=n_embd_head_k,
            head_dim_v=n_embd_head_v,
            block_size=block_size,
            n_blocks=n_blocks,
            max_seqs=max_seqs,
            n_ctx_seq=n_ctx_seq,
            dtype=dtype,
            device=device,
        )
        self.block_size = block_size
        self.row_of: dict[int, int] = {}
        self._free_rows = list(range(max_seqs))

    # --- the KVCache interface ------------------------------------------------------------
    @property
    def k(self) -> list[torch.Tensor]:
        """K pools per layer ``(n_blocks, block_size, n_head_kv, n_embd_head_k)``."""
        return self.pages.k

    @property
    def v(self) -> list[torch.Tensor]:
        return self.pages.v

    def seq_len(self, seq_id: int) -> int:
        row = self.row_of.get(seq_id)
        return 0 if row is None else self.pages.seq_len(row)

    def seq_ids(self) -> list[int]:
        return list(self.row_of)

    def _row(self, seq_id: int) -> int:
        row = self.row_of.get(seq_id)
        if row is None:
            if not self._free_rows:
                raise KVCacheError(
                    f"seq {seq_id}: every one of the {self.pages.max_seqs} KV sequence rows is in use "
                    f"(held by seqs {sorted(self.row_of)})"
                )
            row = self._free_rows.pop(0)
            self.row_of[seq_id] = row
        return row

    def seq_rm(self, seq_id: int, p0: int = 0) -> None:
        """Drop positions ``>= p0`` of ``seq_id`` (``p0 = 0`` clears it and frees its row)."""
        row = self.row_of.get(seq_id)
        if row is None:
            return
        if p0 <= 0:
            self.pages.free(row)
            del self.row_of[seq_id]
            self._free_rows.append(row)
            self._free_rows.sort()
        else:
            self.pages.truncate(row, p0)

    def clear(self) -> None:
        for s in list(self.row_of):
            self.seq_rm(s)

    def begin_append(self, seq_id: int, pos0: int, n: int) -> None:
        """Check that ``n`` rows at ``pos0..pos0+n-1`` continue ``seq_id`` (nothing allocated).

        Raises:
            KVCacheError: positions do not continue the sequence, or exceed ``n_ctx_seq``.
        """
        cur = self.seq_len(seq_id)
        if pos0 != cur:
            raise KVCacheError(f"seq {seq_id}: ubatch starts at pos {pos0} but the sequence holds {cur} positions")
        if pos0 + n > self.n_ctx_seq:
            raise KVCacheError(f"seq {seq_id}: {pos0 + n} positions exceed the context size {self.n_ctx_seq}")
        if seq_id not in self.row_of and not self._free_rows:
            raise KVCacheError(f"seq {seq_id}: no free KV sequence row ({self.pages.max_seqs} in use)")

    def reserve(self, seq_id: int, n: int) -> tuple[int, np.ndarray]:
        """Allocate ``n`` more positions of ``seq_id``; returns its block-table row and the new
        positions' slots, int64 ``(n,)`` (``PagedKVCache.append``).

        Raises:
            KVCacheError: beyond ``n_ctx_seq``; ``OutOfBlocksError`` (a ``KVCacheError``) when
                the pools are full.
        """
        row = self._row(seq_id)
        return row, self.pages.append(row, n)

    def commit(self, seq_id: int, n_total: int) -> None:
        """Confirm ``seq_id`` holds ``n_total`` positions (``reserve`` already counted them)."""
        row = self._row(seq_id)
        if self.pages.seq_len(row) != n_total:
            self.pages.truncate(row, n_total)

    def export(self, seq_id: int, n: int) -> KVSnapshot:
        """References to the blocks of the first ``n`` positions of ``seq_id`` (no copy)."""
        held = self.seq_len(seq_id)
        if seq_id not in self.row_of or not 1 <= n <= held:
            raise KVCacheError(f"seq {seq_id}: cannot export {n} positions, it holds {held}")
        prefix = self.pages.share(self.row_of[seq_id], n)
        snap = PagedSnapshot(n, [], [], prefix=prefix, block_bytes=self.block_bytes)
        snap._finalizer = weakref.finalize(snap, _release, self.pages, prefix)
        return snap

    def import_(self, seq_id: int, snap: KVSnapshot, n: int | None = None) -> int:
        """Replace ``seq_id`` with the first ``n`` (default all) positions of ``snap``.

        Raises:
            KVCacheError: ``snap`` is not a snapshot of these pages.
        """
        if not isinstance(snap, PagedSnapshot) or snap.prefix is None:
            raise KVCacheError(f"seq {seq_id}: a paged KV cache imports only its own snapshots")
        self.seq_rm(seq_id)
        return self.pages.attach(self._row(seq_id), snap.prefix, n)

    # --- step inputs ------------------------------------------------------------------------
    def table_rows(self, rows: list[int]) -> np.ndarray:
        """Host copy of the block-table rows ``rows``: int32 ``(len(rows), max_blocks_per_seq)``."""
        return self.pages.table_rows(rows)[0]


def _release(pages: PagedKVCache, prefix: SharedPrefix) -> None:
    if not prefix.released:
        pages.release(prefix)


__all__ = ["BLOCK_SIZE", "PagedKV", "PagedSnapshot"]
