"""Qwen 3 dense (llama.cpp ``src/models/qwen3.cpp``).

Per layer: RMS norm → q/k/v (no biases) → per-head RMS norm of q and of k
(``attn_q_norm`` / ``attn_k_norm``, over each head's ``head_dim``) → NEOX-mode rope →
attention with scale 1/sqrt(head_dim), GQA → o → residual → RMS norm → SiLU-gated FFN →
residual. The output projection is ``output.weight`` when present, else tied to
``token_embd`` (Qwen3 0.6B–4B files are tied).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.runtime.arch import base
from worker.runtime.arch.base import TensorSpec, meta
from worker.runtime.graph import GraphContext, inv_sqrt


@dataclass(frozen=True)
class HParams(base.HParams):
    """Qwen 3 hyper-parameters: the shared base plus the rope dimension count (= head_dim)."""

    n_rot: int


def load_hparams(gguf) -> HParams:
    """``qwen3.*`` metadata (llama.cpp ``llama_model_qwen3::load_arch_hparams``)."""
    n_vocab = int(meta(gguf, "vocab_size", 0)) or int(gguf.tensors["token_embd.weight"].ne[1])
    common = base.common_hparams(gguf, n_vocab=n_vocab, eps=1e-6, rope_freq_base=10000.0, n_ctx_train=40960)
    return HParams(**common, n_rot=int(meta(gguf, "rope.dimension_count", common["n_embd_head_k"])))


def attn_tensor_specs(hp: base.HParams, b: str) -> list[TensorSpec]:
    """Attention tensors of one Qwen 3 layer with prefix ``b`` (``blk.N.``): q/k/v/o and the
    per-head q/k norms ``(head_dim,)`` (shared with ``qwen3moe``)."""
    d = hp.n_embd
    return [
        TensorSpec(b + "attn_norm.weight", (d,)),
        TensorSpec(b + "attn_q.weight", (d, hp.n_head * hp.n_embd_head_k)),
        TensorSpec(b + "attn_k.weight", (d, hp.n_head_kv * hp.n_embd_head_k)),
        TensorSpec(b + "attn_v.weight", (d, hp.n_head_kv * hp.n_embd_head_v)),
        TensorSpec(b + "attn_q_norm.weight", (hp.n_embd_head_k,)),
        TensorSpec(b + "attn_k_norm.weight", (hp.n_embd_head_k,)),
        TensorSpec(b + "attn_output.weight", (hp.n_head * hp.n_embd_head_v, d)),
        TensorSpec(b + "ffn_norm.weight", (d,)),
    ]


def tensor_specs(hp: HParams) -> list[TensorSpec]:
    d = hp.n_embd
    specs = [
        TensorSpec("token_embd.weight", (d, hp.n_vocab)),
        TensorSpec("output_norm.weight", (d,)),
        TensorSpec("output.weight", (d, hp.n_vocab), required=False),
    ]
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        specs += attn_tensor_specs(hp, b)
        specs += [
            TensorSpec(b + "ffn_gate.weight", (d, hp.n_ff)),
            TensorSpec(b + "ffn_up.weight", (d, hp.n_ff)),
            TensorSpec(b + "ffn_down.weight", (hp.n_ff, d)),
        ]
    return specs


def build_attn_block(ctx: GraphContext, hp: HParams, il: int, x: torch.Tensor) -> torch.Tensor:
    """Layer ``il``'s attention on the residual stream x ``(n, d)``: norm, q/k/v, per-head q/k
    RMS norms, NEOX rope, attention, o. Returns ``(n, d)`` before the residual add."""
    b = f"blk.{il}."
    n = x.shape[0]
    cur = ctx.build_norm(x, b + "attn_norm.weight", hp.eps)
    q, k, v = ctx.build_lora_mm_group((b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"), cur)
    q = ctx.build_norm(q.reshape(n, hp.n_head, hp.n_embd_head_k), b + "attn_q_norm.weight", hp.eps)
    k = ctx.build_norm(k.reshape(n, hp.n_head_kv, hp.n_embd_head_k), b + "attn_k_norm.weight", hp.eps)
    v = v.reshape(n, hp.n_head_kv, hp.n_embd_head_v)
    q = ctx.build_rope(q, n_rot=hp.n_rot, freq_base=hp.rope_freq_base, freq_scale=hp.rope_freq_scale, neox=True)
    k = ctx.build_rope(k, n_rot=hp.n_rot, freq_base=hp.rope_freq_base, freq_scale=hp.rope_freq_scale, neox=True)
    return ctx.build_attn(il, q, k, v, wo=b + "attn_output.weight", kq_scale=inv_sqrt(hp.n_embd_head_k))


def build_graph(ctx: GraphContext, hp: HParams) -> torch.Tensor:
    """Forward pass of one ubatch; returns logits ``(n_out, n_vocab)`` for the wanted rows."""
    x = ctx.build_inp_embd("token_embd.weight")
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        cur = build_attn_block(ctx, hp, il, x)
        if il == hp.n_layer - 1:
            cur, x = ctx.build_inp_out_ids(cur), ctx.build_inp_out_ids(x)
        ffn_inp = cur + x
        cur = ctx.build_norm(ffn_inp, b + "ffn_norm.weight", hp.eps)
        cur = ctx.build_ffn(
            cur, up=b + "ffn_up.weight", gate=b + "ffn_gate.weight", down=b + "ffn_down.weight", act="silu"
        )
        x = cur + ffn_inp
    x = ctx.build_norm(x, "output_norm.weight", hp.eps)
    return ctx.build_output(x)
