"""The paged KV cache of the GPU engine on the CPU: block allocation, free lists and reference
counts, block tables and slot mappings (exact values), fork / share / attach with copy-on-write
of the first divergent block, clear errors, and a random sequence of operations checked against
a plain per-sequence reference of what each position holds."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from worker.gpu.paged_kv import (
    NULL_BLOCK,
    BlockAllocator,
    OutOfBlocksError,
    PagedKVCache,
    block_keys,
    n_blocks_for,
)
from worker.runtime.kv_cache import KVCacheError

BS = 4  # positions per block in these tests


def _cache(n_blocks: int = 12, max_seqs: int = 4, n_ctx: int = 32, device: str = "cpu") -> PagedKVCache:
    return PagedKVCache(
        n_layer=2,
        n_head_kv=2,
        head_dim_k=3,
        head_dim_v=5,
        block_size=BS,
        n_blocks=n_blocks,
        max_seqs=max_seqs,
        n_ctx_seq=n_ctx,
        dtype=torch.float32,
        device=torch.device(device),
    )


def _kv_rows(tag: float, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K ``(n, 2, 3)`` and V ``(n, 2, 5)`` rows whose every value encodes ``tag`` and the row."""
    base = tag + torch.arange(n, dtype=torch.float32).view(n, 1, 1) / 100
    return base.expand(n, 2, 3).clone(), (base + 0.5).expand(n, 2, 5).clone()


def _store(cache: PagedKVCache, slots: np.ndarray, tag: float) -> None:
    k, v = _kv_rows(tag, len(slots))
    for il in range(cache.n_layer):
        cache.write(il, torch.from_numpy(slots), k + il, v + il)


def test_allocator_hands_out_lowest_first_and_reuses_freed_blocks():
    a = BlockAllocator(5)
    assert [a.allocate() for _ in range(4)] == [1, 2, 3, 4]
    assert a.n_free == 0
    with pytest.raises(OutOfBlocksError, match="all 4 in use"):
        a.allocate()
    a.incref(3)
    assert a.decref(3) is False and a.ref_count(3) == 1
    assert a.decref(3) is True and a.n_free == 1
    assert a.allocate() == 3
    with pytest.raises(ValueError, match="not allocated"):
        a.incref(NULL_BLOCK)
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockAllocator(1)


@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
def test_allocate_append_slots_and_tables(device):
    c = _cache(device=device)
    assert c.max_blocks_per_seq == 8
    assert c.allocate(0, 6).tolist() == [4, 5, 6, 7, 8, 9]  # blocks 1, 2
    assert c.allocate(2, 1).tolist() == [12]  # block 3
    assert c.append(0).tolist() == [10]
    assert c.append(0, 3).tolist() == [11, 16, 17]  # fills block 2, opens block 4
    assert c.blocks_of(0) == [1, 2, 4] and c.seq_len(0) == 10
    assert c.n_free_blocks == 11 - 4
    c.sync()
    assert c.block_tables.device.type == "cpu"  # torch names a CPU tensor's device "cpu", whatever was asked
    assert c.block_tables[0].tolist() == [1, 2, 4, 0, 0, 0, 0, 0]
    assert c.block_tables[2].tolist() == [3, 0, 0, 0, 0, 0, 0, 0]
    assert c.seq_lens.tolist() == [10, 0, 1, 0]
    tables, lens = c.table_rows([2, 0])
    assert tables.tolist() == [c.block_tables[2].tolist(), c.block_tables[0].tolist()] and lens.tolist() == [1, 10]
    assert c.slots(0, 3, 5).tolist() == [7, 8]


def test_static_tables_keep_their_storage_as_sequences_come_and_go():
    c = _cache()
    ptrs = (c.block_tables.data_ptr(), c.seq_lens.data_ptr())
    for step in range(5):
        c.allocate(step % 4, 5)
        c.sync()
        c.free(step % 4)
        c.sync()
    assert (c.block_tables.data_ptr(), c.seq_lens.data_ptr()) == ptrs
    assert c.n_free_blocks == 11 and c.seq_lens.tolist() == [0, 0, 0, 0]
    assert int(c.block_tables.abs().sum()) == 0


def test_free_and_truncate_return_blocks():
    c = _cache()
    c.allocate(1, 9)  # blocks 1, 2, 3
    c.truncate(1, 5)  # keeps blocks 1, 2
    assert c.blocks_of(1) == [1, 2] and c.seq_len(1) == 5 and c.n_free_blocks == 9
    c.truncate(1, 7)  # longer than held: unchanged
    assert c.seq_len(1) == 5
    assert c.append(1, 2).tolist() == [9, 10]  # continues in block 2
    c.free(1)
    c.sync()
    assert c.n_free_blocks == 11 and c.block_tables[1].tolist() == [0] * 8 and c.seq_lens[1] == 0


