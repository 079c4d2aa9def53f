"""Gemma 3 (llama.cpp ``src/models/gemma3.cpp``, iSWA variant).

Per layer: RMS norm → q/k/v → per-head RMS q/k norms → NEOX rope (sliding layers use base
10000, global layers the model's ``rope.freq_base``) → q scaled by ``f_attention_scale``
→ attention (sliding window on 5 of every 6 layers) → o → post-attention norm → residual →
norm → GELU-gated FFN → post-FFN norm → residual. Input embeddings are scaled by
``sqrt(n_embd)`` (after the embedding LoRA, as llama.cpp's ``build_inp_embd`` adds it
first). The output projection is tied to ``token_embd`` unless the file has
``output.weight`` (a merged export unties it).
"""

from __future__ import annotations

import math

import torch

from loraplane.formats.arch.gemma3 import HParams
from worker.runtime.graph import GraphContext
from worker.runtime.layer import LayerSpec, Rope, build_layer, dense_spec, layer_specs


def layer_spec(hp: HParams, il: int) -> LayerSpec:
    """Layer ``il``'s rules: q/k norms, NEOX rope (sliding layers base ``rope_freq_base_swa``,
    scale 1), q times ``f_attention_scale``, window on sliding layers, sandwich norms, GELU."""
    b = f"blk.{il}."
    swa = hp.is_swa(il)
    return dense_spec(
        hp,
        il,
        rope=Rope(
            n_rot=hp.n_embd_head_k,
            freq_base=hp.rope_freq_base_swa if swa else hp.rope_freq_base,
            freq_scale=1.0 if swa else hp.rope_freq_scale,
            neox=True,
        ),
        q_norm=b + "attn_q_norm.weight",
        k_norm=b + "attn_k_norm.weight",
        q_scale=hp.f_attention_scale,
        kq_scale=1.0,
        n_swa=hp.n_swa if swa else 0,
        post_attn_norm=b + "post_attention_norm.weight",
        act="gelu",
        post_ffw_norm=b + "post_ffw_norm.weight",
    )


def build_graph(ctx: GraphContext, hp: HParams) -> torch.Tensor:
    """Forward pass of one ubatch; returns logits ``(n_out, n_vocab)`` for the wanted rows."""
    x = ctx.build_inp_embd("token_embd.weight") * math.sqrt(hp.n_embd)
    for il, spec in enumerate(layer_specs(ctx, hp, layer_spec)):
        x = build_layer(ctx, spec, il, x, last=il == hp.n_layer - 1)
    x = ctx.build_norm(x, "output_norm.weight", hp.eps)
    return ctx.build_output(x)
