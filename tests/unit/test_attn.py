"""Decode attention kernel (``worker/runtime/kernels/csrc/attn.cpp`` via ``kernels.attn``).

Reference: the f64 SDPA of ``worker.runtime.graph._sdpa`` (the torch decode path), one
sequence at a time. Tolerance: every output element within 1e-5 × max |reference| of its
(sequence, head) row (f32 dot products and accumulation over up to 3000 keys; measured
≤ 1e-6). Bit-equality where the kernel promises it: a row alone vs batched, 1 vs 2 threads,
any head-block split.
"""

from __future__ import annotations

import math

import pytest
import torch

from worker.runtime.graph import DecodeRows, _sdpa, attn_decode_batch
from worker.runtime.kernels import KernelError, KernelPathError, supported
from worker.runtime.kernels.attn import attn_decode, resolve_attn, supports
from worker.runtime.kv_cache import KVCache

PATHS = [
    pytest.param("avx2", marks=pytest.mark.skipif(not supported("avx2"), reason="CPU lacks AVX2/FMA/F16C")),
    pytest.param(
        "avx512",
        marks=pytest.mark.skipif(
            not supported("avx512"), reason="CPU lacks AVX-512 F/BW/VL/VNNI: only the AVX2 path is tested here"
        ),
    ),
]
TOL = 1e-5
CAP = 3000
# (cache row, position): contexts 1..3000, tile edges (32), rows out of order and not consecutive
SEQS = [(5, 2999), (0, 0), (3, 31), (6, 32), (1, 1000), (7, 1)]


