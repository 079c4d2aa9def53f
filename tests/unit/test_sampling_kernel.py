"""The fused logits summary (``csrc/sample.cpp``, ``worker.runtime.kernels.sample``) against
torch's ``log_softmax`` / ``argmax`` / sort, and the sampler on it against the torch path.

Tolerances (log-probs ``lp``): against f64 ``log_softmax``, ``|ours - f64| <= 1e-6 + 2e-7 |lp|``
(the two f32 roundings of ``(x - max) - logsum``, ~2.8e-5 at |lp| ~ 200); against torch's f32
``log_softmax``, ``|ours - torch| <= 1e-5 + 2e-7 |lp|`` — or, where torch itself is further from
f64 (near-uniform rows: torch's f32 sum drifts 1.4e-5 on 151936 entries ~1), within torch's own
error plus ours. ``logsum`` (``log sum exp(x - max)``) within 2e-6 of f64. Ids, max and top
logits are exact.
"""

from __future__ import annotations

import pytest
import torch

from worker.runtime.kernels import supported
from worker.runtime.kernels.sample import TOPK_MAX, logits_summary
from worker.runtime.sampling import Sampler, SamplingParams, greedy_rows, greedy_top

C_PATHS = [
    pytest.param("avx2", marks=pytest.mark.skipif(not supported("avx2"), reason="CPU lacks AVX2/FMA/F16C")),
    pytest.param("avx512", marks=pytest.mark.skipif(not supported("avx512"), reason="CPU lacks AVX-512 VNNI")),
]
GEMMA, QWEN, TINY = 262144, 151936, 37  # 37: not a multiple of 8 or 16, under one vector of tail
# Rows for the sampler's draw rules (not the kernel's vector tails, checked at the sizes above):
# a full-vocabulary draw costs ~80 ms at 151 936 entries, and these tests draw dozens of times.
DRAW_V = 4096