def test_write_and_gather_round_trip():
    c = _cache()
    slots = c.allocate(0, 7)
    _store(c, slots, 1.0)
    k, v = c.gather(1, 0)
    want_k, want_v = _kv_rows(1.0, 7)
    torch.testing.assert_close(k, want_k + 1, rtol=0, atol=0)
    torch.testing.assert_close(v, want_v + 1, rtol=0, atol=0)
    # the rows sit where the slots say, in the flat pool
    flat = c.k[0].view(-1, 2, 3)
    torch.testing.assert_close(flat[torch.from_numpy(slots)], want_k, rtol=0, atol=0)


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    c = _cache()
    _store(c, c.allocate(0, 6), 1.0)  # blocks 1 (full), 2 (2 of 4 positions)
    c.fork(0, 1, 6)
    assert c.blocks_of(1) == [1, 2]
    assert [c.allocator.ref_count(b) for b in (1, 2)] == [2, 2]
    free_before = c.n_free_blocks
    slots = c.append(1)  # lands in shared block 2: copied first
    assert c.blocks_of(1)[0] == 1 and c.blocks_of(1)[1] not in (1, 2)
    assert c.allocator.ref_count(2) == 1 and c.n_free_blocks == free_before - 1
    _store(c, slots, 9.0)
    k0, _ = c.gather(0, 0)
    k1, _ = c.gather(0, 1)
    torch.testing.assert_close(k1[:6], k0, rtol=0, atol=0)  # the copied prefix
    torch.testing.assert_close(k1[6], _kv_rows(9.0, 1)[0][0], rtol=0, atol=0)
    torch.testing.assert_close(k0, _kv_rows(1.0, 6)[0], rtol=0, atol=0)  # the source is untouched
    # the source's own next write stays in its block 2, which it alone holds now
    assert c.append(0).tolist() == [2 * BS + 2]


def test_fork_at_a_block_boundary_copies_nothing():
    c = _cache()
    c.allocate(0, 8)
    c.fork(0, 3, 4)  # the first (full) block only
    free_before = c.n_free_blocks
    assert c.append(3).tolist() == [c.blocks_of(3)[1] * BS]
    assert c.blocks_of(3)[0] == 1 and c.allocator.ref_count(1) == 2
    assert c.n_free_blocks == free_before - 1


def test_share_attach_release_is_the_paged_prefix_cache():
    c = _cache()
    _store(c, c.allocate(0, 7), 2.0)
    prefix = c.share(0, 6)
    assert prefix.blocks == (1, 2) and prefix.n_tokens == 6
    c.free(0)  # the cache entry keeps the blocks alive
    assert c.n_free_blocks == 9
    assert c.attach(2, prefix, 5) == 5 and c.blocks_of(2) == [1, 2]
    k, _ = c.gather(0, 2)
    torch.testing.assert_close(k, _kv_rows(2.0, 5)[0], rtol=0, atol=0)
    _store(c, c.append(2), 7.0)  # position 5, block 2 shared with the entry: copied
    assert c.blocks_of(2)[1] != 2
    assert c.attach(3, prefix) == 6
    k3, _ = c.gather(0, 3)
    torch.testing.assert_close(k3, _kv_rows(2.0, 6)[0], rtol=0, atol=0)  # the entry's position 5
    c.release(prefix)
    with pytest.raises(ValueError, match="released already"):
        c.release(prefix)
    with pytest.raises(ValueError, match="was released"):
        c.attach(1, prefix)
    c.free(2)
    c.free(3)
    assert c.n_free_blocks == 11


def test_errors_name_the_sequence_and_positions_and_change_nothing():
    c = _cache(n_blocks=4)  # 3 usable blocks
    c.allocate(0, 8)
    with pytest.raises(OutOfBlocksError, match=r"seq 1: positions 0\.\.8 need 3 more KV blocks of 4 positions, 1 free"):
        c.allocate(1, 9)
    assert c.seq_len(1) == 0 and c.n_free_blocks == 1
    with pytest.raises(KVCacheError, match=r"seq 0: positions 8\.\.32 exceed the context size 32"):
        c.append(0, 25)
    with pytest.raises(KVCacheError, match="seq 0: cannot allocate, it holds 8 positions"):
        c.allocate(0, 1)
    with pytest.raises(KVCacheError, match="seq 7: not a sequence of this cache"):
        c.append(7)
    with pytest.raises(KVCacheError, match="seq 0: cannot fork 9 positions, it holds 8"):
        c.fork(0, 1, 9)
    with pytest.raises(KVCacheError, match="seq 0: cannot share 0 positions"):
        c.share(0, 0)
    with pytest.raises(KVCacheError, match=r"seq 0: positions 6\.\.8 are not held"):
        c.slots(0, 6, 9)
    # a fork whose copy-on-write needs a block that is not there
    c2 = _cache(n_blocks=3)
    c2.allocate(0, 6)
    c2.fork(0, 1, 6)
    with pytest.raises(OutOfBlocksError, match=r"seq 1: positions 6\.\.6 need 1 more"):
        c2.append(1)
    assert c2.blocks_of(1) == [1, 2] and c2.seq_len(1) == 6


