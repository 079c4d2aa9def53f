"""Device sampling (``worker.gpu.sampling``) on the CPU against the CPU sampler
(``worker.runtime.sampling``): greedy ids equal exactly, log-probs within 1e-5,
penalized logits bit for bit, grammar bitmasks as ``apply_masks`` applies them, draws equal in
law (chi-square over many draws against the exact distribution the CPU sampler draws from),
fixed seeds against a per-row reference, and the captured-graph plan equal to the minimal one.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from worker.gpu.sampling import (
    UNCONSTRAINED,
    SamplingPlan,
    SamplingRows,
    SamplingState,
    SamplingTensors,
    apply_bitmask,
    counter_uniform,
    fetch,
    penalize,
    sample,
    unpack,
)
from worker.runtime.grammar import apply_masks, mask_words
from worker.runtime.sampling import Sampler, SamplingParams, penalize_rows

CPU = torch.device("cpu")


def _run(logits, params, seq_ids=None, *, state=None, masks=None, plan=None, seeds=None):
    """Sample one step; returns ``(SampledToken list, state)``. Sequences ``seq_ids`` (default
    ``0..B-1``) are started with ``seeds`` (default: their ids) when ``state`` is None."""
    n, n_vocab = logits.shape
    seq_ids = list(range(n)) if seq_ids is None else seq_ids
    if state is None:
        state = SamplingState(max_seqs=max(seq_ids) + 1, n_vocab=n_vocab, device=CPU)
        for s in seq_ids:
            state.start(s, seed=s if seeds is None else seeds[s])
    rows = SamplingRows.from_params(params, seq_ids, masks)
    t = SamplingTensors.from_rows(rows, n_vocab, CPU)
    packed = sample(logits, t, state, plan or rows.plan())
    return unpack(fetch(packed), rows.n_logprobs), state


def _cpu_probs(monkeypatch, row: torch.Tensor, params: SamplingParams, penalized=None) -> torch.Tensor:
    """The exact distribution the CPU sampler draws ``row``'s token from (its full-vocabulary
    torch path, whose ``torch.multinomial`` call is watched)."""
    seen: list[torch.Tensor] = []
    real = torch.multinomial

    def spy(probs, n, generator=None):
        seen.append(probs.clone())
        return real(probs, n, generator=generator)

    with monkeypatch.context() as m:
        m.setattr(torch, "multinomial", spy)
        Sampler(params).sample(row, penalized=row if penalized is None else penalized)
    assert len(seen) == 1
    return seen[0].double() / seen[0].double().sum()


def _chi2_bound(df: int, z: float = 5.0) -> float:
    """The chi-square quantile at normal deviate ``z`` (Wilson–Hilferty; z = 5: p ≈ 3e-7)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _assert_same_law(tokens: np.ndarray, probs: torch.Tensor) -> None:
    """``tokens`` look drawn from ``probs``: never a zero-probability token, and a chi-square
    statistic (bins of expected count < 5 merged) below its p ≈ 3e-7 quantile."""
    n_vocab = probs.numel()
    observed = np.bincount(tokens, minlength=n_vocab).astype(np.float64)
    p = probs.numpy()
    assert observed[p == 0].sum() == 0, f"drew excluded tokens {np.flatnonzero((p == 0) & (observed > 0))}"
    expected = p * len(tokens)
    big = expected >= 5
    o = np.append(observed[big], observed[~big].sum())
    e = np.append(expected[big], expected[~big].sum())
    keep = e > 0
    stat = float((((o - e) ** 2)[keep] / e[keep]).sum())
    df = int(keep.sum()) - 1
    assert df >= 1
    assert stat < _chi2_bound(df), f"chi2 {stat:.1f} over {df} degrees of freedom"


# ------------------------------------------------------------------ generator


