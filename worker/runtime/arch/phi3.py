"""Phi-3 / Phi-3.5 / Phi-4-mini dense (llama.cpp ``src/models/phi3.cpp``).

Per layer: RMS norm → q/k/v from the fused ``attn_qkv.weight`` ``(q + k + v, d)``: one
matmul (its LoRA is the fused tensor's own pair, ``blk.N.attn_qkv.weight.lora_a/b``, applied
before the split, as llama.cpp's ``build_qkv`` does) whose output rows are cut into q, k, v
(separate ``attn_q/k/v.weight`` are accepted too) → NEOX-mode rope, with LongRoPE factors
when the file has them (``rope_factors_short.weight`` while the context is within
``rope.scaling.original_context_length``, ``rope_factors_long.weight`` beyond it, each
dividing its pair's frequency; cos/sin times ``rope.scaling.attn_factor``) → q scaled by
1/sqrt(head_dim), attention with scale 1 → o → residual → RMS norm → SwiGLU FFN from the
fused ``ffn_up.weight`` ``(2·n_ff, d)``: first half gate (SiLU), second half up
(``ggml_swiglu``) → down → residual. The output projection is ``output.weight`` or tied to
``token_embd``. Sliding-window metadata is ignored (llama.cpp disables Phi-3 SWA).
"""

from __future__ import annotations

import torch

from loraplane.formats.arch.phi3 import ROPE_LONG, ROPE_SHORT, HParams
from worker.runtime.graph import GraphContext, inv_sqrt
from worker.runtime.layer import LayerSpec, Rope, build_layer, dense_spec, layer_specs


def rope_factors(ctx: GraphContext, hp: HParams) -> str | None:
    """The LongRoPE factor tensor for this context (llama.cpp ``llama_model::get_rope_factors``):
    long when the context's per-sequence length exceeds ``n_ctx_orig``, else short; None when
    the file has neither."""
    name = ROPE_LONG if ctx.kv.n_ctx_seq > hp.n_ctx_orig else ROPE_SHORT
    return name if name in ctx.w else None


def layer_spec(hp: HParams, il: int, freq_factors: str | None) -> LayerSpec:
    """Layer ``il``'s rules: fused or separate q/k/v, NEOX rope with LongRoPE factors and
    ``rope_attn_factor``, q times 1/sqrt(head_dim), fused gate/up SwiGLU."""
    fused = {"qkv": (f"blk.{il}.attn_qkv.weight",)} if hp.fused_qkv else {}
    return dense_spec(
        hp,
        il,
        rope=Rope(
            n_rot=hp.n_rot,
            freq_base=hp.rope_freq_base,
            freq_scale=hp.rope_freq_scale,
            neox=True,
            freq_factors=freq_factors,
            attn_factor=hp.rope_attn_factor,
        ),
        **fused,
        q_scale=inv_sqrt(hp.n_embd_head_k),
        kq_scale=1.0,
        ffn_gate=None,
        act="silu",
    )


def build_graph(ctx: GraphContext, hp: HParams) -> torch.Tensor:
    """Forward pass of one ubatch; returns logits ``(n_out, n_vocab)`` for the wanted rows."""
    x = ctx.build_inp_embd("token_embd.weight")
    ff = rope_factors(ctx, hp)
    for il, spec in enumerate(layer_specs(ctx, hp, layer_spec, ff)):
        x = build_layer(ctx, spec, il, x, last=il == hp.n_layer - 1)
    x = ctx.build_norm(x, "output_norm.weight", hp.eps)
    return ctx.build_output(x)
