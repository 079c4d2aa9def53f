"""Llama 1/2/3.x, dense and mixture-of-experts (llama.cpp ``src/models/llama.cpp``).

Per layer: RMS norm → q/k/v → NORM-mode rope (adjacent pairs; the GGUF converter permuted
q/k for it; with ``rope_freqs.weight`` — Llama 3.1+ "llama3" rope scaling — each pair's
frequency is divided by its factor, ggml ``rope_ext`` ``freq_factors``) → attention with
scale 1/sqrt(head_dim) → o → residual → RMS norm → SiLU-gated
FFN, or, when the layer has ``ffn_gate_inp``, a top-k softmax-gated mixture of experts with
weights renormalised over the chosen experts (Mixtral) → residual. Untied ``output.weight``
(falls back to ``token_embd`` when absent: Llama 3.2 1B/3B are tied).
"""

from __future__ import annotations

import torch

from loraplane.formats.arch.llama import ROPE_FREQS, HParams
from worker.runtime.arch import blocks
from worker.runtime.graph import GraphContext, inv_sqrt


def build_graph(ctx: GraphContext, hp: HParams) -> torch.Tensor:
    """Forward pass of one ubatch; returns logits ``(n_out, n_vocab)`` for the wanted rows."""
    x = ctx.build_inp_embd("token_embd.weight")
    ff = ROPE_FREQS if ROPE_FREQS in ctx.w else None
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        cur = ctx.build_norm(x, b + "attn_norm.weight", hp.eps)
        q, k, v = blocks.build_qkv(ctx, hp, b, cur)
        q = ctx.build_rope(
            q, n_rot=hp.n_rot, freq_base=hp.rope_freq_base, freq_scale=hp.rope_freq_scale, neox=False, freq_factors=ff
        )
        k = ctx.build_rope(
            k, n_rot=hp.n_rot, freq_base=hp.rope_freq_base, freq_scale=hp.rope_freq_scale, neox=False, freq_factors=ff
        )
        cur = ctx.build_attn(il, q, k, v, wo=b + "attn_output.weight", kq_scale=inv_sqrt(hp.n_embd_head_k))
        if il == hp.n_layer - 1:
            cur, x = ctx.build_inp_out_ids(cur), ctx.build_inp_out_ids(x)
        ffn_inp = cur + x
        cur = ctx.build_norm(ffn_inp, b + "ffn_norm.weight", hp.eps)
        if hp.n_expert > 0:
            cur = ctx.build_moe_ffn(
                cur,
                gate_inp=b + "ffn_gate_inp.weight",
                up_exps=b + "ffn_up_exps.weight",
                gate_exps=b + "ffn_gate_exps.weight",
                down_exps=b + "ffn_down_exps.weight",
                n_expert_used=hp.n_expert_used,
                norm_w=True,
            )
        else:
            cur = ctx.build_ffn(
                cur, up=b + "ffn_up.weight", gate=b + "ffn_gate.weight", down=b + "ffn_down.weight", act="silu"
            )
        x = cur + ffn_inp
    x = ctx.build_norm(x, "output_norm.weight", hp.eps)
    return ctx.build_output(x)