def test_counter_uniform_is_a_pure_uniform_function_of_seed_and_counter():
    counters = torch.arange(20_000, dtype=torch.int64)
    seeds = torch.full_like(counters, 1234)
    u = counter_uniform(seeds, counters)
    assert torch.equal(u, counter_uniform(seeds, counters))
    assert float(u.min()) >= 0.0 and float(u.max()) <= 1 - 2**-24
    hist = torch.histc(u, bins=16, min=0.0, max=1.0).numpy()
    e = len(u) / 16
    assert float(((hist - e) ** 2 / e).sum()) < _chi2_bound(15)
    # other seeds (the high 32 bits too, and seeds past 2**63 stored negative) give other numbers
    for other in (1235, 1234 + (1 << 32), -(1 << 62)):
        v = counter_uniform(torch.full_like(counters, other), counters)
        assert abs(float(torch.corrcoef(torch.stack([u, v]))[0, 1])) < 0.05  # 7 standard deviations
        assert float((u == v).double().mean()) < 1e-3


def test_state_start_takes_any_integer_seed_modulo_2_64():
    st = SamplingState(max_seqs=3, n_vocab=8, device=CPU, penalties=False)
    st.start(0, seed=(1 << 64) + 5)
    st.start(1, seed=(1 << 64) - 1)
    st.start(2, seed=None)
    assert st.seeds[:2].tolist() == [5, -1]
    with pytest.raises(ValueError, match="seq 3 is not in 0..2"):
        st.start(3, seed=1)
    with pytest.raises(ValueError, match="penalties=True"):
        sample(torch.zeros(1, 8), SamplingTensors.from_rows(SamplingRows.from_params(
            [SamplingParams(presence_penalty=1.0)], [0]), 8, CPU), st, SamplingPlan.full())  # fmt: skip


# ------------------------------------------------------------------ greedy and log-probs


def test_greedy_equals_the_cpu_sampler_exactly():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 4
    logits[2, 17] = logits[2, 250] = logits[2].max() + 1  # a tie: the first maximum wins
    params = [SamplingParams(logprobs=n) for n in (0, 5, 1, 20, 3, 0)]
    got, _ = _run(logits, params)
    for i, p in enumerate(params):
        want = Sampler(p).sample(logits[i])
        assert got[i].token_id == want.token_id
        assert abs(got[i].logprob - want.logprob) <= 1e-5
        if i != 2:  # the tied row's top ids may list the tie either way
            assert [t for t, _ in got[i].top] == [t for t, _ in want.top]
        assert len(got[i].top) == p.logprobs
        for (_, a), (_, b) in zip(got[i].top, want.top, strict=True):
            assert abs(a - b) <= 1e-5
    assert got[2].token_id == 17


def test_penalties_equal_penalize_rows_bit_for_bit_and_greedy_follows_them():
    g = torch.Generator().manual_seed(1)
    n_vocab = 64
    logits = torch.randn(4, n_vocab, generator=g) * 3
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(repetition_penalty=0.7),
        SamplingParams(),  # no penalty: its row stays bit for bit
        SamplingParams(frequency_penalty=-1.5, presence_penalty=-0.75),
    ]
    prompts = [torch.randint(0, n_vocab, (12,), generator=g).tolist() for _ in params]
    outputs = [torch.randint(0, n_vocab, (9,), generator=g).tolist() for _ in params]
    st = SamplingState(max_seqs=4, n_vocab=n_vocab, device=CPU)
    for s, prompt in enumerate(prompts):
        st.start(s, seed=s, prompt=prompt + [-3, n_vocab + 5])  # ids outside the vocabulary are ignored
    for step in range(9):  # the outputs, one token per row and step, as sampling records them
        st.record(torch.arange(4), torch.tensor([o[step] for o in outputs]), count_tokens=True)
    rows = SamplingRows.from_params(params, [0, 1, 2, 3])
    t = SamplingTensors.from_rows(rows, n_vocab, CPU)
    ids = t.seq_ids
    got = penalize(
        logits,
        st.output_counts.index_select(0, ids),
        st.prompt_mask.index_select(0, ids),
        t.presence,
        t.frequency,
        t.repetition,
    )
    want = penalize_rows(logits, [0, 1, 2, 3], params, prompts, outputs)
    assert torch.equal(got, want)
    assert torch.equal(got[2], logits[2])
    tokens, _ = _run(logits, params, state=st)
    for i, p in enumerate(params):
        assert tokens[i].token_id == Sampler(p).sample(logits[i], penalized=want[i]).token_id
        assert abs(tokens[i].logprob - float(torch.log_softmax(logits[i], -1)[tokens[i].token_id])) <= 1e-5  # raw


