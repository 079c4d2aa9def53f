"""Qwen 3 mixture-of-experts (llama.cpp ``src/models/qwen3moe.cpp``).

Per layer: Qwen 3 attention (RMS norm → q/k/v → per-head q/k RMS norms → NEOX rope →
attention, scale 1/sqrt(head_dim) → o) → residual → RMS norm → mixture of experts:
softmax over ``ffn_gate_inp`` logits, top ``expert_used_count`` experts, their weights
renormalised to sum to 1 (llama.cpp passes ``norm_w = true`` for this arch), each a
SiLU-gated FFN of ``expert_feed_forward_length``; no shared expert → residual. Output
``output.weight`` or tied to ``token_embd``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from loraplane.formats.arch.qwen3moe import HParams
from worker.runtime.arch import qwen2, qwen3
from worker.runtime.graph import GraphContext
from worker.runtime.layer import LayerSpec, moe_ffn


def layer_spec(hp: Any, il: int) -> LayerSpec:
    """Qwen 3's layer with a softmax-gated top-k mixture of experts, weights renormalised."""
    return replace(qwen3.layer_spec(hp, il), moe=moe_ffn(il, hp.n_expert_used))


def build_graph(ctx: GraphContext, hp: HParams) -> torch.Tensor:
    """Forward pass of one ubatch; returns logits ``(n_out, n_vocab)`` for the wanted rows."""
    return qwen2.build_layers(ctx, hp, layer_spec)
