"""Qwen 2 / 2.5 (llama.cpp ``src/models/qwen2.cpp``).

Per layer: RMS norm → q/k/v, each plus its bias (``attn_{q,k,v}.bias``) → NEOX-mode rope
(halves rotated; the converter does not permute q/k for this arch) → attention with scale
1/sqrt(head_dim), GQA → o → residual → RMS norm → SiLU-gated FFN → residual. The output
projection is ``output.weight`` when the file has it, else tied to ``token_embd`` (stock
Qwen2.5 0.5–3B files are tied).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from loraplane.formats.arch.qwen2 import HParams
from worker.runtime.graph import GraphContext, inv_sqrt
from worker.runtime.layer import LayerSpec, Rope, build_layer, dense_spec, layer_specs


def layer_spec(hp: Any, il: int) -> LayerSpec:
    """Layer ``il``'s rules: q/k/v biases, NEOX rope, scale 1/sqrt(head_dim), SiLU."""
    return dense_spec(
        hp,
        il,
        rope=Rope(n_rot=hp.n_rot, freq_base=hp.rope_freq_base, freq_scale=hp.rope_freq_scale, neox=True),
        qkv_bias=True,
        kq_scale=inv_sqrt(hp.n_embd_head_k),
        act="silu",
    )


LayerSpecFn = Callable[[Any, int], LayerSpec]


def build_layers(ctx: GraphContext, hp: Any, spec_of: LayerSpecFn) -> torch.Tensor:
    """The Qwen decoder: embedding, the layers ``spec_of(hp, il)`` describes, the output norm and
    head. Returns logits ``(n_out, n_vocab)`` for the wanted rows."""
    x = ctx.build_inp_embd("token_embd.weight")
    for il, spec in enumerate(layer_specs(ctx, hp, spec_of)):
        x = build_layer(ctx, spec, il, x, last=il == hp.n_layer - 1)
    x = ctx.build_norm(x, "output_norm.weight", hp.eps)
    return ctx.build_output(x)


def build_graph(ctx: GraphContext, hp: HParams) -> torch.Tensor:
    """Forward pass of one ubatch; returns logits ``(n_out, n_vocab)`` for the wanted rows."""
    return build_layers(ctx, hp, layer_spec)
