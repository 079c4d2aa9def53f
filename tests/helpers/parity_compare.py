"""Teacher-forced comparison against llama.cpp / PEFT goldens (fixtures README statistics).

Feed prompt + the reference's generated tokens in one ubatch, read our log-prob of each
reference token, and compare with the reference's ``logprob``. Statistics per case: mean
|Δ|; per group: 95th percentile of |Δ| and argmax agreement where the reference's top-1/top-2
margin is clear.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from worker.lora.adapter_set import EMPTY_SET, AdapterSet
from worker.lora.alora import resolve_alora
from worker.runtime.context import UBatch, WorkerContext


@dataclass
class CaseStats:
    name: str
    deltas: list[float]
    argmax_hits: int
    argmax_total: int

    @property
    def mean(self) -> float:
        return float(np.mean(self.deltas))


@dataclass
class GroupStats:
    cases: list[CaseStats] = field(default_factory=list)

    @property
    def p95(self) -> float:
        return float(np.percentile([d for c in self.cases for d in c.deltas], 95))

    @property
    def worst_mean(self) -> float:
        return max(c.mean for c in self.cases)

    @property
    def argmax_rate(self) -> float:
        hits = sum(c.argmax_hits for c in self.cases)
        total = sum(c.argmax_total for c in self.cases)
        return hits / total if total else 1.0

    def report(self, group: str) -> str:
        return (
            f"{group}: n={len(self.cases)} worst mean |d|={self.worst_mean:.4f} "
            f"p95={self.p95:.4f} argmax={self.argmax_rate * 100:.1f}%"
        )


def teacher_forced_logprobs(
    ctx: WorkerContext, prompt: list[int], generated: list[int], adapter_set: AdapterSet = EMPTY_SET, seq_id: int = 0
) -> torch.Tensor:
    """f32 ``(len(generated), n_vocab)`` log-probs at each generated position, computed in one
    ubatch with the aLoRA activation rule applied (tokens before the invocation run without it)."""
    toks = prompt + generated
    n, p = len(toks), len(prompt)
    act = resolve_alora(adapter_set, prompt)
    sets = [act.pre_set, act.adapter_set]
    ctx.set_adapters(sets)
    idx = [0 if 0 <= i < act.start else 1 for i in range(n)]
    ctx.kv.seq_rm(seq_id)
    res = ctx.decode(UBatch(toks, list(range(n)), [seq_id] * n, [p - 1 <= i < n - 1 for i in range(n)], idx))
    ctx.kv.seq_rm(seq_id)
    return torch.log_softmax(res.logits, dim=-1)


def compare_case(name: str, logprobs: torch.Tensor, steps: list[dict], margin: float = 0.1) -> CaseStats:
    deltas, hits, total = [], 0, 0
    for j, st in enumerate(steps):
        deltas.append(abs(float(logprobs[j, st["id"]]) - st["logprob"]))
        top = st["top"]
        if len(top) > 1 and top[0]["logprob"] - top[1]["logprob"] > margin:
            total += 1
            hits += int(int(logprobs[j].argmax()) == top[0]["id"])
    return CaseStats(name, deltas, hits, total)
