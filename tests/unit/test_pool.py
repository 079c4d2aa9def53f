"""Unit tests of the adapter slot pool on tiny synthetic tensors (fast tier):
page-in as an in-place copy, LRU eviction, holds, pinning, capacity errors, rank growth,
generation (graph reuse), and the side path for token_embd."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
import torch

from loraplane.formats.adapter_file import AdapterError
from tests.helpers.lora_fakes import D, K, adapter
from worker.lora.adapter import LoraAdapter, LoraPair, load_lora_adapter, open_lora_adapter
from worker.lora.adapter_set import AdapterSet
from worker.lora.plan import build_plan
from worker.lora.pool import LoraPool, PoolCapacityError, PoolExhaustedError

ADS = [adapter(f"a{i}", seed=i, rank=2 + i % 3) for i in range(6)]


def test_page_in_is_an_in_place_copy_padded_with_zeros():
    pool = LoraPool(3, 8)
    r = pool.acquire([ADS[0], ADS[1]])
    assert r.slots == {ADS[0].sha256: 0, ADS[1].sha256: 1} and set(r.paged_in) == {ADS[0].sha256, ADS[1].sha256}
    w = pool.weights["w"]
    a_buf, b_buf = w.a, w.bt
    torch.testing.assert_close(w.a[1, :3], ADS[1].pairs["w"].lora_a)
    torch.testing.assert_close(w.bt[1, :3], ADS[1].pairs["w"].lora_b.T)
    assert torch.count_nonzero(w.a[1, 3:]) == 0 and torch.count_nonzero(w.a[2]) == 0
    assert w.factor.tolist() == [1.0, 1.0, 0.0] and w.rank_of == [2, 3, 0]
    pool.release([ADS[0], ADS[1]])
    before0 = w.a[0].clone()
    pool.acquire([ADS[2]])  # free slot 2: nothing else touched
    assert w.a is a_buf and w.bt is b_buf and torch.equal(w.a[0], before0)
    assert (pool.stats.page_ins, pool.stats.evictions) == (3, 0)


def test_lru_eviction_skips_held_and_counts():
    pool = LoraPool(2, 8)
    pool.acquire([ADS[0]])
    pool.acquire([ADS[1]])
    pool.release([ADS[0]])
    pool.release([ADS[1]])
    pool.acquire([ADS[1]])  # touch 1: 0 is now least recently used
    pool.release([ADS[1]])
    gen = pool.generation
    pool.acquire([ADS[2]])  # evicts 0
    assert pool.slot_of(ADS[0].sha256) is None and pool.slot_of(ADS[2].sha256) == 0
    assert (pool.stats.page_ins, pool.stats.evictions) == (3, 1) and pool.generation > gen
    # both slots held now → a third adapter must wait, and nothing changes
    pool.acquire([ADS[1]])
    with pytest.raises(PoolExhaustedError, match="every one of the 2 slots is held"):
        pool.acquire([ADS[3]])
    assert pool.slot_of(ADS[3].sha256) is None and pool.stats.page_ins == 3
    pool.release([ADS[2]])
    pool.acquire([ADS[3]])
    assert pool.slot_of(ADS[3].sha256) == 0 and pool.stats.evictions == 2


def test_acquire_is_all_or_nothing_and_capacity():
    pool = LoraPool(2, 8)
    pool.acquire([ADS[0]])
    with pytest.raises(PoolExhaustedError):
        pool.acquire([ADS[1], ADS[2]])  # needs 2 free, only 1
    assert pool.resident() == [ADS[0]] and pool.stats.page_ins == 1
    with pytest.raises(PoolCapacityError, match="3 distinct adapters exceed max_loras 2"):
        pool.acquire(ADS[:3])


def test_pinned_is_never_evicted_and_pins_leave_one_slot():
    pool = LoraPool(3, 8)
    pool.set_pinned(ADS[0].sha256, True)
    pool.set_pinned(ADS[1].sha256, True)
    pool.set_pinned(ADS[2].sha256, True)
    for a in ADS[:3]:
        pool.acquire([a])
        pool.release([a])
    assert [s.pinned for s in pool.slots] == [True, True, False]  # at most S-1 pinned
    for a in ADS[3:]:
        pool.acquire([a])
        pool.release([a])
    assert pool.slot_of(ADS[0].sha256) == 0 and pool.slot_of(ADS[1].sha256) == 1
    assert pool.stats.evictions == 3  # ADS[2], ADS[3], ADS[4] took turns in slot 2
    pool.set_pinned(ADS[0].sha256, False)
    pool.acquire([ADS[2]])
    assert pool.slot_of(ADS[0].sha256) is None and pool.slot_of(ADS[2].sha256) == 0  # LRU unpinned went


def test_evict_held_is_refused_and_frees_slot():
    pool = LoraPool(2, 8)
    pool.acquire([ADS[0]])
    with pytest.raises(PoolExhaustedError, match="held by 1 request"):
        pool.evict(ADS[0].sha256)
    pool.release([ADS[0]])
    assert pool.evict(ADS[0].sha256) and pool.resident() == [] and pool.weights["w"].factor[0] == 0.0
    assert pool.evict(ADS[0].sha256) is False


def test_rank_growth_keeps_other_slots():
    pool = LoraPool(2, 64)
    small, big = adapter("s", rank=4), adapter("b", rank=20, seed=9)
    pool.acquire([small])
    assert pool.weights["w"].rank_cap == 8
    pool.acquire([big])
    w = pool.weights["w"]
    assert w.rank_cap == 24 and pool.stats.rank_growths == 1
    torch.testing.assert_close(w.a[0, :4], small.pairs["w"].lora_a)
    torch.testing.assert_close(w.bt[1, :20], big.pairs["w"].lora_b.T)


def test_heterogeneous_ranks_and_weights_routed_by_slot():
    """Ranks 4, 8, 16, 64 and adapters on different weights, one product per weight."""
    from loraplane.formats.adapter_file import lora_scale
    from worker.runtime.graph import GraphContext, GraphInputs

    ads = [
        adapter("r4", rank=4, alpha=8.0, weights=("w",), seed=1),
        adapter("r8", rank=8, weights=("w", "v"), seed=2),
        adapter("r16", rank=16, alpha=4.0, weights=("v",), seed=3),
        adapter("r64", rank=64, alpha=16.0, weights=("w",), seed=4),
    ]
    pool = LoraPool(4, 64)
    pool.acquire(ads)
    sets = (
        AdapterSet.of({0: (ads[0], 1.0), 2: (ads[2], 0.5)}),
        AdapterSet.of({1: (ads[1], 2.0)}),
        AdapterSet.of({3: (ads[3], 1.0), 1: (ads[1], 1.0)}),
    )
    plan = build_plan(sets, pool)
    route = torch.tensor([0, 1, 2, 2, 0])
    x = torch.randn(5, K)
    inputs = GraphInputs(
        tokens=torch.zeros(5, dtype=torch.long), pos=torch.arange(5), spans=[], out_rows=torch.arange(5), row_set=route
    )
    g = GraphContext({"w": torch.zeros(D, K), "v": torch.zeros(D, K)}, inputs, plan, None, torch.float32)  # type: ignore[arg-type]
    for name in ("w", "v"):
        y = g.build_lora_mm(name, x)
        for i, j in enumerate(route.tolist()):
            ref = torch.zeros(D)
            for _, ad, sc in sets[j].entries:
                p = ad.pairs.get(name)
                if p is not None:
                    ref += lora_scale(sc, ad.alpha, p.rank) * (p.lora_b @ (p.lora_a @ x[i]))
            torch.testing.assert_close(y[i], ref, rtol=1e-4, atol=1e-4)


def test_token_embd_side_branch_follows_slots():
    emb = LoraAdapter(
        path="/x/e.gguf",
        sha256="e" * 64,
        arch="llama",
        name="e",
        alpha=0.0,
        pairs=types.MappingProxyType(
            {"token_embd.weight": LoraPair("token_embd.weight", torch.randn(10, 2), torch.randn(D, 2))}
        ),
        alora_invocation_tokens=(),
        task_name="",
        prompt_prefix="",
        size_bytes=0,
    )
    pool = LoraPool(3, 8)
    pool.acquire([ADS[0], emb])
    assert "token_embd.weight" not in pool.weights
    assert pool.side[0] == {} and list(pool.side[1]) == ["token_embd.weight"]
    br = pool.side[1]["token_embd.weight"]
    assert br.factor == 1.0 and torch.equal(br.lora_a, emb.pairs["token_embd.weight"].lora_a)
    # routing: only slots a set uses count, and the side branch is applied per used slot
    plan = build_plan([AdapterSet.of({0: (ADS[0], 1.0)}), AdapterSet.of({1: (emb, 0.5)})], pool)
    assert plan.side_slots == (1,)
    assert build_plan([AdapterSet.of({0: (ADS[0], 1.0)})], pool).side_slots == ()
    # paging another adapter into slot 2 leaves slot 1's side branch object untouched
    pool.release([ADS[0], emb])
    pool.acquire([ADS[1]])
    assert pool.side[1]["token_embd.weight"] is br
    pool.evict(emb.sha256)
    assert pool.side[1] == {}


# --- fetch into the worker's cache ----------------------------------------------------------
def test_fetch_to_file_verifies_the_hash_and_leaves_nothing_on_failure(tmp_path):
    import hashlib

    from worker.errors import AdapterFetchError
    from worker.lora.host_cache import fetch_to_file

    data = b"GGUF" + bytes(range(256)) * 5
    sha = hashlib.sha256(data).hexdigest()

    def good(digest: str):
        assert digest == sha
        yield data[:100]
        yield data[100:]

    target = tmp_path / f"{sha}.gguf"
    assert fetch_to_file(good, 3, sha, target) == len(data) and target.read_bytes() == data

    def other(digest: str):
        yield b"not the adapter"

    bad = tmp_path / "bad.gguf"
    with pytest.raises(AdapterFetchError, match="hash mismatch") as info:
        fetch_to_file(other, 4, sha, bad)
    assert "adapter 4" in str(info.value) and not info.value.not_found
    assert list(tmp_path.iterdir()) == [target]  # no partial file

    def missing(digest: str):
        raise AdapterFetchError("NOT_FOUND: no registered adapter has sha256 x", not_found=True)
        yield b""  # pragma: no cover - makes this a generator

    with pytest.raises(AdapterFetchError, match="fetching sha256 .* failed: NOT_FOUND") as info:
        fetch_to_file(missing, 5, sha, tmp_path / "m.gguf")
    assert info.value.not_found and list(tmp_path.iterdir()) == [target]


def test_file_backed_page_in_equals_in_memory_and_a_bad_file_evicts_nothing(tmp_path):
    """The host tier is file-backed: a page-in re-reads the file (F16 converted to the pool's
    dtype while copying) and fills the slot exactly as an in-memory adapter does; a file that
    changed since validation fails the page-in before the victim slot is touched."""
    from tests.helpers.adapter_gguf import BASE, write_adapter_gguf

    rng = np.random.default_rng(3)
    paths = []
    for i, r in enumerate((4, 8)):
        t = {
            "blk.0.attn_q.weight.lora_a": rng.standard_normal((r, 32)).astype(np.float16),
            "blk.0.attn_q.weight.lora_b": rng.standard_normal((24, r)).astype(np.float16),
        }
        paths.append(write_adapter_gguf(tmp_path / f"a{i}.gguf", t))
    mem = [load_lora_adapter(p, base_arch="llama", base_tensors=BASE) for p in paths]
    fb = [open_lora_adapter(p, base_arch="llama", base_tensors=BASE) for p in paths]
    pm, pf = LoraPool(2, 16), LoraPool(2, 16)
    pm.acquire(mem)
    pf.acquire(fb)
    wm, wf = pm.weights["blk.0.attn_q.weight"], pf.weights["blk.0.attn_q.weight"]
    assert wf.a.dtype == torch.float32
    assert torch.equal(wm.a, wf.a) and torch.equal(wm.bt, wf.bt) and torch.equal(wm.factor, wf.factor)
    # staged tensors (read ahead on another thread) give the same slot content
    ps = LoraPool(2, 16)
    ps.acquire(fb, {a.sha256: LoraPool.stage(a) for a in fb})
    assert torch.equal(ps.weights["blk.0.attn_q.weight"].a, wf.a)

    pf.release(fb)
    t = {
        "blk.0.attn_q.weight.lora_a": rng.standard_normal((4, 32)).astype(np.float16),
        "blk.0.attn_q.weight.lora_b": rng.standard_normal((24, 4)).astype(np.float16),
    }
    third = open_lora_adapter(write_adapter_gguf(tmp_path / "c.gguf", t), base_arch="llama", base_tensors=BASE)
    st = os.stat(third.path)
    os.utime(third.path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    before = (wf.a.clone(), dict(pf.by_sha), pf.stats.evictions)
    with pytest.raises(AdapterError, match="changed on disk"):
        pf.acquire([third])
    assert torch.equal(wf.a, before[0]) and pf.by_sha == before[1] and pf.stats.evictions == before[2]
