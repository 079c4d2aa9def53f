"""Penalties (presence / frequency / repetition) and min-p: exact logits and probabilities on
small tensors (vLLM ``apply_penalties`` / ``MinPLogitsProcessor`` semantics), per row of a
mixed batch, and through the in-process scheduler on the tiny llama-MoE model."""

from __future__ import annotations

import pytest
import torch

from worker.runtime.sampling import (
    Sampler,
    SamplingError,
    SamplingParams,
    _min_p_cut,
    apply_penalties,
    penalize_rows,
)


def test_apply_penalties_exact_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, 3.0]])
    prompt_mask = torch.tensor([[True, True, False, False, False]])
    counts = torch.tensor([[0, 0, 2, 0, 1]])
    out = apply_penalties(logits, prompt_mask, counts, torch.tensor([0.25]), torch.tensor([0.5]), torch.tensor([2.0]))
    # 0: prompt, positive -> /2; 1: prompt, negative -> *2; 2: output x2 -> /2 - 0.5*2 - 0.25;
    # 3: unseen, unchanged; 4: output x1 -> /2 - 0.5 - 0.25
    assert out.tolist() == [[1.0, -2.0, -1.0, 1.0, 0.75]]
    assert logits.tolist() == [[2.0, -1.0, 0.5, 1.0, 3.0]]  # a copy: the raw logits stay


def test_frequency_and_presence_count_output_tokens_only():
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    out = penalize_rows(
        logits,
        [0],
        [SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)],
        prompts=[[0, 0, 0]],  # prompt tokens: no presence / frequency penalty
        outputs=[[1, 1, 1]],
    )
    assert out.tolist() == [[1.0, 1.0 - 1.5 - 1.0, 1.0]]


def test_penalize_rows_mixed_batch_each_row_its_own_params():
    logits = torch.tensor(
        [
            [9.0, 9.0, 9.0, 9.0],  # not selected
            [2.0, -1.0, 0.5, 1.0],
            [1.0, 1.0, 1.0, 1.0],
            [4.0, -4.0, 2.0, 0.0],
        ]
    )
    out = penalize_rows(
        logits,
        [1, 2, 3],
        [
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            SamplingParams(frequency_penalty=1.0),
            SamplingParams(repetition_penalty=4.0),
        ],
        prompts=[[0, 1], [], [0]],
        outputs=[[2, 2], [3, 3, 3], [1]],
    )
    assert out.tolist() == [
        [1.0, -2.0, -1.0, 1.0],
        [1.0, 1.0, 1.0, -2.0],
        [1.0, -16.0, 2.0, 0.0],
    ]


def test_min_p_exact_probabilities():
    probs = torch.tensor([0.5, 0.3, 0.2])
    # keep p >= 0.5 * 0.5 = 0.25: tokens 0 and 1, renormalized
    assert torch.allclose(_min_p_cut(probs, 0.5), torch.tensor([0.625, 0.375, 0.0]))
    assert torch.equal(_min_p_cut(probs, 0.0), probs)
    assert torch.allclose(_min_p_cut(probs, 1.0), torch.tensor([1.0, 0.0, 0.0]))


@pytest.mark.parametrize("top_k", [0, 3])  # full-vocabulary draw; fused candidate list
def test_min_p_cuts_the_draw_after_temperature(top_k):
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2, 1e-6]))
    drawn = lambda **kw: {  # noqa: E731
        Sampler(SamplingParams(temperature=1.0, top_k=top_k, seed=s, **kw)).sample(logits).token_id for s in range(200)
    }
    assert drawn() == {0, 1, 2}
    assert drawn(min_p=0.5) == {0, 1}  # 0.2 < 0.25
    # after temperature 0.5 the ratios square: 0.3/0.5 -> 0.36 < 0.5, so only token 0 stays
    assert {
        Sampler(SamplingParams(temperature=0.5, top_k=top_k, min_p=0.5, seed=s)).sample(logits).token_id
        for s in range(100)
    } == {0}


def test_greedy_takes_the_penalized_argmax_and_reports_raw_logprobs():
    logits = torch.tensor([0.0, 2.0, 1.5, -1.0])
    sampler = Sampler(SamplingParams(repetition_penalty=2.0, logprobs=2))
    pen = penalize_rows(logits.unsqueeze(0), [0], [sampler.params], prompts=[[1]], outputs=[[]])[0]
    assert pen.tolist() == [0.0, 1.0, 1.5, -1.0]
    s = sampler.sample(logits, penalized=pen, argmax=1)  # a batched raw argmax is ignored
    raw = torch.log_softmax(logits, -1)
    assert s.token_id == 2 and s.logprob == pytest.approx(float(raw[2]), abs=1e-5)
    assert [t for t, _ in s.top] == [1, 2] and s.top[0][1] == pytest.approx(float(raw[1]), abs=1e-5)


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("min_p", 1.5, r"min_p must be in \[0, 1\]"),
        ("min_p", float("nan"), r"min_p must be in \[0, 1\]"),
        ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\]"),
        ("frequency_penalty", -3.0, r"frequency_penalty must be in \[-2, 2\]"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
        ("repetition_penalty", float("inf"), "repetition_penalty must be > 0"),
    ],
)
def test_penalty_validation(field, value, msg):
    with pytest.raises(SamplingError, match=msg):
        SamplingParams(**{field: value}).validate()
    assert SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.5, min_p=1.0).validate()


def test_sparse_penalize_rows_equals_the_dense_rule_on_random_rows():
    """`penalize_rows` touches only seen tokens; the dense `apply_penalties` (vLLM's form) gives
    the same logits for random rows, ids and penalties."""
    g = torch.Generator().manual_seed(5)
    m, n_vocab = 6, 50
    logits = torch.randn(m, n_vocab, generator=g) * 3
    prompts = [
        torch.randint(0, n_vocab, (int(k),), generator=g).tolist() for k in torch.randint(0, 30, (m,), generator=g)
    ]
    outputs = [
        torch.randint(0, n_vocab, (int(k),), generator=g).tolist() for k in torch.randint(0, 30, (m,), generator=g)
    ]
    params = [
        SamplingParams(
            presence_penalty=float(torch.empty(1).uniform_(-2, 2, generator=g)),
            frequency_penalty=float(torch.empty(1).uniform_(-2, 2, generator=g)),
            repetition_penalty=float(torch.empty(1).uniform_(0.5, 3, generator=g)) if i % 3 else 1.0,
        )
        for i in range(m)
    ]
    prompt_mask = torch.zeros(m, n_vocab, dtype=torch.bool)
    counts = torch.zeros(m, n_vocab, dtype=torch.int64)
    for i in range(m):
        prompt_mask[i, prompts[i]] = True
        for t in outputs[i]:
            counts[i, t] += 1
    dense = apply_penalties(
        logits,
        prompt_mask,
        counts,
        torch.tensor([q.presence_penalty for q in params]),
        torch.tensor([q.frequency_penalty for q in params]),
        torch.tensor([q.repetition_penalty for q in params]),
    )
    sparse = penalize_rows(logits, list(range(m)), params, prompts, outputs)
    assert torch.allclose(sparse, dense, atol=1e-5)