def _logits(n: int, v: int, seed: int) -> torch.Tensor:
    """``n`` rows of hard cases: plain, ties at the max (lowest id must win), many ties
    (values on a 0.5 grid), masked (-inf) tokens, huge and tiny magnitudes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * 3
    kinds = ["plain", "max_tie", "grid", "masked", "huge", "tiny"]
    for r in range(n):
        kind = kinds[r % len(kinds)]
        if kind == "max_tie":
            top = float(x[r].max()) + 1.0
            x[r, v - 1] = top
            x[r, v // 2] = top
            x[r, min(3, v - 1)] = top
        elif kind == "grid":
            x[r] = torch.round(x[r] * 2) / 2
        elif kind == "masked":
            x[r, torch.rand(v, generator=g) < 0.5] = float("-inf")
            x[r, 1] = 2.0  # at least one finite
        elif kind == "huge":
            x[r] *= 1e4
        elif kind == "tiny":
            x[r] *= 1e-6
    return x


def _check(x: torch.Tensor, path: str, k: int) -> None:
    s = logits_summary(x, k, path=path)
    k = min(k, x.shape[1])
    assert torch.equal(s.top_ids[:, 0].long(), torch.argmax(x, dim=-1))
    assert torch.equal(s.max, x.max(dim=-1).values)
    vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)  # ties by ascending id
    assert torch.equal(s.top_ids.long(), ids[:, :k])
    assert torch.equal(s.top_logits, vals[:, :k])
    ref = torch.log_softmax(x, dim=-1)
    ours = (x - s.max[:, None]) - s.logsum[:, None]
    fin = torch.isfinite(x)
    assert torch.equal(torch.isfinite(ours), fin) and bool((ours[~fin] == float("-inf")).all())
    x64 = x.double()
    ref64 = torch.log_softmax(x64, dim=-1)[fin]
    bound = 1e-6 + 2e-7 * ref64.abs()
    err64 = (ours[fin].double() - ref64).abs()
    assert bool((err64 <= bound).all()), float(err64.max())
    err = (ours[fin] - ref[fin]).double().abs()
    torch_err = (ref[fin].double() - ref64).abs()
    assert bool((err <= torch.maximum(1e-5 + 2e-7 * ref64.abs(), torch_err + bound)).all()), float(err.max())
    ls64 = torch.logsumexp(x64 - x64.max(dim=-1, keepdim=True).values, dim=-1)
    assert float((s.logsum.double() - ls64).abs().max()) <= 2e-6


@pytest.mark.parametrize("path", C_PATHS)
@pytest.mark.parametrize("v", [GEMMA, QWEN, TINY])
def test_summary_matches_torch(path, v):
    _check(_logits(6, v, seed=v), path, k=20)


@pytest.mark.parametrize("path", C_PATHS)
def test_summary_top_k_sizes(path):
    x = _logits(6, 20000, seed=1)
    for k in (1, 2, 41, TOPK_MAX):
        _check(x, path, k)
    _check(_logits(2, 5, seed=2), path, k=5)  # k == n_vocab


def test_torch_argmax_takes_the_first_maximum():
    """The rule the kernel copies: on CPU ``torch.argmax`` returns the lowest id among equal
    maxima (also across torch's vectorized chunks)."""
    x = torch.zeros(GEMMA)
    x[[70000, 9, 200000]] = 5.0
    assert int(torch.argmax(x)) == 9
    assert int(logits_summary(x[None], 1).top_ids[0, 0]) == 9


@pytest.mark.parametrize("path", C_PATHS)
def test_all_masked_row(path):
    x = torch.full((1, 100), float("-inf"))
    s = logits_summary(x, 3, path=path)
    assert float(s.max[0]) == float("-inf") and float(s.logsum[0]) == float("-inf")
    assert s.top_ids[0].tolist() == [0, 1, 2]


@pytest.mark.parametrize("path", C_PATHS)
def test_batched_equals_alone_and_threads(path):
    """A row's summary is bit-identical alone, in a batch (beside a 1e4x row) and with 1 or 2
    threads; strided rows (a view) give the same bits as contiguous ones."""
    x = _logits(6, QWEN, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = logits_summary(x, 20, path=path)
        torch.set_num_threads(1)
        one = logits_summary(x, 20, path=path)
        alone = [logits_summary(x[r : r + 1].clone(), 20, path=path) for r in range(6)]
        wide = torch.zeros(6, QWEN + 100)
        wide[:, :QWEN] = x
        strided = logits_summary(wide[:, :QWEN], 20, path=path)
        picked = logits_summary(x, 20, rows=[4, 0, 4], path=path)  # rows read in place
    finally:
        torch.set_num_threads(before)
    for f in ("max", "logsum", "top_ids", "top_logits"):
        b = getattr(batch, f)
        assert torch.equal(b, getattr(one, f)) and torch.equal(b, getattr(strided, f))
        assert torch.equal(b, torch.cat([getattr(a, f) for a in alone]))
        assert torch.equal(getattr(picked, f), b[[4, 0, 4]])
    # a smaller k gives the prefix of a larger k's list
    assert torch.equal(logits_summary(x, 5, path=path).top_ids, batch.top_ids[:, :5])


def test_errors():
    with pytest.raises(ValueError, match="k must be"):
        logits_summary(torch.zeros(1, 10), 11)
    with pytest.raises(ValueError, match="k must be"):
        logits_summary(torch.zeros(1, 1000), TOPK_MAX + 1)
    with pytest.raises(ValueError, match="rows must be"):
        logits_summary(torch.zeros(2, 10), 1, rows=[2])
    with pytest.raises(ValueError, match="2-D"):
        logits_summary(torch.zeros(10), 1)


# --- the sampler on the fused path vs the torch path ------------------------------------------
def _both_paths(monkeypatch, fn):
    monkeypatch.setenv("LORAPLANE_KERNELS", "torch")
    ref = fn()
    monkeypatch.setenv("LORAPLANE_KERNELS", "auto")
    return fn(), ref


@pytest.mark.parametrize("v", [GEMMA, QWEN, TINY])
def test_greedy_sampler_same_tokens_as_torch(monkeypatch, v):
    x = _logits(6, v, seed=11)
    x[2] = torch.randn(v, generator=torch.Generator().manual_seed(3))  # no ties: top lists comparable
    params = SamplingParams(logprobs=5)

    def run():
        single = [Sampler(params).sample(x[r]) for r in range(6)]
        order = [5, 0, 3, 1, 4, 2]
        pre, tok = greedy_rows(x, order)
        batched = [Sampler(params).sample(x[r], logp=pre[i], argmax=tok[i]) for i, r in enumerate(order)]
        batched = [batched[order.index(r)] for r in range(6)]
        return single, batched

    (fused, fused_b), (ref, ref_b) = _both_paths(monkeypatch, run)
    assert fused == fused_b  # batched = per row, exactly
    assert ref == ref_b
    ref64 = torch.log_softmax(x.double(), dim=-1)
    for r, (a, b) in enumerate(zip(fused, ref, strict=True)):
        assert a.token_id == b.token_id
        want = float(ref64[r, a.token_id])
        assert abs(a.logprob - want) <= 1e-6 + 2e-7 * abs(want)  # torch's: up to 1.4e-5 off here
    # top log-probs: the same ids where the row has no ties, values within tolerance
    a, b = fused[2].top, ref[2].top
    assert [t for t, _ in a] == [t for t, _ in b]
    assert all(abs(p - q) <= 1e-5 + 2e-7 * abs(q) for (_, p), (_, q) in zip(a, b, strict=True))


def test_greedy_rows_top_list_as_long_as_asked(monkeypatch):
    """The scheduler's batched greedy summary keeps only the top entries its rows' requests ask
    for (``greedy_top``: the most ``logprobs``, at least 1): every sampled token, log-prob and
    top list equals the one from the full ``MAX_LOGPROBS`` list, bit for bit."""
    monkeypatch.setenv("LORAPLANE_KERNELS", "auto")
    x = _logits(4, GEMMA, seed=5)
    none, three = SamplingParams(), SamplingParams(logprobs=3)
    assert greedy_top([Sampler(none), Sampler(none)]) == 1
    assert greedy_top([Sampler(none), Sampler(three)]) == 3
    assert greedy_top([]) == 1
    for params in (none, three):
        k = greedy_top([Sampler(params)] * 4)
        short, tok_s = greedy_rows(x, [0, 1, 2, 3], k)
        full, tok_f = greedy_rows(x, [0, 1, 2, 3])
        assert tok_s == tok_f
        for r in range(4):
            a = Sampler(params).sample(x[r], logp=short[r], argmax=tok_s[r])
            b = Sampler(params).sample(x[r], logp=full[r], argmax=tok_f[r])
            assert a == b and len(a.top) == params.logprobs


def _expected_probs(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    scaled = logits / t
    kth = torch.topk(scaled, k).values[-1]
    probs = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)
    sp, si = torch.sort(probs, descending=True, stable=True)
    sp = sp.masked_fill((torch.cumsum(sp, 0) - sp) >= p, 0.0)
    out = torch.zeros_like(probs).scatter_(0, si, sp)
    return out / out.sum()


def test_top_k_candidates_sample_the_same_distribution():
    """Temperature + top-k + top-p on the fused candidates: the support equals the torch
    path's and 6000 seeded draws match its probabilities within 0.02."""
    x = torch.randn(DRAW_V, generator=torch.Generator().manual_seed(4)) * 2
    want = _expected_probs(x, 0.8, 8, 0.9)
    s = Sampler(SamplingParams(temperature=0.8, top_k=8, top_p=0.9, seed=1))
    got = torch.bincount(torch.tensor([s.sample(x).token_id for _ in range(6000)]), minlength=DRAW_V).float() / 6000
    assert set(got.nonzero().flatten().tolist()) <= set(want.nonzero().flatten().tolist())
    assert float((got - want).abs().max()) < 0.02


def test_top_k_ties_at_the_cut_are_kept():
    """Logits tied with the k-th are all kept (torch semantics): within the fused list, and
    past its end (the sampler falls back to the full-vocabulary draw)."""
    x = torch.full((50,), -5.0)
    x[[7, 3, 30]] = 2.0  # top_k=2: ids 3, 7, 30 tie at the cut, all three are candidates
    s = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=0))
    assert {s.sample(x).token_id for _ in range(200)} == {3, 7, 30}
    y = torch.ones(200)
    y[0] = 1.5  # top_k=2: 199 tokens tie with the 2nd, past any top list
    s = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=0))
    assert len({s.sample(y).token_id for _ in range(300)}) > 100


