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
from worker.runtime.graph import GraphContext, inv_sqrt
from worker.runtime.layer import LayerSpec, Rope, build_layer, dense_spec, layer_specs, moe_ffn


def layer_spec(hp: HParams, il: int, freq_factors: str | None) -> LayerSpec:
    """Layer ``il``'s rules: NORM rope (with ``freq_factors`` when the file has them), scale
    1/sqrt(head_dim), SiLU FFN or a renormalised top-k mixture of experts."""
    moe = moe_ffn(il, hp.n_expert_used) if hp.n_expert > 0 else None
    return dense_spec(
        hp,
        il,
        rope=Rope(
            n_rot=hp.n_rot,
            freq_base=hp.rope_freq_base,
            freq_scale=hp.rope_freq_scale,
            neox=False,
            freq_factors=freq_factors,
        ),
        kq_scale=inv_sqrt(hp.n_embd_head_k),
        act="silu",
        moe=moe,
    )


def build_graph(ctx: GraphContext, hp: HParams) -> torch.Tensor:
    """Forward pass of one ubatch; returns logits ``(n_out, n_vocab)`` for the wanted rows."""
    x = ctx.build_inp_embd("token_embd.weight")
    ff = ROPE_FREQS if ROPE_FREQS in ctx.w else None
    for il, spec in enumerate(layer_specs(ctx, hp, layer_spec, ff)):
        x = build_layer(ctx, spec, il, x, last=il == hp.n_layer - 1)
    x = ctx.build_norm(x, "output_norm.weight", hp.eps)
    return ctx.build_output(x)
