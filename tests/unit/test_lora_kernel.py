"""The gathered multi-LoRA kernel (``worker.runtime.kernels.lora``, ``csrc/lora.cpp``, BGMV).

- vs a float64 reference of ``y[i] += Σ_s S[i,s]·factor[s]·B_s(A_s x_i)`` for random slots,
  scales and ranks (padded to R with zeros, as the pool stores them), rows with 2 adapters in
  their set, rows with none, a slot with no branch on the weight (factor 0), widths that are
  not multiples of the vector length (scalar tails);
- a row's result is bit-identical alone and batched, with 1 and 2 threads, and on a column
  slice of a fused output (the ``build_lora_mm_group`` case);
- the dense masked product (today's path) agrees with the same reference;
- each ISA path the CPU can run is forced.
"""

from __future__ import annotations

import pytest
import torch

from worker.runtime.kernels import KernelPathError, supported
from worker.runtime.kernels import lora as lora_mod
from worker.runtime.kernels.lora import lora_bgmv, lora_dense, lora_pairs, lora_sgmv_torch

C_PATHS = [
    pytest.param("avx2", marks=pytest.mark.skipif(not supported("avx2"), reason="CPU lacks AVX2/FMA/F16C")),
    pytest.param(
        "avx512",
        marks=pytest.mark.skipif(not supported("avx512"), reason="CPU lacks AVX-512 F/BW/VL/VNNI"),
    ),
]


