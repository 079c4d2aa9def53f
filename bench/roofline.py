"""Scenario 5: the memory roofline of one decode step, and what the worker holds.

A decode step at small batch is memory-bound: every weight is read once per step. The lower
bound on the step time is ``bytes read / bandwidth``, for two byte counts:

- the weights our model holds (``LoadedModel.weight_bytes``: packed GGUF matrices + scales with
  ``--weights packed``, f32 tensors with ``--weights dequant``), all read by a step (the tied
  ``token_embd`` is the LM head; with an untied ``output.weight`` the embedding lookup reads a
  few rows only and is left out); with one adapter, plus its A/B bytes;
- the GGUF's own tensor bytes (what llama.cpp reads per step: its weights stay in the file's
  form): the target is a step near *that* bound.

Also: held bytes / GGUF tensor bytes (target ≤ 1.5×), the worker process's RSS
(measured on the serving scenario's mixed worker after the model loaded, before any adapter),
and the single-stream per-token time of llama-server (``timings.predicted_per_token_ms``) and
of our worker (ITL p50 of the 1-stream serving row) beside our in-process B=1 step.

Bandwidth is a measured copy of a large tensor (read + write bytes over the time).
"""

from __future__ import annotations

import math

from bench.stats import ratio
from worker.runtime.kernels import QuantLinear
from worker.runtime.model import LoadedModel

TOKEN_EMBD = "token_embd.weight"


def _nbytes(w) -> int:
    parts = w if isinstance(w, list) else [w]
    return sum(p.nbytes if isinstance(p, QuantLinear) else p.numel() * p.element_size() for p in parts)


def weight_bytes_per_step(base: LoadedModel) -> int:
    """Bytes of weights a decode step reads (see the module docstring)."""
    total = 0
    for name, w in base.weights.items():
        if name == TOKEN_EMBD and "output.weight" in base.weights:
            continue  # untied: the lookup reads a few rows, output.weight is the LM head
        total += _nbytes(w)
    return total


def gguf_tensor_bytes(base: LoadedModel, *, per_step: bool = False) -> int:
    """Bytes of the GGUF's tensors (its data section, no metadata); ``per_step`` leaves out
    ``token_embd`` when an untied ``output.weight`` exists (as :func:`weight_bytes_per_step`)."""
    names = base.gguf.tensors
    return sum(r.n_bytes for n, r in names.items() if not (per_step and n == TOKEN_EMBD and "output.weight" in names))


def run_roofline(base: LoadedModel, bandwidth: dict, engine: dict | None, adapter_bytes: int) -> dict:
    """Bounds vs the achieved batch-1 decode step (from scenario 1)."""
    bw = bandwidth["gb_s"]["median"] * 1e9
    ours = weight_bytes_per_step(base)
    gguf_step = gguf_tensor_bytes(base, per_step=True)
    bound_ms = ours / bw * 1e3
    bound_lora_ms = (ours + adapter_bytes) / bw * 1e3
    gguf_ms = gguf_step / bw * 1e3
    held, gguf_all = base.weight_bytes, gguf_tensor_bytes(base)
    out = {
        "bandwidth": bandwidth,
        "dtype": str(base.dtype).removeprefix("torch."),
        "weights": base.weight_form,
        "weight_bytes_held": held,
        "gguf_tensor_bytes": gguf_all,
        "held_over_gguf": ratio(held, gguf_all),
        "weight_bytes_per_step": ours,
        "gguf_bytes_per_step": gguf_step,
        "adapter_bytes": adapter_bytes,
        "bound_ms": bound_ms,
        "bound_lora_ms": bound_lora_ms,
        "bound_gguf_ms": gguf_ms,
        "bound_tok_s_b1": 1e3 / bound_ms,
        "bound_gguf_tok_s_b1": 1e3 / gguf_ms,
    }
    if engine:
        base_ms = engine["variants"]["base"]["decode"]["1"]["step_ms"]["median"]
        lora_ms = engine["variants"]["lora"]["decode"]["1"]["step_ms"]["median"]
        out.update(
            achieved_ms=base_ms,
            achieved_lora_ms=lora_ms,
            # achieved / bound, as throughput (≤ 1: the fraction of the roofline reached)
            achieved_over_bound=ratio(bound_ms, base_ms),
            achieved_over_bound_lora=ratio(bound_lora_ms, lora_ms),
            achieved_over_bound_gguf=ratio(gguf_ms, base_ms),
        )
    return out


def add_serving(out: dict, serving: dict | None) -> dict:
    """Add the serving scenario's worker RSS and 1-stream per-token times (when it ran)."""
    out = dict(out)
    if not serving or "error" in serving:
        return out
    rss = (serving.get("worker_rss") or {}).get("mixed") or {}
    out["worker_rss_bytes"] = rss.get("loaded")
    out["worker_rss_anon_bytes"] = rss.get("loaded_anon")
    key = serving.get("single_key")
    if key:
        ours = serving["modes"]["mixed"].get(key)
        if ours:
            out["ours_1stream_itl_p50_ms"] = ours["itl_p50_ms"]["median"]
            out["ours_1stream_tok_s"] = ours["tok_s"]["median"]
        peer = (serving.get("llama_server") or {}).get("runs", {}).get(key)
        if peer:
            ms = (peer.get("per_token_ms") or {}).get("median")
            out["llama_server_1stream_per_token_ms"] = ms
            out["llama_server_1stream_itl_p50_ms"] = peer["itl_p50_ms"]["median"]
            out["llama_server_1stream_tok_s"] = peer["tok_s"]["median"]
            if ms is not None and math.isfinite(ms):
                out["llama_server_over_bound_gguf"] = ratio(out["bound_gguf_ms"], ms)
    return out