def _cache(hkv: int, dk: int, dv: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(8, CAP, hkv, dk, generator=g).to(dtype)
    v = torch.randn(8, CAP, hkv, dv, generator=g).to(dtype)
    return k, v


def _reference(q, kc, vc, rows, pos, scale, n_swa, softcap) -> torch.Tensor:
    """f64 SDPA per sequence over keys lo..pos (the torch decode path's arithmetic)."""
    out = []
    for b in range(q.shape[0]):
        p, r = int(pos[b]), int(rows[b])
        lo = max(0, p - n_swa + 1) if n_swa > 0 else 0
        k = kc[r, lo : p + 1].double().transpose(0, 1).unsqueeze(0)
        v = vc[r, lo : p + 1].double().transpose(0, 1).unsqueeze(0)
        mask = torch.ones(1, 1, 1, p + 1 - lo, dtype=torch.bool)
        out.append(_sdpa(q[b : b + 1].double().unsqueeze(2), k, v, mask, scale, softcap).squeeze(2))
    return torch.cat(out)


def _assert_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    bound = TOL * ref.abs().amax(dim=-1, keepdim=True)
    err = (got.double() - ref).abs()
    assert bool((err <= bound).all()), f"{what}: worst {float((err / bound).max()) * TOL:.2e} relative"


def _inputs(rep: int, d: int, hkv: int = 2, seqs=SEQS, dtype=torch.float32, seed: int = 0):
    kc, vc = _cache(hkv, d, d, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = 2.0 * torch.randn(len(seqs), rep * hkv, d, generator=g)
    rows = torch.tensor([r for r, _ in seqs])
    pos = torch.tensor([p for _, p in seqs])
    return q, kc, vc, rows, pos


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rep", [1, 2, 4, 8])
@pytest.mark.parametrize("d", [64, 128, pytest.param(256, marks=pytest.mark.slow)])
def test_matches_f64_reference(path, rep, d):
    """GQA ratio × head dim × (SWA, softcap) on/off, contexts 1..3000, rows out of order."""
    q, kc, vc, rows, pos = _inputs(rep, d)
    scale = 1.0 / math.sqrt(d)
    for n_swa, softcap in [(0, 0.0), (512, 0.0), (0, 3.0), (100, 50.0)]:
        got = attn_decode(q, kc, vc, rows, pos, kq_scale=scale, n_swa=n_swa, softcap=softcap, path=path)
        assert got.shape == (len(SEQS), q.shape[1], d) and got.dtype == torch.float32
        _assert_close(got, _reference(q, kc, vc, rows, pos, scale, n_swa, softcap), f"swa {n_swa} cap {softcap}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_caches(path, dtype):
    """bf16 / f16 caches (the model's compute dtype) are read as they are stored: the reference
    sees the same rounded values in f64."""
    q, kc, vc, rows, pos = _inputs(4, 256, hkv=1, dtype=dtype)
    got = attn_decode(q, kc, vc, rows, pos, kq_scale=0.0625, n_swa=512, path=path)
    _assert_close(got, _reference(q, kc, vc, rows, pos, 0.0625, 512, 0.0), str(dtype))


@pytest.mark.parametrize("path", PATHS)
def test_distinct_k_v_dims_and_odd_multiples(path):
    """dk ≠ dv and a head dim that is a multiple of 16 but not of the vector width (80)."""
    kc, _ = _cache(2, 80, 80)
    _, vc = _cache(2, 48, 48, seed=3)
    q = torch.randn(len(SEQS), 4, 80)
    rows, pos = torch.tensor([r for r, _ in SEQS]), torch.tensor([p for _, p in SEQS])
    got = attn_decode(q, kc, vc, rows, pos, kq_scale=0.1, path=path)
    assert got.shape == (len(SEQS), 4, 48)
    _assert_close(got, _reference(q, kc, vc, rows, pos, 0.1, 0, 0.0), "dk 80 dv 48")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("rep", "d"), [(4, 128), (7, 64)])
def test_row_alone_equals_batched_and_threads_do_not_matter(path, rep, d):
    """Bit-identical: each sequence alone vs the batch (any order), 1 vs 2 threads, and every
    head-block split (which query heads of a KV head share a task: up to 8 in registers, so 7
    heads per KV head run as one block or as any split), with the parallel-work threshold on
    (B=1 short contexts run on one thread) or off."""
    q, kc, vc, rows, pos = _inputs(rep, d)
    kw = dict(kq_scale=0.09, n_swa=700, softcap=20.0, path=path, min_parallel_work=0)  # 2 threads do run
    full = attn_decode(q, kc, vc, rows, pos, nthreads=1, **kw)
    assert torch.equal(full, attn_decode(q, kc, vc, rows, pos, nthreads=2, **kw))
    for hb in range(1, rep + 1):
        assert torch.equal(full, attn_decode(q, kc, vc, rows, pos, nthreads=2, head_block=hb, **kw)), hb
    for b in range(len(SEQS)):
        alone = attn_decode(q[b : b + 1], kc, vc, rows[b : b + 1], pos[b : b + 1], nthreads=2, **kw)
        assert torch.equal(alone[0], full[b]), b
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    shuffled = attn_decode(q[perm], kc, vc, rows[perm], pos[perm], nthreads=2, **kw)
    assert torch.equal(shuffled, full[perm])
    kw["min_parallel_work"] = 1 << 23
    assert torch.equal(full, attn_decode(q, kc, vc, rows, pos, nthreads=2, **kw))


@pytest.mark.parametrize("path", PATHS)
def test_only_visible_keys_are_read(path):
    """Keys past a row's position and outside its window never count: poisoning them (NaN)
    changes nothing."""
    q, kc, vc, rows, pos = _inputs(2, 64)
    want = attn_decode(q, kc, vc, rows, pos, kq_scale=0.125, n_swa=40, path=path)
    for r, p in SEQS:
        kc[r, p + 1 :] = float("nan")
        vc[r, p + 1 :] = float("nan")
        kc[r, : max(0, p - 40 + 1)] = float("nan")
        vc[r, : max(0, p - 40 + 1)] = float("nan")
    assert torch.equal(attn_decode(q, kc, vc, rows, pos, kq_scale=0.125, n_swa=40, path=path), want)


def test_unsupported_shapes_are_refused():
    kc, vc = _cache(2, 72, 72)
    assert not supports(kc, vc, 4)  # 72 is not a multiple of 16
    assert not supports(*_cache(2, 64, 64), 3)  # H not a multiple of Hkv
    assert not supports(*_cache(1, 576, 576), 1)  # > 512
    assert not supports(kc.double(), vc.double(), 4)
    assert supports(*_cache(2, 64, 64), 4)
    with pytest.raises(KernelError, match="unsupported"):
        attn_decode(torch.randn(1, 4, 72), kc, vc, torch.tensor([0]), torch.tensor([3]), kq_scale=1.0)
    kc, vc = _cache(2, 64, 64)
    with pytest.raises(KernelError, match="outside the cache"):
        attn_decode(torch.randn(1, 4, 64), kc, vc, torch.tensor([8]), torch.tensor([3]), kq_scale=1.0)
    with pytest.raises(KernelError, match="outside the cache"):
        attn_decode(torch.randn(1, 4, 64), kc, vc, torch.tensor([0]), torch.tensor([CAP]), kq_scale=1.0)


def test_resolve_attn(monkeypatch):
    monkeypatch.setenv("LORAPLANE_ATTN", "torch")
    assert resolve_attn() == "torch"
    monkeypatch.setenv("LORAPLANE_ATTN", "flash")
    with pytest.raises(KernelPathError, match="unknown attention path 'flash'"):
        resolve_attn()
    monkeypatch.delenv("LORAPLANE_ATTN")
    assert resolve_attn() == ("c" if supported("avx2") else "torch")


def _decode_batch(kv: KVCache, q, k, v, cache_rows: list[int], pos: list[int], n_swa: int, softcap: float):
    rows = torch.arange(len(cache_rows))
    first = cache_rows[0]
    dec = DecodeRows(
        rows=rows,
        cache_rows=torch.tensor(cache_rows),
        pos=torch.tensor(pos),
        pos_min=min(pos),
        pos_max=max(pos),
        key_pos=torch.arange(kv.n_ctx_seq),
        contiguous_from=first if cache_rows == list(range(first, first + len(cache_rows))) else None,
    )
    return attn_decode_batch(kv, 0, q, k, v, dec, 0.125, n_swa, softcap)


@pytest.mark.skipif(not supported("avx2"), reason="CPU lacks AVX2: no C kernel path")
@pytest.mark.parametrize("d", [64, 24])
def test_graph_decode_uses_kernel_and_falls_back(monkeypatch, d):
    """``attn_decode_batch``: the kernel (d = 64) agrees with the torch path
    within the tolerance; an unsupported head dim (24) takes the torch path, bit-equal to
    ``LORAPLANE_ATTN=torch``. The new K/V rows are written to the cache either way."""
    g = torch.Generator().manual_seed(7)
    cache_rows, pos = [2, 0, 3], [40, 7, 100]
    kv = KVCache(
        n_layer=1,
        n_head_kv=2,
        n_embd_head_k=d,
        n_embd_head_v=d,
        n_ctx_seq=128,
        dtype=torch.float32,
        device=torch.device("cpu"),
        n_seq_hint=4,
    )
    kv.begin_append(0, 0, 101)
    with torch.inference_mode():  # the cache holds inference tensors
        kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g))
        kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=g))
    q, k, v = (torch.randn(3, n, d, generator=g) for n in (8, 2, 2))
    out = {}
    for mode in ("c", "torch"):
        monkeypatch.setenv("LORAPLANE_ATTN", mode)
        with torch.inference_mode():
            out[mode] = _decode_batch(kv, q, k, v, cache_rows, pos, n_swa=32, softcap=10.0)
        for b, (r, p) in enumerate(zip(cache_rows, pos, strict=True)):
            assert torch.equal(kv.k[0][r, p], k[b]) and torch.equal(kv.v[0][r, p], v[b])
    if d == 64:
        direct = attn_decode(
            q, kv.k[0], kv.v[0], torch.tensor(cache_rows), torch.tensor(pos), kq_scale=0.125, n_swa=32, softcap=10.0
        )
        assert torch.equal(out["c"], direct)
        _assert_close(out["c"], out["torch"].double(), "graph c vs torch")
        assert not torch.equal(out["c"], out["torch"])  # two different computations ran
    else:
        assert torch.equal(out["c"], out["torch"])
