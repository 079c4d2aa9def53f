"""Qwen 3 dense (llama.cpp ``src/models/qwen3.cpp``).

Per layer: RMS norm → q/k/v (no biases) → per-head RMS norm of q and of k
(``attn_q_norm`` / ``attn_k_norm``, over each head's ``head_dim``) → NEOX-mode rope →
attention with scale 1/sqrt(head_dim), GQA → o → residual → RMS norm → SiLU-gated FFN →
residual. The output projection is ``output.weight`` when present, else tied to
``token_embd`` (Qwen3 0.6B–4B files are tied).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from loraplane.formats.arch.qwen3 import HParams
from worker.runtime.arch import qwen2
from worker.runtime.graph import GraphContext
from worker.runtime.layer import LayerSpec


def layer_spec(hp: Any, il: int) -> LayerSpec:
    """Qwen 2's layer without q/k/v biases, with per-head q/k RMS norms."""
    b = f"blk.{il}."
    return replace(
        qwen2.layer_spec(hp, il), qkv_bias=False, q_norm=b + "attn_q_norm.weight", k_norm=b + "attn_k_norm.weight"
    )


def build_graph(ctx: GraphContext, hp: HParams) -> torch.Tensor:
    """Forward pass of one ubatch (Qwen 2's decoder with this layer); returns logits
    ``(n_out, n_vocab)`` for the wanted rows."""
    return qwen2.build_layers(ctx, hp, layer_spec)