def test_recorded_counts_and_counters_follow_the_sampled_tokens():
    g = torch.Generator().manual_seed(2)
    st = SamplingState(max_seqs=3, n_vocab=10, device=CPU)
    for s in range(3):
        st.start(s, seed=s)
    params = [SamplingParams(temperature=1.0, frequency_penalty=0.1)] * 2
    drawn: dict[int, list[int]] = {0: [], 2: []}
    for _ in range(6):
        got, _ = _run(torch.randn(2, 10, generator=g), params, [2, 0], state=st)
        drawn[2].append(got[0].token_id)
        drawn[0].append(got[1].token_id)
    for s in (0, 2):
        assert st.output_counts[s].tolist() == np.bincount(drawn[s], minlength=10).tolist()
    assert st.counters[:3].tolist() == [6, 0, 6]


# ------------------------------------------------------------------ grammar masks


def test_bitmask_application_equals_apply_masks():
    g = torch.Generator().manual_seed(3)
    n_vocab = 100  # not a multiple of 32: the last word's high bits lie past the vocabulary
    w = mask_words(n_vocab)
    masks = torch.randint(-(2**31), 2**31 - 1, (5, w), generator=g, dtype=torch.int64).to(torch.int32)
    masks[1] = 0  # nothing allowed
    masks[2] = UNCONSTRAINED
    masks[3, 1] = 0
    masks[3, 2] = UNCONSTRAINED
    masks[4, 0] = -(2**31)  # only bit 31 (the sign bit) of word 0
    logits = torch.randn(5, n_vocab, generator=g)
    want = logits.clone()
    apply_masks(want, [0, 1, 2, 3, 4], masks)
    got = apply_bitmask(logits, masks)
    assert torch.equal(got, want)
    assert torch.isinf(got[1]).all() and torch.equal(got[2], logits[2])
    assert not torch.isinf(got[4, 31]) and torch.isinf(got[4, :31]).all()


def test_constrained_rows_sample_allowed_tokens_with_masked_log_probs():
    g = torch.Generator().manual_seed(4)
    n_vocab, n = 70, 400
    allowed = [3, 31, 32, 40, 69]
    words = np.zeros(mask_words(n_vocab), dtype=np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    masks = np.tile(words.view(np.int32), (n, 1))
    masks[1::2] = UNCONSTRAINED  # every other row is free
    logits = torch.randn(1, n_vocab, generator=g).expand(n, n_vocab).contiguous()
    params = [SamplingParams(temperature=1.0 if i % 4 else 0.0, logprobs=2) for i in range(n)]
    got, _ = _run(logits, params, masks=masks)
    masked = torch.full((n_vocab,), float("-inf"))
    masked[allowed] = logits[0, allowed]
    lp = torch.log_softmax(masked, -1)
    for i in range(0, n, 2):
        assert got[i].token_id in allowed
        assert abs(got[i].logprob - float(lp[got[i].token_id])) <= 1e-5
        assert [t for t, _ in got[i].top] == torch.topk(masked, 2).indices.tolist()
    assert got[0].token_id == int(masked.argmax())
    assert len({got[i].token_id for i in range(2, n, 4)}) > 1  # drawn rows do draw
    assert any(got[i].token_id not in allowed for i in range(1, n, 2))


# ------------------------------------------------------------------ draws


DRAW_CASES = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.3, top_k=5),
    "top_p": SamplingParams(temperature=1.0, top_p=0.8),
    "min_p": SamplingParams(temperature=1.0, min_p=0.12),
    "all_cuts": SamplingParams(temperature=0.9, top_k=12, top_p=0.9, min_p=0.02),
    "penalized": SamplingParams(temperature=1.0, repetition_penalty=1.8, presence_penalty=0.6),
}


FAST_DRAW_CASES = ("all_cuts", "penalized")  # the rest of the sweep runs in the slow tier


