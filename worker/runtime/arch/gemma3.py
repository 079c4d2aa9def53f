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
from worker.runtime.arch import blocks
from worker.runtime.graph import GraphContext


def build_graph(ctx: GraphContext, hp: HParams) -> torch.Tensor:
    """Forward pass of one ubatch; returns logits ``(n_out, n_vocab)`` for the wanted rows."""
    x = ctx.build_inp_embd("token_embd.weight") * math.sqrt(hp.n_embd)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        swa = hp.is_swa(il)
        cur = ctx.build_norm(x, b + "attn_norm.weight", hp.eps)
        q, k, v = blocks.build_qkv(ctx, hp, b, cur)
        q = ctx.build_norm(q, b + "attn_q_norm.weight", hp.eps)
        k = ctx.build_norm(k, b + "attn_k_norm.weight", hp.eps)
        fbase = hp.rope_freq_base_swa if swa else hp.rope_freq_base
        fscale = 1.0 if swa else hp.rope_freq_scale
        q = ctx.build_rope(q, n_rot=hp.n_embd_head_k, freq_base=fbase, freq_scale=fscale, neox=True)
        k = ctx.build_rope(k, n_rot=hp.n_embd_head_k, freq_base=fbase, freq_scale=fscale, neox=True)
        q = q * hp.f_attention_scale
        cur = ctx.build_attn(il, q, k, v, wo=b + "attn_output.weight", kq_scale=1.0, n_swa=hp.n_swa if swa else 0)
        if il == hp.n_layer - 1:
            cur, x = ctx.build_inp_out_ids(cur), ctx.build_inp_out_ids(x)
        cur = ctx.build_norm(cur, b + "post_attention_norm.weight", hp.eps)
        sa_out = cur + x
        cur = ctx.build_norm(sa_out, b + "ffn_norm.weight", hp.eps)
        cur = ctx.build_ffn(
            cur, up=b + "ffn_up.weight", gate=b + "ffn_gate.weight", down=b + "ffn_down.weight", act="gelu"
        )
        cur = ctx.build_norm(cur, b + "post_ffw_norm.weight", hp.eps)
        x = cur + sa_out
    x = ctx.build_norm(x, "output_norm.weight", hp.eps)
    return ctx.build_output(x)
