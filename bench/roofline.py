"""Scenario 5: the memory roofline of one decode step.

A decode step at small batch is memory-bound: every weight is read once per step. The lower
bound on the step time is ``bytes read / bandwidth``:

- ours: the weights our worker actually holds, at its dtype (weights are dequantized at load):
  every linear weight, every norm, and the token embedding matrix once more as the tied LM
  head (the embedding lookup itself reads only the batch's rows, which we leave out);
  with one adapter, plus its A/B bytes;
- llama.cpp: the Q4_K_M file (weights stay quantized in memory), whole file size.

Bandwidth is a measured copy of a large tensor (read + write bytes over the time).
"""

from __future__ import annotations

import os

from bench.stats import ratio
from worker.runtime.model import BaseModel

TOKEN_EMBD = "token_embd.weight"


def weight_bytes_per_step(base: BaseModel) -> int:
    """Bytes of weights a decode step reads (see the module docstring)."""
    total = 0
    for name, w in base.weights.items():
        if name == TOKEN_EMBD and "output.weight" in base.weights:
            continue  # untied: the lookup reads a few rows, output.weight is the LM head
        total += w.numel() * w.element_size()
    return total


def run_roofline(base: BaseModel, bandwidth: dict, engine: dict | None, adapter_bytes: int) -> dict:
    """Bounds vs the achieved batch-1 decode step (from scenario 1)."""
    bw = bandwidth["gb_s"]["median"] * 1e9
    ours = weight_bytes_per_step(base)
    q4 = os.path.getsize(base.path)
    bound_ms = ours / bw * 1e3
    bound_lora_ms = (ours + adapter_bytes) / bw * 1e3
    q4_ms = q4 / bw * 1e3
    out = {
        "bandwidth": bandwidth, "dtype": str(base.dtype).removeprefix("torch."),
        "weight_bytes_per_step": ours, "adapter_bytes": adapter_bytes, "q4_k_m_file_bytes": q4,
        "bound_ms": bound_ms, "bound_lora_ms": bound_lora_ms, "bound_q4_k_m_ms": q4_ms,
        "bound_tok_s_b1": 1e3 / bound_ms, "bound_q4_k_m_tok_s_b1": 1e3 / q4_ms,
    }
    if engine:
        base_ms = engine["variants"]["base"]["decode"]["1"]["step_ms"]["median"]
        lora_ms = engine["variants"]["lora"]["decode"]["1"]["step_ms"]["median"]
        out.update(
            achieved_ms=base_ms, achieved_lora_ms=lora_ms,
            # achieved / bound, as throughput (≤ 1: the fraction of the roofline reached)
            achieved_over_bound=ratio(bound_ms, base_ms),
            achieved_over_bound_lora=ratio(bound_lora_ms, lora_ms),
            achieved_over_bound_q4_k_m=ratio(q4_ms, base_ms),
        )
    return out
