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

from dataclasses import dataclass

import torch

from worker.runtime.arch import base
from worker.runtime.arch.base import TensorSpec, meta
from worker.runtime.graph import GraphContext, inv_sqrt

ROPE_SHORT = "rope_factors_short.weight"
ROPE_LONG = "rope_factors_long.weight"
"""LongRoPE per-dimension frequency factors, ne ``[n_rot/2]`` (one tensor for all layers)."""


@dataclass(frozen=True)
class HParams(base.HParams):
    """Phi-3 hyper-parameters: the shared base plus the fields below.

    Attributes:
        n_rot: rope dimensions.
        n_ctx_orig: ``rope.scaling.original_context_length`` (default ``context_length``):
            above it LongRoPE uses the long factors.
        rope_attn_factor: ``rope.scaling.attn_factor`` (1 when absent).
        fused_qkv: the file stores ``attn_qkv.weight`` (else separate q/k/v).
    """

    n_rot: int
    n_ctx_orig: int
    rope_attn_factor: float
    fused_qkv: bool


def load_hparams(gguf) -> HParams:
    """``phi3.*`` metadata (llama.cpp ``llama_model_phi3::load_arch_hparams`` and the shared
    rope-scaling keys of ``llama_model::load_hparams``)."""
    n_vocab = int(meta(gguf, "vocab_size", 0)) or int(gguf.tensors["token_embd.weight"].ne[1])
    common = base.common_hparams(gguf, n_vocab=n_vocab, eps=1e-5, rope_freq_base=10000.0, n_ctx_train=4096)
    return HParams(
        **common,
        n_rot=int(meta(gguf, "rope.dimension_count", common["n_embd_head_k"])),
        n_ctx_orig=int(meta(gguf, "rope.scaling.original_context_length", common["n_ctx_train"])),
        rope_attn_factor=float(meta(gguf, "rope.scaling.attn_factor", 1.0)),
        fused_qkv="blk.0.attn_qkv.weight" in gguf.tensors,
    )


def tensor_specs(hp: HParams) -> list[TensorSpec]:
    d = hp.n_embd
    q, kv_k, kv_v = hp.n_head * hp.n_embd_head_k, hp.n_head_kv * hp.n_embd_head_k, hp.n_head_kv * hp.n_embd_head_v
    specs = base.output_specs(hp) + [
        TensorSpec(ROPE_SHORT, (hp.n_rot // 2,), required=False),
        TensorSpec(ROPE_LONG, (hp.n_rot // 2,), required=False),
    ]
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        if hp.fused_qkv:
            specs += [
                TensorSpec(b + "attn_norm.weight", (d,)),
                TensorSpec(b + "attn_qkv.weight", (d, q + kv_k + kv_v)),
                TensorSpec(b + "attn_output.weight", (hp.n_head * hp.n_embd_head_v, d)),
            ]
        else:
            specs += base.attn_specs(hp, b)
        specs += [
            TensorSpec(b + "ffn_norm.weight", (d,)),
            TensorSpec(b + "ffn_up.weight", (d, 2 * hp.n_ff)),
            TensorSpec(b + "ffn_down.weight", (hp.n_ff, d)),
        ]
    return specs


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