def test_block_keys_chain_tokens_and_the_adapter_set():
    toks = list(range(10))
    a = block_keys("set-a", toks, 4)
    assert len(a) == 2 and len(a[0]) == 32  # the partial third block has no key
    assert block_keys("set-a", toks[:8], 4) == a
    assert block_keys("set-b", toks, 4)[0] != a[0]  # another adapter set
    other = block_keys("set-a", [99, *toks[1:]], 4)
    assert other[0] != a[0] and other[1] != a[1]  # block 1's key depends on block 0's tokens


def test_n_blocks_for_counts_both_pools_of_every_layer():
    per_block = 2 * 4 * 2 * (3 + 5) * 2  # layers * block * heads * (dk + dv) * bf16 bytes
    sizes = dict(n_layer=2, n_head_kv=2, head_dim_k=3, head_dim_v=5, block_size=4, dtype=torch.bfloat16)
    assert n_blocks_for(per_block * 10 + 1, **sizes) == 10
    assert n_blocks_for(per_block - 1, **sizes) == 0


def test_random_operations_match_a_plain_reference():
    """Sequences come and go, fork, share, attach and truncate at random; every position any
    sequence holds keeps the value written for it, the device tables equal the host's, and
    every block comes back at the end."""
    rng = random.Random(7)
    c = _cache(n_blocks=24, max_seqs=5, n_ctx=40)
    held: dict[int, list[float]] = {s: [] for s in range(5)}  # per sequence: the tag of each position
    prefixes: list[tuple[object, list[float]]] = []
    tag = 0.0
    for _ in range(300):
        s = rng.randrange(5)
        op = rng.choice(["append", "append", "append", "free", "truncate", "fork", "share", "attach", "release"])
        try:
            if op == "append":
                n = rng.randint(1, 6)
                slots = c.append(s, n)
                for slot in slots:
                    tag += 1.0
                    _store(c, np.array([slot]), tag)
                    held[s].append(tag)
            elif op == "free":
                c.free(s)
                held[s] = []
            elif op == "truncate":
                n = rng.randint(0, len(held[s]) + 1)
                c.truncate(s, n)
                held[s] = held[s][: max(0, n)]
            elif op == "fork" and held[s]:
                d = rng.choice([x for x in range(5) if x != s])
                c.free(d)
                n = rng.randint(1, len(held[s]))
                c.fork(s, d, n)
                held[d] = held[s][:n]
            elif op == "share" and held[s]:
                n = rng.randint(1, len(held[s]))
                prefixes.append((c.share(s, n), held[s][:n]))
            elif op == "attach" and prefixes:
                p, tags = rng.choice(prefixes)
                held[s] = tags[: c.attach(s, p)]
            elif op == "release" and prefixes:
                c.release(prefixes.pop(rng.randrange(len(prefixes)))[0])
        except OutOfBlocksError:
            pass  # nothing changed: the reference stays as it was
        except KVCacheError:
            assert op == "append" and len(held[s]) + n > 40
        for q in range(5):
            assert c.seq_len(q) == len(held[q])
            if held[q]:
                k, v = c.gather(1, q)
                want = torch.tensor(held[q]).view(-1, 1, 1) + 1  # layer 1 adds 1
                torch.testing.assert_close(k[:, :, 0:1], want.expand(-1, 2, 1), rtol=0, atol=0)
                torch.testing.assert_close(v[:, :, 0:1], want.expand(-1, 2, 1) + 0.5, rtol=0, atol=0)
        c.sync()
        tables, lens = c.table_rows(range(5))
        assert torch.equal(c.block_tables, torch.from_numpy(tables)) and torch.equal(c.seq_lens, torch.from_numpy(lens))
    for p, _ in prefixes:
        c.release(p)
    for q in range(5):
        c.free(q)
    assert c.n_free_blocks == 23
