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


def rope_factors(ctx: GraphContext, hp: HParams) -> str | None:
    """The LongRoPE factor tensor for this context (llama.cpp ``llama_model::get_rope_factors``):
    long when the context's per-sequence length exceeds ``n_ctx_orig``, else short; None when
    the file has neither."""
    name = ROPE_LONG if ctx.kv.n_ctx_seq > hp.n_ctx_orig else ROPE_SHORT
    return name if name in ctx.w else None


def build_graph(ctx: GraphContext, hp: HParams) -> torch.Tensor:
    """Forward pass of one ubatch; returns logits ``(n_out, n_vocab)`` for the wanted rows."""
    x = ctx.build_inp_embd("token_embd.weight")
    n = x.shape[0]
    q_w, k_w = hp.n_head * hp.n_embd_head_k, hp.n_head_kv * hp.n_embd_head_k
    ff = rope_factors(ctx, hp)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        cur = ctx.build_norm(x, b + "attn_norm.weight", hp.eps)
        if hp.fused_qkv:
            qkv = ctx.build_lora_mm(b + "attn_qkv.weight", cur)
            q, k, v = qkv[:, :q_w], qkv[:, q_w : q_w + k_w], qkv[:, q_w + k_w :]
        else:
            q, k, v = ctx.build_lora_mm_group((b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"), cur)
        q = q.reshape(n, hp.n_head, hp.n_embd_head_k)
        k = k.reshape(n, hp.n_head_kv, hp.n_embd_head_k)
        v = v.reshape(n, hp.n_head_kv, hp.n_embd_head_v)
        for_rope = dict(freq_base=hp.rope_freq_base, freq_scale=hp.rope_freq_scale)
        q = ctx.build_rope(q, n_rot=hp.n_rot, neox=True, freq_factors=ff, attn_factor=hp.rope_attn_factor, **for_rope)
        k = ctx.build_rope(k, n_rot=hp.n_rot, neox=True, freq_factors=ff, attn_factor=hp.rope_attn_factor, **for_rope)
        q = q * inv_sqrt(hp.n_embd_head_k)
        cur = ctx.build_attn(il, q, k, v, wo=b + "attn_output.weight", kq_scale=1.0)
        if il == hp.n_layer - 1:
            cur, x = ctx.build_inp_out_ids(cur), ctx.build_inp_out_ids(x)
        ffn_inp = cur + x
        cur = ctx.build_norm(ffn_inp, b + "ffn_norm.weight", hp.eps)
        cur = ctx.build_ffn(cur, up=b + "ffn_up.weight", gate=None, down=b + "ffn_down.weight", act="silu")
        x = cur + ffn_inp
    x = ctx.build_norm(x, "output_norm.weight", hp.eps)
    return ctx.build_output(x)
