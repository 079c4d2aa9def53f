"""The device LoRA kernels (``worker.gpu.kernels.lora``) against the f64 reference of
``y[i] += Σ_s row_slot[i,s]·factor[s]·B_s(A_s x_i)``, on CUDA or under Triton's interpreter
(``tests/helpers/gpu.py``).

Cases: ranks 8/16/64 mixed in one batch (padded to R = 64 with zero rows, as the pool stores
them), rows with two adapters (stacked), rows with none (left bit-identical), zero scales, a
slot with no branch (factor 0), the true rank as a tensor (rows past it ignored even when they
hold garbage), ``y`` a column slice of a fused output (the other columns bit-identical), f32 /
bf16 / f16, few rows (K split) and prefill-sized segments; the side branches (embedding, MoE
experts) against explicit loops. The fast tier keeps a few small cases; the sweep is slow.

Tolerances (max abs error vs the f64 reference, relative to the largest |reference| value
``m``): f32 1e-5·m (IEEE f32 products, f32 accumulation; measured ≤ 2e-7); bf16 2⁻⁶·m (the
16-bit intermediate and y are each rounded to bf16, up to one ulp = 2⁻⁸ each since Triton 3.6's
interpreter truncates where the GPU rounds to nearest; measured ≤ 7.8e-3); f16 2⁻⁹·m
(numpy rounds to nearest; measured ≤ 4e-4).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.gpu import NO_TRITON, TRITON
from worker.gpu.kernels import triton_env
from worker.gpu.kernels.lora import (
    add_lora,
    add_lora_embedding,
    add_lora_experts,
    lora_reference,
    split_k_for,
)
from worker.lora.pool import SideBranch

needs_triton = pytest.mark.skipif(not TRITON, reason=NO_TRITON)

REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-9}
RANKS = (8, 16, 64, 0)  # slot 3 has no branch on this weight (rank 0, factor 0)


def _pool(S: int, k: int, d: int, dtype: torch.dtype, device: torch.device, seed: int, ranks=RANKS):
    """Slot buffers as ``worker.lora.pool`` lays them out: ``a (S, R, k)``, ``bt (S, R, d)``
    with R = the largest rank, rows past a slot's rank zero; factor = alpha / r (alpha 16)."""
    g = torch.Generator().manual_seed(seed)
    R = max(ranks)
    rank = torch.tensor([ranks[s % len(ranks)] for s in range(S)], dtype=torch.int32)
    a = torch.randn(S, R, k, generator=g) / k**0.5
    bt = torch.randn(S, R, d, generator=g) * 0.3
    for s in range(S):
        a[s, rank[s] :] = 0
        bt[s, rank[s] :] = 0
    factor = torch.where(rank > 0, 16.0 / rank.clamp(min=1).float(), torch.zeros(S))
    return a.to(dtype).to(device), bt.to(dtype).to(device), factor.to(device), rank.to(device)