@pytest.mark.parametrize(
    "case", [c if c in FAST_DRAW_CASES else pytest.param(c, marks=pytest.mark.slow) for c in sorted(DRAW_CASES)]
)
def test_draws_are_equal_in_law_to_the_cpu_sampler(monkeypatch, case):
    """20 000 rows with the same logits and different seeds: their tokens against the exact
    distribution the CPU sampler draws from."""
    params = DRAW_CASES[case]
    n, n_vocab = 20_000, 24
    g = torch.Generator().manual_seed(5)
    row = torch.randn(n_vocab, generator=g) * 1.5
    prompt = [1, 2, 3, 5, 8]
    st = SamplingState(max_seqs=n, n_vocab=n_vocab, device=CPU)
    # what start(s, seed=s, prompt=prompt) does for each row, for all rows at once
    with torch.inference_mode():  # the state's tensors are inference tensors
        st.seeds[:n] = torch.arange(n)
        st.prompt_mask[:n, prompt] = True
    got, _ = _run(row.expand(n, n_vocab).contiguous(), [params] * n, state=st)
    pen = penalize_rows(row.unsqueeze(0), [0], [params], [prompt], [[]])[0] if params.penalized else None
    _assert_same_law(np.array([t.token_id for t in got]), _cpu_probs(monkeypatch, row, params, pen))


def test_fixed_seeds_give_the_reference_tokens(monkeypatch):
    """Each draw equals a per-row reference: the CPU sampler's distribution, laid out in
    vocabulary order (no cut) or descending order (top-k / top-p), inverted at the row's
    uniform number. A difference is allowed only where the number lies within 1e-5 of a
    boundary of the cumulative sum (f32 against f64 rounding)."""
    g = torch.Generator().manual_seed(6)
    n_vocab = 50
    logits = torch.randn(8, n_vocab, generator=g) * 2
    params = [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.0, top_k=7),
        SamplingParams(temperature=1.2, top_p=0.7),
        SamplingParams(temperature=0.5, min_p=0.05),
    ] * 2
    seeds = [11, 12, 13, 14, 2**63 + 15, 16, 17, 2**64 - 1]
    st = SamplingState(max_seqs=8, n_vocab=n_vocab, device=CPU)
    for s in range(8):
        st.start(s, seed=seeds[s])
    for step in range(12):
        u = st.uniform(torch.arange(8)).double()
        got, _ = _run(logits, params, state=st)
        for i, p in enumerate(params):
            probs = _cpu_probs(monkeypatch, logits[i], p)
            cut = 0 < p.top_k < n_vocab or p.top_p < 1
            order = torch.sort(logits[i] / p.temperature, descending=True, stable=True).indices if cut else None
            ordered = probs if order is None else probs[order]
            cum = torch.cumsum(ordered, 0)
            x = float(u[i]) * float(cum[-1])
            j = int(torch.searchsorted(cum, torch.tensor([x], dtype=torch.float64), right=True))
            want = j if order is None else int(order[j])
            if got[i].token_id != want:
                edges = [float(cum[j - 1]) if j else 0.0, float(cum[j])]
                assert min(abs(x - e) for e in edges) < 1e-5, (step, i, got[i].token_id, want)


def test_a_seeded_row_draws_the_same_tokens_alone_or_in_any_batch():
    g = torch.Generator().manual_seed(7)
    n_vocab = 40
    steps = [torch.randn(3, n_vocab, generator=g) for _ in range(5)]
    mine = SamplingParams(temperature=1.0, seed=99)
    others = [SamplingParams(temperature=0.9, top_p=0.5), SamplingParams(repetition_penalty=1.5)]
    alone = SamplingState(max_seqs=3, n_vocab=n_vocab, device=CPU)
    mixed = SamplingState(max_seqs=3, n_vocab=n_vocab, device=CPU)
    alone.start(1, seed=99)
    for s, seed in ((1, 99), (0, 5), (2, 6)):
        mixed.start(s, seed=seed)
    a = [_run(lg[1:2], [mine], [1], state=alone)[0][0].token_id for lg in steps]
    b = [_run(lg, [others[0], mine, others[1]], [0, 1, 2], state=mixed)[0][1].token_id for lg in steps]
    assert a == b
    again = SamplingState(max_seqs=3, n_vocab=n_vocab, device=CPU)
    again.start(1, seed=99)
    assert [_run(lg[1:2], [mine], [1], state=again)[0][0].token_id for lg in steps] == a


