"""Paged KV cache on the device: block pools per layer and per-sequence block tables (vLLM's
PagedAttention block tables, SGLang's token-to-KV pool).

`PagedKVCache` holds per layer a K and a V pool of blocks, static ``block_tables`` and
``seq_lens`` (a sequence's row is its id; `PagedKVCache.sync` rewrites rows, never moves a
buffer a CUDA graph reads) and a `BlockAllocator` of reference-counted blocks; `NULL_BLOCK` is
never handed out (padded rows write and read it). Prefixes are shared blocks: `PagedKVCache.fork`,
`PagedKVCache.share` (a `SharedPrefix`) / `PagedKVCache.attach` / `PagedKVCache.release`, with
copy-on-write of the first divergent block; `block_keys` gives full blocks content keys chained
from the adapter-set fingerprint. ``worker.gpu.kv.PagedKV`` puts it behind ``KVCache``'s
interface. Raises `OutOfBlocksError` when the pool is spent.

Layout, sharing and the prefix cache on pages: docs/gpu.md, "Inside the GPU engine" (The paged
KV cache).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from worker.gpu.staging import Upload
from worker.runtime.kv_cache import KVCacheError

NULL_BLOCK = 0
"""The block that padded rows and unused block-table entries point at; never handed out."""


class OutOfBlocksError(KVCacheError):
    """No free block is left for a sequence's new positions (names the sequence, its positions,
    the blocks needed and the blocks free)."""


class BlockAllocator:
    """Free-block list and reference counts of blocks ``1..n_blocks-1`` (`NULL_BLOCK` is pinned).

    Freed blocks are handed out again first (a LIFO list), so a steady load keeps touching the
    same memory.

    Args:
        n_blocks: blocks in each pool, the null block included (≥ 2).

    Raises:
        ValueError: ``n_blocks < 2``.
    """

    def __init__(self, n_blocks: int):
        if n_blocks < 2:
            raise ValueError(f"a paged KV cache needs at least 2 blocks (one is the null block), got {n_blocks}")
        self.n_blocks = n_blocks
        self._refs = [0] * n_blocks
        self._refs[NULL_BLOCK] = 1
        self._free = list(range(n_blocks - 1, 0, -1))  # pop() hands out the lowest id first

    @property
    def n_free(self) -> int:
        """Blocks that can be handed out now."""
        return len(self._free)

    def allocate(self) -> int:
        """A free block with one reference.

        Raises:
            OutOfBlocksError: none is free (callers check `n_free` first to name the sequence).
        """
        if not self._free:
            raise OutOfBlocksError(f"no free KV block (all {self.n_blocks - 1} in use)")
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def incref(self, block: int) -> None:
        """One more holder of ``block``. Raises ValueError when it is free or the null block."""
        if block == NULL_BLOCK or self._refs[block] <= 0:
            raise ValueError(f"KV block {block} is not allocated")
        self._refs[block] += 1

    def decref(self, block: int) -> bool:
        """One holder fewer; returns whether the block became free. Raises ValueError when it is
        free or the null block."""
        if block == NULL_BLOCK or self._refs[block] <= 0:
            raise ValueError(f"KV block {block} is not allocated")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)
            return True
        return False

    def ref_count(self, block: int) -> int:
        """Holders of ``block`` (0: free)."""
        return self._refs[block]


@dataclass(eq=False)
class SharedPrefix:
    """References to the blocks of a sequence's first ``n_tokens`` positions (`PagedKVCache.share`):
    the paged form of a ``KVSnapshot``. Hold it as long as the prefix may be attached again, then
    hand it to `PagedKVCache.release` (once).

    Attributes:
        blocks: block ids, ``ceil(n_tokens / block_size)`` of them, in position order.
        n_tokens: positions covered.
    """

    blocks: tuple[int, ...]
    n_tokens: int
    released: bool = field(default=False, init=False)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def n_blocks_for(
    budget_bytes: int,
    *,
    n_layer: int,
    n_head_kv: int,
    head_dim_k: int,
    head_dim_v: int,
    block_size: int,
    dtype: torch.dtype,
) -> int:
    """Blocks (the null block included) whose K and V pools over all layers fit in ``budget_bytes``:
    one block holds ``n_layer * block_size * n_head_kv * (head_dim_k + head_dim_v)`` elements of
    ``dtype``."""
    per_block = (
        n_layer * block_size * n_head_kv * (head_dim_k + head_dim_v) * torch.empty((), dtype=dtype).element_size()
    )
    return max(0, budget_bytes // per_block)


def block_keys(fingerprint: str, tokens: Sequence[int], block_size: int) -> list[str]:
    """Content keys of the full blocks of ``tokens`` computed under the adapter set whose
    fingerprint is ``fingerprint`` (``AdapterSet.fingerprint``): key ``i`` is a hash of key
    ``i - 1`` (the fingerprint for the first block) and block ``i``'s token ids, so a key names
    the adapter set and every token up to the block's end (vLLM's chained block hashes with the
    adapter as an extra key). A trailing partial block has no key: it is the block a sequence
    may still write to. Only positions that one adapter set computed may be keyed (for an aLoRA
    request, its positions before the invocation, as the keyed policy stores them).

    Returns:
        ``len(tokens) // block_size`` hex strings of 32 characters.
    """
    keys: list[str] = []
    prev = hashlib.blake2b(fingerprint.encode(), digest_size=16).digest()
    ids = np.asarray(tokens, dtype="<i8")
    for i in range(len(tokens) // block_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(ids[i * block_size : (i + 1) * block_size].tobytes())
        prev = h.digest()
        keys.append(prev.hex())
    return keys


class PagedKVCache:
    """K/V pools per layer, a block allocator, and per-sequence block tables (module docstring).

    Sequences are ids ``0..max_seqs-1`` (the row of the block table). Every method that changes a
    sequence updates the host copy of the tables; `sync` pushes the changed rows to the device
    buffers ``block_tables`` and ``seq_lens`` (call it once per step, before the forward pass).
    A sequence's length counts the positions the next forward pass writes: after ``append(s, 1)``
    the new position is in ``seq_lens[s]`` and its slot is what ``append`` returned.

    Args:
        n_layer, n_head_kv, head_dim_k, head_dim_v: from the model hyper-parameters.
        block_size: positions per block (16 is vLLM's default; FlashInfer takes any page size).
        n_blocks: blocks per pool, the null block included (`n_blocks_for` sizes it from memory).
        max_seqs: sequences (rows of the block table).
        n_ctx_seq: most positions one sequence may hold.
        dtype, device: of the pools (the compute dtype).

    Raises:
        ValueError: a size is not positive, or ``n_blocks < 2``.
    """

    def __init__(
        self,
        *,
        n_layer: int,
        n_head_kv: int,
        head_dim_k: int,
        head_dim_v: int,
        block_size: int,
        n_blocks: int,
        max_seqs: int,
        n_ctx_seq: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        sizes = dict(n_layer=n_layer, n_head_kv=n_head_kv, head_dim_k=head_dim_k, head_dim_v=head_dim_v)
        sizes.update(block_size=block_size, max_seqs=max_seqs, n_ctx_seq=n_ctx_seq)
        bad = [f"{k}={v}" for k, v in sizes.items() if v < 1]
        if bad:
            raise ValueError(f"paged KV cache sizes must be positive: {', '.join(bad)}")
        self.n_layer, self.n_head_kv = n_layer, n_head_kv
        self.head_dim_k, self.head_dim_v = head_dim_k, head_dim_v
        self.block_size, self.max_seqs, self.n_ctx_seq = block_size, max_seqs, n_ctx_seq
        self.max_blocks_per_seq = _ceil_div(n_ctx_seq, block_size)
        self.dtype, self.device = dtype, device
        self.allocator = BlockAllocator(n_blocks)
        with torch.inference_mode():  # written by forward passes under inference mode
            self.k = [
                torch.zeros((n_blocks, block_size, n_head_kv, head_dim_k), dtype=dtype, device=device)
                for _ in range(n_layer)
            ]
            self.v = [
                torch.zeros((n_blocks, block_size, n_head_kv, head_dim_v), dtype=dtype, device=device)
                for _ in range(n_layer)
            ]
            self.block_tables = torch.full(
                (max_seqs, self.max_blocks_per_seq), NULL_BLOCK, dtype=torch.int32, device=device
            )
            self.seq_lens = torch.zeros((max_seqs,), dtype=torch.int32, device=device)
        self._tables_up = Upload(self.block_tables)
        self._lens_up = Upload(self.seq_lens)
        self._tables = self._tables_up.host.numpy()  # host copy, written in place
        self._tables[:] = NULL_BLOCK
        self._lens = self._lens_up.host.numpy()
        self._lens[:] = 0
        self._blocks: list[list[int]] = [[] for _ in range(max_seqs)]
        self._dirty: tuple[int, int] | None = None  # rows [lo, hi) changed since the last sync

    # ------------------------------------------------------------------ queries

    @property
    def n_free_blocks(self) -> int:
        return self.allocator.n_free

    def seq_len(self, seq: int) -> int:
        """Positions ``seq`` holds."""
        self._check_seq(seq)
        return int(self._lens[seq])

    def blocks_of(self, seq: int) -> list[int]:
        """Block ids of ``seq`` in position order (a copy)."""
        self._check_seq(seq)
        return list(self._blocks[seq])

    def blocks_needed(self, seq: int, n_tokens: int) -> int:
        """Free blocks that appending ``n_tokens`` positions to ``seq`` takes, the copy of a
        shared partial last block included (for admission checks)."""
        self._check_seq(seq)
        cur = int(self._lens[seq])
        blocks = self._blocks[seq]
        fresh = _ceil_div(cur + n_tokens, self.block_size) - len(blocks)
        cow = cur % self.block_size != 0 and self.allocator.ref_count(blocks[-1]) > 1
        return fresh + int(cow)

    def slots(self, seq: int, p0: int, p1: int) -> np.ndarray:
        """Slots (flat pool indices, int64 ``(p1 - p0,)``) of positions ``p0..p1-1`` of ``seq``.

        Raises:
            KVCacheError: the positions are not all held by ``seq``.
        """
        self._check_seq(seq)
        held = int(self._lens[seq])
        if not 0 <= p0 <= p1 <= held:
            raise KVCacheError(f"seq {seq}: positions {p0}..{p1 - 1} are not held (it holds {held})")
        pos = np.arange(p0, p1, dtype=np.int64)
        blocks = self._tables[seq, pos // self.block_size].astype(np.int64)
        return blocks * self.block_size + pos % self.block_size

    def table_rows(self, seqs: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of the block-table rows and lengths of ``seqs``: int32 ``(len(seqs),
        max_blocks_per_seq)`` and int32 ``(len(seqs),)``, for a step's inputs."""
        idx = np.asarray(seqs, dtype=np.int64)
        return self._tables[idx].copy(), self._lens[idx].copy()

    # ------------------------------------------------------------------ changes

    def allocate(self, seq: int, n_tokens: int) -> np.ndarray:
        """Start ``seq`` (which must hold nothing) with ``n_tokens`` positions (a prefill);
        returns their slots, int64 ``(n_tokens,)``.

        Raises:
            KVCacheError: ``seq`` holds positions, or ``n_tokens`` exceeds ``n_ctx_seq``.
            OutOfBlocksError: not enough free blocks (nothing is changed).
        """
        self._check_seq(seq)
        if self._lens[seq]:
            raise KVCacheError(f"seq {seq}: cannot allocate, it holds {int(self._lens[seq])} positions (free it first)")
        return self.append(seq, n_tokens)

    def append(self, seq: int, n_tokens: int = 1) -> np.ndarray:
        """Extend ``seq`` by ``n_tokens`` positions (``len..len+n_tokens-1``); returns their
        slots, int64 ``(n_tokens,)``. When the last block is partial and shared, it is copied
        first (copy-on-write) so the new rows never reach another holder's positions.

        Raises:
            KVCacheError: ``n_tokens < 1``, or the positions exceed ``n_ctx_seq``.
            OutOfBlocksError: not enough free blocks (nothing is changed).
        """
        self._check_seq(seq)
        cur = int(self._lens[seq])
        new = cur + n_tokens
        if n_tokens < 1:
            raise KVCacheError(f"seq {seq}: cannot append {n_tokens} positions")
        if new > self.n_ctx_seq:
            raise KVCacheError(f"seq {seq}: positions {cur}..{new - 1} exceed the context size {self.n_ctx_seq}")
        need = self.blocks_needed(seq, n_tokens)
        if need > self.allocator.n_free:
            raise OutOfBlocksError(
                f"seq {seq}: positions {cur}..{new - 1} need {need} more KV blocks of {self.block_size} positions, "
                f"{self.allocator.n_free} free of {self.allocator.n_blocks - 1}"
            )
        self._tables_up.wait()
        blocks = self._blocks[seq]
        if cur % self.block_size != 0 and self.allocator.ref_count(blocks[-1]) > 1:
            self._copy_on_write(seq)
        while len(blocks) < _ceil_div(new, self.block_size):
            blocks.append(self.allocator.allocate())
            self._tables[seq, len(blocks) - 1] = blocks[-1]
        self._set_len(seq, new)
        return self.slots(seq, cur, new)

    def truncate(self, seq: int, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` positions of ``seq`` (``llama_memory_seq_rm`` from
        ``n_tokens``); ``n_tokens <= 0`` frees it, ``n_tokens >= len`` changes nothing."""
        self._check_seq(seq)
        if n_tokens <= 0:
            self.free(seq)
            return
        if n_tokens >= self._lens[seq]:
            return
        self._tables_up.wait()
        keep = _ceil_div(n_tokens, self.block_size)
        blocks = self._blocks[seq]
        for b in blocks[keep:]:
            self.allocator.decref(b)
        del blocks[keep:]
        self._tables[seq, keep:] = NULL_BLOCK
        self._set_len(seq, n_tokens)

    def free(self, seq: int) -> None:
        """Drop every position of ``seq``; its blocks go back to the free list once no one else
        holds them."""
        self._check_seq(seq)
        self._tables_up.wait()
        for b in self._blocks[seq]:
            self.allocator.decref(b)
        self._blocks[seq] = []
        self._tables[seq] = NULL_BLOCK
        self._set_len(seq, 0)

    def fork(self, src_seq: int, dst_seq: int, n_tokens: int) -> None:
        """Make ``dst_seq`` (which must hold nothing) share the first ``n_tokens`` positions of
        ``src_seq``: the same blocks, one more reference each; nothing is copied until one of
        them writes into a shared partial block.

        Raises:
            KVCacheError: ``dst_seq`` holds positions or is ``src_seq``; ``n_tokens`` is not in
                ``1..len(src_seq)``.
        """
        self._check_seq(src_seq)
        self._check_seq(dst_seq)
        held = int(self._lens[src_seq])
        if src_seq == dst_seq:
            raise KVCacheError(f"seq {src_seq}: cannot fork a sequence into itself")
        if self._lens[dst_seq]:
            raise KVCacheError(f"seq {dst_seq}: cannot fork into it, it holds {int(self._lens[dst_seq])} positions")
        if not 1 <= n_tokens <= held:
            raise KVCacheError(f"seq {src_seq}: cannot fork {n_tokens} positions, it holds {held}")
        self._take(dst_seq, self._blocks[src_seq][: _ceil_div(n_tokens, self.block_size)], n_tokens)

    def share(self, seq: int, n_tokens: int) -> SharedPrefix:
        """References to the blocks of the first ``n_tokens`` positions of ``seq``, for a prefix
        cache entry (the paged ``KVCache.export``: no copy).

        Raises:
            KVCacheError: ``n_tokens`` is not in ``1..len(seq)``.
        """
        self._check_seq(seq)
        held = int(self._lens[seq])
        if not 1 <= n_tokens <= held:
            raise KVCacheError(f"seq {seq}: cannot share {n_tokens} positions, it holds {held}")
        blocks = tuple(self._blocks[seq][: _ceil_div(n_tokens, self.block_size)])
        for b in blocks:
            self.allocator.incref(b)
        return SharedPrefix(blocks, n_tokens)

    def attach(self, seq: int, prefix: SharedPrefix, n_tokens: int | None = None) -> int:
        """Replace ``seq`` with the first ``n_tokens`` (None: all) positions of ``prefix`` (the
        paged ``KVCache.import_``: references, no copy); returns the positions it holds.

        Raises:
            ValueError: ``prefix`` was released.
        """
        if prefix.released:
            raise ValueError("the shared prefix was released")
        n = prefix.n_tokens if n_tokens is None else max(0, min(n_tokens, prefix.n_tokens))
        self.free(seq)
        if n:
            self._take(seq, list(prefix.blocks[: _ceil_div(n, self.block_size)]), n)
        return n

    def release(self, prefix: SharedPrefix) -> None:
        """Drop ``prefix``'s references (a prefix-cache eviction).

        Raises:
            ValueError: it was released already.
        """
        if prefix.released:
            raise ValueError("the shared prefix was released already")
        prefix.released = True
        for b in prefix.blocks:
            self.allocator.decref(b)

    def sync(self) -> None:
        """Push the block-table rows and lengths changed since the last call to the device
        buffers (asynchronous on CUDA; ordered before the step's kernels on the same stream)."""
        if self._dirty is None:
            return
        lo, hi = self._dirty
        self._tables_up.push(lo, hi)
        self._lens_up.push(lo, hi)
        self._dirty = None

    # ------------------------------------------------------------------ device data

    @torch.inference_mode()
    def write(self, il: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a step's new K/V rows of layer ``il``: ``k`` ``(T, n_head_kv, head_dim_k)`` and
        ``v`` ``(T, n_head_kv, head_dim_v)`` at ``slot_mapping`` int64 ``(T,)`` (device; one
        ``index_copy_`` per pool, no host sync, so it may run inside a captured graph)."""
        for pool, x in ((self.k[il], k), (self.v[il], v)):
            pool.view(-1, *pool.shape[2:]).index_copy_(0, slot_mapping, x.to(pool.dtype))

    def gather(self, il: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K ``(len, n_head_kv, head_dim_k)`` and V of every position of ``seq`` in layer ``il``
        (a copy in position order; the torch reference for paged attention)."""
        n = self.seq_len(seq)
        idx = torch.tensor(self._blocks[seq], dtype=torch.long, device=self.device)
        k = self.k[il].index_select(0, idx).flatten(0, 1)[:n]
        v = self.v[il].index_select(0, idx).flatten(0, 1)[:n]
        return k, v

    # ------------------------------------------------------------------ internals

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.max_seqs:
            raise KVCacheError(f"seq {seq}: not a sequence of this cache (0..{self.max_seqs - 1})")

    def _set_len(self, seq: int, n: int) -> None:
        self._lens_up.wait()
        self._lens[seq] = n
        lo, hi = (seq, seq + 1) if self._dirty is None else (min(self._dirty[0], seq), max(self._dirty[1], seq + 1))
        self._dirty = (lo, hi)

    def _take(self, seq: int, blocks: list[int], n_tokens: int) -> None:
        """``seq`` (empty) gets one more reference to each of ``blocks`` and ``n_tokens`` positions."""
        self._tables_up.wait()
        for b in blocks:
            self.allocator.incref(b)
        self._blocks[seq] = list(blocks)
        self._tables[seq, : len(blocks)] = blocks
        self._set_len(seq, n_tokens)

    @torch.inference_mode()
    def _copy_on_write(self, seq: int) -> None:
        """Give ``seq`` its own copy of its shared last block, in every layer."""
        blocks = self._blocks[seq]
        old, new = blocks[-1], self.allocator.allocate()
        for pool in (*self.k, *self.v):
            pool[new].copy_(pool[old])
        self.allocator.decref(old)
        blocks[-1] = new
        self._tables[seq, len(blocks) - 1] = new


__all__ = [
    "NULL_BLOCK",
    "BlockAllocator",
    "OutOfBlocksError",
    "PagedKVCache",
    "SharedPrefix",
    "block_keys",
    "n_blocks_for",
]