def _pool(S: int, R: int, k: int, d: int, seed: int):
    """Slot buffers like ``worker.lora.pool``: slot ranks 1..R (rows past r zero), one slot
    with no branch (rank 0, factor 0)."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.randint(1, R + 1, (S,), generator=g).to(torch.int32)
    ranks[S // 2] = 0
    a = torch.randn(S, R, k, generator=g)
    bt = torch.randn(S, R, d, generator=g) * 0.05
    for s in range(S):
        a[s, ranks[s] :] = 0
        bt[s, ranks[s] :] = 0
    factor = torch.where(ranks > 0, 16.0 / ranks.clamp(min=1).float(), torch.zeros(S))
    return a, bt, ranks, factor


def _row_slot(n: int, S: int, seed: int, segments: bool = False) -> torch.Tensor:
    """Per-row slot scales: row 0 no adapter, row 1 two adapters, the rest one each (some on
    the branchless slot; with ``segments`` runs of 5 rows share a slot, the prefill case whose
    rows the kernel tiles together), scales in [0.25, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    rs = torch.zeros(n, S)
    for i in range(1, n):
        s = (i // 5) % S if segments else int(torch.randint(0, S, (1,), generator=g))
        rs[i, s] = 0.25 + 1.25 * float(torch.rand(1, generator=g))
    rs[1].zero_()
    rs[1, 0], rs[1, S - 1] = 0.7, -0.4
    return rs


def _reference(x, y, a, bt, factor, rs) -> torch.Tensor:
    out = y.double().clone()
    for i in range(x.shape[0]):
        for s in range(a.shape[0]):
            c = float(rs[i, s]) * float(factor[s])
            if c:
                out[i] += c * (bt[s].double().T @ (a[s].double() @ x[i].double()))
    return out


@pytest.mark.parametrize("path", C_PATHS)
@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize(("S", "R", "k", "d", "n"), [(5, 8, 640, 1024, 7), (9, 16, 200, 37, 13), (3, 24, 33, 300, 40)])
def test_bgmv_vs_float64_reference(path, segments, S, R, k, d, n):
    a, bt, ranks, factor = _pool(S, R, k, d, seed=S * 31 + k)
    rs = _row_slot(n, S, seed=n, segments=segments)
    x, y = torch.randn(n, k), torch.randn(n, d)
    ref = _reference(x, y, a, bt, factor, rs)
    out = lora_bgmv(x, y.clone(), a, bt, ranks, factor, lora_pairs(rs), path=path)
    tol = 2e-5 * (ref.abs().max().item() + 1)
    assert (out.double() - ref).abs().max().item() <= tol
    assert torch.equal(out[0], y[0])  # no adapter: untouched
    dense = lora_dense(x, y, a, bt, factor, rs)
    assert (dense.double() - ref).abs().max().item() <= tol
    sg = lora_sgmv_torch(x, y, a, bt, ranks.tolist(), factor, lora_pairs(rs))
    assert (sg.double() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("path", C_PATHS)
@pytest.mark.parametrize("segments", [False, True])
def test_row_alone_equals_batched_and_threads(path, segments, monkeypatch):
    monkeypatch.setattr(lora_mod, "PARALLEL_MIN_MACS", 0)  # use the threads even for this size
    monkeypatch.setattr(lora_mod, "PARALLEL_MIN_SLOT_FLOATS", 0)
    S, R, k, d, n = 16, 8, 640, 2048, 16
    a, bt, ranks, factor = _pool(S, R, k, d, seed=1)
    rs = _row_slot(n, S, seed=2, segments=segments)
    x, y = torch.randn(n, k), torch.randn(n, d)
    x[5] *= 100.0  # an outlier row in the batch
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full2 = lora_bgmv(x, y.clone(), a, bt, ranks, factor, lora_pairs(rs), path=path)
        torch.set_num_threads(1)
        full1 = lora_bgmv(x, y.clone(), a, bt, ranks, factor, lora_pairs(rs), path=path)
        torch.set_num_threads(2)
        for i in (1, 3, 5):
            alone = lora_bgmv(
                x[i : i + 1], y[i : i + 1].clone(), a, bt, ranks, factor, lora_pairs(rs[i : i + 1]), path=path
            )
            assert torch.equal(alone[0], full2[i])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(full1, full2)


@pytest.mark.parametrize("path", C_PATHS)
def test_column_slice_of_fused_output(path):
    """y may be a column slice of a fused product (qkv / gate_up split): only its columns change."""
    S, R, k, d, n = 4, 8, 64, 48, 5
    a, bt, ranks, factor = _pool(S, R, k, d, seed=3)
    rs = _row_slot(n, S, seed=4)
    x = torch.randn(n, k)
    fused = torch.randn(n, 3 * d)
    before = fused.clone()
    mid = torch.split(fused, [d, d, d], dim=-1)[1]
    lora_bgmv(x, mid, a, bt, ranks, factor, lora_pairs(rs), path=path)
    alone = lora_bgmv(x, before[:, d : 2 * d].contiguous(), a, bt, ranks, factor, lora_pairs(rs), path=path)
    assert torch.equal(fused[:, d : 2 * d], alone)
    assert torch.equal(fused[:, :d], before[:, :d]) and torch.equal(fused[:, 2 * d :], before[:, 2 * d :])


@pytest.mark.parametrize("path", C_PATHS)
def test_many_adapters_per_row(path):
    """Rows whose sets hold 20 adapters (a 4-row tile then has more pairs than the kernel's
    stack scratch) still match the reference, and alone = batched."""
    S, R, k, d, n = 24, 8, 96, 80, 6
    a, bt, ranks, factor = _pool(S, R, k, d, seed=7)
    g = torch.Generator().manual_seed(8)
    rs = torch.where(torch.rand(n, S, generator=g) < 0.85, torch.rand(n, S, generator=g) + 0.1, torch.zeros(n, S))
    x, y = torch.randn(n, k), torch.randn(n, d)
    ref = _reference(x, y, a, bt, factor, rs)
    out = lora_bgmv(x, y.clone(), a, bt, ranks, factor, lora_pairs(rs), path=path)
    assert (out.double() - ref).abs().max().item() <= 2e-5 * (ref.abs().max().item() + 1)
    alone = lora_bgmv(x[4:5], y[4:5].clone(), a, bt, ranks, factor, lora_pairs(rs[4:5]), path=path)
    assert torch.equal(alone[0], out[4])


def test_pairs_and_errors():
    rs = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.0, 2.0], [0.0, 1.0, 0.0]])
    p = lora_pairs(rs)
    assert p.row.tolist() == [1, 1, 2] and p.slot.tolist() == [0, 2, 1]
    assert p.scale.tolist() == [0.5, 2.0, 1.0] and p.row_ptr.tolist() == [0, 0, 2, 3] and p.n_slots == 3
    a, bt, ranks, factor = _pool(3, 8, 32, 16, seed=5)
    with pytest.raises(KernelPathError):
        lora_bgmv(torch.randn(3, 32), torch.zeros(3, 16), a, bt, ranks, factor, p, path="torch")
    with pytest.raises(ValueError):
        lora_bgmv(torch.randn(3, 32).double(), torch.zeros(3, 16), a, bt, ranks, factor, p)