@pytest.mark.parametrize("temperature", [1e-45, 1e-40, 1e-38])
@pytest.mark.parametrize("top_k", [0, 2])
def test_tiny_temperature_is_greedy_not_a_nan_draw(temperature, top_k):
    """A temperature so small that ``logits / t`` overflows f32 (accepted: finite and > 0)
    draws the argmax; it used to make ``torch.multinomial`` raise on the scheduler thread,
    which ended the worker's scheduling for every request."""
    x = torch.randn(DRAW_V, generator=torch.Generator().manual_seed(5)) * 3
    for row in (x, x - 100.0):  # positive logits overflow to +inf, all-negative ones to -inf
        s = Sampler(SamplingParams(temperature=temperature, top_k=top_k, seed=3))
        assert {s.sample(row).token_id for _ in range(5)} == {int(torch.argmax(row))}


@pytest.mark.parametrize("top_k", [0, 2])
def test_nan_and_inf_logits_draw_a_token_instead_of_raising(top_k):
    """Logits with NaN or ±inf (an adapter at scale 1e30 drives activations past f32) draw
    a finite-or-+inf argmax token; ``torch.multinomial`` used to raise on the scheduler
    thread and stop the worker's scheduling for good."""
    x = torch.randn(QWEN, generator=torch.Generator().manual_seed(6))
    nan_some = x.clone()
    nan_some[::3] = float("nan")
    with_inf = x.clone()
    with_inf[17] = float("inf")
    all_nan = torch.full((QWEN,), float("nan"))
    for row in (nan_some, with_inf, all_nan):
        s = Sampler(SamplingParams(temperature=0.7, top_k=top_k, seed=3))
        assert 0 <= s.sample(row).token_id < QWEN
    assert Sampler(SamplingParams(temperature=0.7, top_k=top_k)).sample(with_inf).token_id == 17
