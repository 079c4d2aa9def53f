"""Mixed adapters in one batch equal each sequence run alone, on the GPU.

Each sequence has its own adapter set (none, one adapter, another, two stacked at different
scales, one at scale 2; on the MoE model its expert adapter at two scales). Alone: each
sequence is prefilled and decoded by itself with its set active (compatibility batching, one
set per batch). Together: every prompt in one ubatch, then every sequence in one decode step
per position, rows routed to their sets by ``UBatch.set_index`` (mixed batching). Inputs are
teacher-forced (fixed continuation tokens), so both runs score the same tokens.

Bounds: ``f32`` rows equal within 2e-3 (whole rows, same argmax); 16-bit at the scored tokens
max |Δ log-prob| ≤ 0.15 and mean ≤ 0.03. The adapters move the outputs far more than that
(checked), so routing a row to the wrong set fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.gpu import is_16bit
from worker.lora.adapter import load_lora_adapter
from worker.lora.adapter_set import EMPTY_SET, AdapterSet
from worker.runtime.context import Model, UBatch, WorkerContext
from worker.runtime.model import load_model

pytestmark = pytest.mark.cuda

N_STEPS = 6
F32_TOL = 2e-3
LOOSE_MAX, LOOSE_MEAN = 0.15, 0.03


def _model(path, adapter_paths, dtype: str, device: str = "cuda") -> Model:
    base = load_model(path, device=device, dtype=dtype)
    assert base.device.type == torch.device(device).type, base.device
    model = Model(base, max_loras=max(4, len(adapter_paths)))
    for i, p in enumerate(adapter_paths):
        a = load_lora_adapter(
            p, base_arch=base.arch, base_tensors=base.tensor_ne, device_for=base.device_of, dtype=base.dtype
        )
        model.adapters.add(i, a)
    return model


def _sets(model: Model, specs: list[dict[int, float]]) -> list[AdapterSet]:
    by = model.adapters.by_id
    return [AdapterSet.of({i: (by[i], s) for i, s in spec.items()}) if spec else EMPTY_SET for spec in specs]


def _tokens(n_vocab: int, n_seqs: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts (5, 6, 7… tokens) and continuations (``N_STEPS`` tokens) per sequence, fixed ids."""
    rng = np.random.default_rng(11)
    hi = min(n_vocab - 300, 3000)  # ordinary ids: the special tokens sit at the end of the vocabularies
    prompts = [rng.integers(10, hi, size=5 + s).tolist() for s in range(n_seqs)]
    conts = [rng.integers(10, hi, size=N_STEPS).tolist() for _ in range(n_seqs)]
    return prompts, conts


def _alone(ctx: WorkerContext, sets, prompts, conts) -> list[torch.Tensor]:
    out = []
    for s, (st, p, c) in enumerate(zip(sets, prompts, conts, strict=True)):
        ctx.set_adapters(st)
        ctx.kv.seq_rm(s)
        rows = [ctx.decode(UBatch(p, list(range(len(p))), [s] * len(p), [i == len(p) - 1 for i in range(len(p))]))]
        for j in range(N_STEPS - 1):
            rows.append(ctx.decode(UBatch([c[j]], [len(p) + j], [s], [True])))
        out.append(torch.stack([torch.log_softmax(r.logits[0].float().cpu(), -1) for r in rows]))
        ctx.kv.seq_rm(s)
    return out


def _together(ctx: WorkerContext, sets, prompts, conts) -> list[torch.Tensor]:
    n = len(sets)
    ctx.set_adapters(sets)
    toks, pos, seq, want, idx = [], [], [], [], []
    for s, p in enumerate(prompts):
        ctx.kv.seq_rm(s)
        toks += p
        pos += list(range(len(p)))
        seq += [s] * len(p)
        want += [i == len(p) - 1 for i in range(len(p))]
        idx += [s] * len(p)
    first = ctx.decode(UBatch(toks, pos, seq, want, idx)).logits
    got = [[torch.log_softmax(first[s].float().cpu(), -1)] for s in range(n)]
    for j in range(N_STEPS - 1):
        ub = UBatch([c[j] for c in conts], [len(p) + j for p in prompts], list(range(n)), [True] * n, list(range(n)))
        for s, row in enumerate(ctx.decode(ub).logits):
            got[s].append(torch.log_softmax(row.float().cpu(), -1))
    for s in range(n):
        ctx.kv.seq_rm(s)
    return [torch.stack(g) for g in got]


def _check(name: str, dtype: str, alone: list[torch.Tensor], together: list[torch.Tensor], conts) -> None:
    for s, (a, t) in enumerate(zip(alone, together, strict=True)):
        scored = torch.tensor(conts[s])  # row 0 (the prompt's last) scores c[0], row j + 1 scores c[j + 1]
        d = (a - t).abs()
        at = d.gather(1, scored.unsqueeze(1))
        print(
            f"{name} {dtype} sequence {s}: whole rows max |d| {float(d.max()):.5f}, scored mean {float(at.mean()):.5f}"
        )
        if is_16bit(dtype):
            assert float(at.max()) <= LOOSE_MAX and float(at.mean()) <= LOOSE_MEAN, f"{name} {dtype} sequence {s}"
        else:
            assert float(d.max()) <= F32_TOL, f"{name} {dtype} sequence {s}: {float(d.max()):.5f}"
            assert torch.equal(a.argmax(-1), t.argmax(-1)), f"{name} {dtype} sequence {s}: argmax differs"


def _adapter_effect(model: Model, ctx: WorkerContext, st: AdapterSet, prompt: list[int]) -> float:
    """max |Δ log-prob| of the last prompt row between the base model and ``st``."""
    rows = []
    for s in (EMPTY_SET, st):
        ctx.set_adapters(s)
        ctx.kv.seq_rm(0)
        r = ctx.decode(
            UBatch(prompt, list(range(len(prompt))), [0] * len(prompt), [False] * (len(prompt) - 1) + [True])
        )
        rows.append(torch.log_softmax(r.logits[0].float().cpu(), -1))
        ctx.kv.seq_rm(0)
    return float((rows[0] - rows[1]).abs().max())


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_mixed_batch_equals_each_alone_synthetic_qwen2(synthetic_tiny, dtype: str):
    path, adapters = synthetic_tiny
    model = _model(path, adapters, dtype)
    specs = [{}, {0: 1.0}, {1: 1.0}, {0: 0.5, 2: 1.0}, {3: 2.0}]
    sets = _sets(model, specs)
    ctx = model.new_context(n_ctx_seq=64, n_seq=len(sets))
    try:
        prompts, conts = _tokens(model.base.n_vocab, len(sets))
        assert _adapter_effect(model, ctx, sets[1], prompts[1]) > 0.1
        _check("synthetic qwen2", dtype, _alone(ctx, sets, prompts, conts), _together(ctx, sets, prompts, conts), conts)
    finally:
        ctx.close()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_mixed_batch_equals_each_alone_moe_experts(tiny_moe, dtype: str):
    path, lora = tiny_moe
    model = _model(path, [lora], dtype)
    sets = _sets(model, [{}, {0: 1.0}, {0: 0.5}])
    ctx = model.new_context(n_ctx_seq=64, n_seq=len(sets))
    try:
        prompts, conts = _tokens(model.base.n_vocab, len(sets))
        assert _adapter_effect(model, ctx, sets[1], prompts[1]) > 0.1
        _check("tiny llama-MoE", dtype, _alone(ctx, sets, prompts, conts), _together(ctx, sets, prompts, conts), conts)
    finally:
        ctx.close()