def _row_slot(n: int, U: int, seed: int, *, segments: int = 0) -> torch.Tensor:
    """Per-row slot scales: row 0 none, row 1 two slots (stacked, one negative scale), row 2 an
    explicit zero; the rest one slot each (random, or runs of ``segments`` rows sharing a slot,
    the prefill layout)."""
    g = torch.Generator().manual_seed(seed)
    rs = torch.zeros(n, U)
    for i in range(3, n):
        s = (i // segments) % U if segments else int(torch.randint(0, U, (1,), generator=g))
        rs[i, s] = 0.25 + 1.25 * float(torch.rand(1, generator=g))
    if n > 1:
        rs[1, 0], rs[1, U - 1] = 0.7, -0.4
    if n > 2:
        rs[2, 1 % U] = 0.0
    return rs


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    m = float(ref.double().abs().max().clamp(min=1.0))
    err = float((out.double() - ref.double()).abs().max())
    assert err <= REL_TOL[dtype] * m, f"max abs error {err:.3g} > {REL_TOL[dtype]:.3g} · {m:.3g}"


def _case(device, dtype, *, n, k, d, S=4, U=4, seed=0, segments=0, split_k=None, rank=True, fused=False):
    a, bt, factor, rk = _pool(S, k, d, dtype, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, k, generator=g).to(dtype).to(device)
    rs = _row_slot(n, U, seed + 2, segments=segments).to(device)
    if fused:  # y is the middle column slice of a (n, d + 48) fused product (stride(0) != d)
        full = torch.randn(n, d + 48, generator=g).to(dtype).to(device)
        before = full.clone()
        y = full[:, 16 : 16 + d]
    else:
        y = torch.randn(n, d, generator=g).to(dtype).to(device)
    ref = lora_reference(x, y, a, bt, factor, rs, rank=rk if rank else None)
    y0 = y.clone()
    out = add_lora(x, y, a, bt, factor, rs, rank=rk if rank else None, split_k=split_k)
    assert out is y  # in place
    _assert_close(y, ref, dtype)
    untouched = (rs * factor[:U].to(rs.device)).abs().sum(1) == 0
    assert torch.equal(y[untouched], y0[untouched]), "rows with no adapter must be left bit-identical"
    if fused:
        assert torch.equal(full[:, :16], before[:, :16]) and torch.equal(full[:, 16 + d :], before[:, 16 + d :])


# --- fast tier: a few small cases ------------------------------------------------------------


@needs_triton
def test_mixed_ranks_stacked_f32(device):
    """Ranks 8/16/64 and a branchless slot in one batch; stacked, zero and absent rows; f32."""
    _case(device, torch.float32, n=7, k=96, d=80)


@needs_triton
def test_column_slice_bf16(device):
    """bf16 into a column slice of a fused output, the other columns untouched."""
    _case(device, torch.bfloat16, n=5, k=64, d=72, fused=True)


@needs_triton
def test_rank_tensor_skips_rows_past_the_rank(device):
    """With ``rank`` given, rows past r_s are never read: garbage (NaN) there changes nothing."""
    a, bt, factor, rk = _pool(4, 64, 48, torch.float32, device, 3)
    clean_a, clean_bt = a.clone(), bt.clone()
    for s in range(4):
        a[s, int(rk[s]) :] = float("nan")
        bt[s, int(rk[s]) :] = float("nan")
    x = torch.randn(6, 64, device=device)
    rs = _row_slot(6, 4, 5).to(device)
    y = torch.zeros(6, 48, device=device)
    add_lora(x, y, a, bt, factor, rs, rank=rk)
    ref = lora_reference(x, torch.zeros(6, 48, device=device), clean_a, clean_bt, factor, rs)
    assert torch.isfinite(y).all()
    _assert_close(y, ref, torch.float32)


@needs_triton
def test_split_k_partials_add_up(device):
    """Few rows over a wide input: the shrink split along k (3 pieces) equals one piece."""
    assert split_k_for(4, 3072) == 3 and split_k_for(65, 3072) == 1
    _case(device, torch.float32, n=3, k=200, d=40, split_k=3, seed=7)


def test_errors_say_what_is_wrong(device, monkeypatch):
    a, bt, factor, rk = _pool(4, 32, 16, torch.float32, torch.device("cpu"), 0)
    x, y, rs = torch.randn(3, 32), torch.zeros(3, 16), torch.zeros(3, 4)
    with pytest.raises(ValueError, match="shapes disagree"):
        add_lora(x, torch.zeros(3, 17), a, bt, factor, rs)
    with pytest.raises(ValueError, match="U ≤ S"):
        add_lora(x, y, a, bt, factor, torch.zeros(3, 5))
    with pytest.raises(ValueError, match="rank int32"):
        add_lora(x, y, a, bt, factor, rs, rank=rk.long())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(triton_env.KernelUnavailableError, match="TRITON_INTERPRET=1"):
        add_lora(x, y, a, bt, factor, rs)


def test_embedding_branch_matches_a_loop():
    """``add_lora_embedding`` = for each used slot, scale · A[ids] · Bᵀ (torch ops)."""
    g = torch.Generator().manual_seed(0)
    V, d, n = 50, 24, 6
    ids = torch.randint(0, V, (n,), generator=g)
    rs = _row_slot(n, 3, 1)
    branches = [
        (0, SideBranch(torch.randn(V, 8, generator=g), torch.randn(d, 8, generator=g), 2.0)),
        (2, SideBranch(torch.randn(V, 16, generator=g), torch.randn(d, 16, generator=g), 1.0)),
    ]
    y = torch.randn(n, d, generator=g)
    want = y.double().clone()
    for i in range(n):
        for s, br in branches:
            want[i] += float(rs[i, s]) * br.factor * (br.lora_b.double() @ br.lora_a[ids[i]].double())
    add_lora_embedding(ids, y, branches, rs)
    assert float((y.double() - want).abs().max()) < 1e-4


def test_experts_branch_matches_a_loop():
    """``add_lora_experts`` routes each (row, choice) through its own expert's A/B."""
    g = torch.Generator().manual_seed(1)
    E, r, k, d, n, K = 5, 8, 20, 12, 4, 2
    la, lb = torch.randn(E, r, k, generator=g), torch.randn(E, d, r, generator=g)
    ids = torch.randint(0, E, (n, K), generator=g)
    scale = torch.tensor([0.0, 1.0, -0.5, 2.0])
    for x in (torch.randn(n, k, generator=g), torch.randn(n, K, k, generator=g)):
        y = torch.randn(n, K, d, generator=g)
        want = y.double().clone()
        for i in range(n):
            for j in range(K):
                xi = (x[i] if x.dim() == 2 else x[i, j]).double()
                e = int(ids[i, j])
                want[i, j] += float(scale[i]) * (lb[e].double() @ (la[e].double() @ xi))
        add_lora_experts(x, y, ids, la, lb, scale)
        assert float((y.double() - want).abs().max()) < 1e-4


# --- slow tier: the sweep --------------------------------------------------------------------


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize(
    "n,segments,fused",
    [(1, 0, False), (16, 0, True), (37, 0, False), (130, 16, True)],
    ids=["decode1", "decode16-fused", "decode37", "prefill130-segments-fused"],
)
def test_sweep(device, dtype, n, segments, fused):
    """Decode and prefill row counts, every dtype, 6 slots of ranks 8/16/64/none over 5 used,
    with and without the rank tensor."""
    for rank in (True, False):
        _case(device, dtype, n=n, k=160, d=96, S=6, U=5, seed=n, segments=segments, fused=fused, rank=rank)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: checks the compiled kernels in a graph")
def test_graph_replay_follows_new_slots():
    """Captured once in a CUDA graph, the kernels follow ``row_slot`` rewritten between replays
    (adapters paged in/out, rows changing adapters) — no re-capture. Qwen2.5-1.5B q width."""
    dev = torch.device("cuda")
    a, bt, factor, rk = _pool(16, 1536, 1536, torch.bfloat16, dev, 0, ranks=(16,))
    x = torch.randn(16, 1536, device=dev, dtype=torch.bfloat16)
    y = torch.zeros(16, 1536, device=dev, dtype=torch.bfloat16)
    rs = torch.zeros(16, 16, device=dev)
    add_lora(x, y, a, bt, factor, rs, rank=rk)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_lora(x, y, a, bt, factor, rs, rank=rk)
    for seed in range(3):
        rs.copy_(_row_slot(16, 16, seed).to(dev))
        y.zero_()
        graph.replay()
        ref = lora_reference(x, torch.zeros_like(y), a, bt, factor, rs, rank=rk)
        _assert_close(y, ref, torch.bfloat16)
