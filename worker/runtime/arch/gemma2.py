"""Gemma 2 (llama.cpp ``src/models/gemma2.cpp``).

Input embeddings scaled by ``sqrt(n_embd)`` (after the embedding LoRA). Per layer: RMS norm
→ q/k/v → NEOX rope → q scaled by ``f_attention_scale`` (1/sqrt(head_dim); the 46-layer 27B
uses 1/sqrt(n_embd/n_head), as llama.cpp does rather than reading
``query_pre_attn_scalar``) → attention with scale 1 and logit soft-capping
``attn_logit_softcapping`` (score → c·tanh(score/c) before mask and softmax; default 50),
sliding window ``attention.sliding_window`` (default 4096) on the layers llama.cpp's
``set_swa_pattern(2)`` marks — every even layer, the odd ones global, unless
``attention.sliding_window_pattern`` says otherwise → o → post-attention RMS norm → residual
→ RMS norm → GELU-gated FFN → post-FFN RMS norm → residual. Final RMS norm, output tied to
``token_embd`` (llama.cpp always ties it for this arch), then final logit soft-capping
``final_logit_softcapping`` (logits → c·tanh(logits/c); default 30).
"""

from __future__ import annotations

import math

import torch

from loraplane.formats.arch.gemma2 import HParams
from worker.runtime.graph import GraphContext
from worker.runtime.layer import LayerSpec, Rope, build_layer, dense_spec, layer_specs


def layer_spec(hp: HParams, il: int) -> LayerSpec:
    """Layer ``il``'s rules: NEOX rope (sliding layers base ``rope_freq_base_swa``), q times
    ``f_attention_scale``, score soft-cap, window on sliding layers, sandwich norms, GELU."""
    b = f"blk.{il}."
    swa = hp.is_swa(il)
    return dense_spec(
        hp,
        il,
        rope=Rope(
            n_rot=hp.n_embd_head_k,
            freq_base=hp.rope_freq_base_swa if swa else hp.rope_freq_base,
            freq_scale=hp.rope_freq_scale,
            neox=True,
        ),
        q_scale=hp.f_attention_scale,
        kq_scale=1.0,
        n_swa=hp.n_swa if swa else 0,
        softcap=hp.attn_softcap,
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
    logits = ctx.build_output(x)
    if hp.final_softcap > 0:
        logits = torch.tanh(logits / hp.final_softcap) * hp.final_softcap
    return logits