def test_the_full_plan_gives_the_minimal_plans_results():
    """What a captured graph runs (every stage, neutral parameters) equals the step with only
    the stages its rows need."""
    g = torch.Generator().manual_seed(8)
    n_vocab = 90
    logits = torch.randn(6, n_vocab, generator=g) * 2
    params = [
        SamplingParams(logprobs=3),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.8, top_k=4, logprobs=2),
        SamplingParams(temperature=1.1, min_p=0.1),
        SamplingParams(),
        SamplingParams(temperature=0.6),
    ]
    results = []
    for plan in (None, SamplingPlan.full()):
        st = SamplingState(max_seqs=6, n_vocab=n_vocab, device=CPU)
        for s in range(6):
            st.start(s, seed=100 + s, prompt=[s, s + 1])
        results.append([_run(lg, params, state=st, plan=plan)[0] for lg in (logits, logits.flip(0))])
    rows = SamplingRows.from_params(params, range(6))
    assert rows.plan() == SamplingPlan(draw=True, sort=True, penalties=False, masks=False, n_logprobs=3)
    assert results[0] == results[1]


def test_non_finite_rows_follow_the_cpu_rule():
    n_vocab = 16
    inf_row = torch.zeros(n_vocab)
    inf_row[5] = float("inf")
    nan_row = torch.full((n_vocab,), float("nan"))
    nan_row[[2, 9]] = torch.tensor([0.5, 1.0])
    n = 300
    logits = torch.stack([inf_row, nan_row] * (n // 2))
    got, _ = _run(logits, [SamplingParams(temperature=1.0)] * n)
    assert {t.token_id for t in got[0::2]} == {5} == {Sampler(SamplingParams(temperature=1.0)).sample(inf_row).token_id}
    assert {t.token_id for t in got[1::2]} == {2, 9}


def test_plan_flags():
    rows = SamplingRows.from_params(
        [SamplingParams(), SamplingParams(temperature=0.0, top_k=3), SamplingParams(logprobs=4)], [0, 1, 2]
    )
    assert rows.plan() == SamplingPlan(draw=False, sort=False, penalties=False, masks=False, n_logprobs=4)
    masks = np.full((3, 2), UNCONSTRAINED, np.int32)
    rows = SamplingRows.from_params([SamplingParams(temperature=0.5, frequency_penalty=1.0)] * 3, [0, 1, 2], masks)
    assert rows.plan() == SamplingPlan(draw=True, sort=False, penalties=True, masks=False, n_logprobs=0)
    masks[1, 0] = 7
    assert SamplingRows.from_params([SamplingParams()] * 3, [0, 1, 2], masks).plan().masks


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the gpu tier needs a CUDA device (none here)")
def test_cuda_sampling_equals_the_cpu_run_of_the_same_code():
    g = torch.Generator().manual_seed(9)
    n_vocab = 32_000
    logits = torch.randn(16, n_vocab, generator=g) * 3
    params = [
        SamplingParams(logprobs=5),
        SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2),
        SamplingParams(temperature=1.0, top_k=40),
        SamplingParams(temperature=0.7, min_p=0.05, logprobs=2),
    ] * 4
    out = []
    for device in (CPU, torch.device("cuda")):
        st = SamplingState(max_seqs=16, n_vocab=n_vocab, device=device)
        for s in range(16):
            st.start(s, seed=s, prompt=[s, 2 * s])
        rows = SamplingRows.from_params(params, range(16))
        t = SamplingTensors.from_rows(rows, n_vocab, device)
        out.append(unpack(fetch(sample(logits.to(device), t, st, SamplingPlan.full())), rows.n_logprobs))
    for a, b in zip(*out, strict=True):
        assert a.token_id == b.token_id
        assert abs(a.logprob - b.logprob) <= 1e-4
