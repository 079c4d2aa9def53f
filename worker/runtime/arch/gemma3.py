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
from dataclasses import dataclass

import torch

from worker.runtime.arch import base
from worker.runtime.arch.base import TensorSpec, meta
from worker.runtime.graph import GraphContext


@dataclass(frozen=True)
class HParams(base.HParams):
    """Gemma 3 hyper-parameters: the shared base plus the fields below."""

    rope_freq_base_swa: float
    swa_pattern: int
    f_attention_scale: float

    def is_swa(self, il: int) -> bool:
        """llama.cpp ``set_swa_pattern(6)``: every layer but each 6th uses the sliding window."""
        return self.n_swa > 0 and (il % self.swa_pattern) < (self.swa_pattern - 1)


def load_hparams(gguf) -> HParams:
    n_vocab = int(gguf.tensors["token_embd.weight"].ne[1]) if "token_embd.weight" in gguf.tensors else 0
    common = base.common_hparams(
        gguf,
        n_vocab=n_vocab,
        eps=1e-6,
        rope_freq_base=1e6,
        n_ctx_train=8192,
        n_swa=int(meta(gguf, "attention.sliding_window", 0)),
    )
    # Gemma 3 27B scales queries by 1/sqrt(n_embd/n_head); every other size by 1/sqrt(head_k)
    # (llama-model.cpp, LLM_ARCH_GEMMA3 hparams).
    att_scale = (
        1.0 / math.sqrt(common["n_embd_head_k"])
        if common["n_layer"] != 62
        else 1.0 / math.sqrt(common["n_embd"] / common["n_head"])
    )
    return HParams(
        **common,
        rope_freq_base_swa=float(meta(gguf, "rope.freq_base_swa", 10000.0)),
        swa_pattern=6,
        f_attention_scale=att_scale,
    )


def tensor_specs(hp: HParams) -> list[TensorSpec]:
    d = hp.n_embd
    specs = base.output_specs(hp)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        specs += base.attn_specs(hp, b)
        specs += [
            TensorSpec(b + "attn_q_norm.weight", (hp.n_embd_head_k,)),
            TensorSpec(b + "attn_k_norm.weight", (hp.n_embd_head_k,)),
            TensorSpec(b + "post_attention_norm.weight", (d,)),
        ]
        specs += base.ffn_specs(hp, b) + [TensorSpec(b + "post_ffw_norm.weight", (d,))]
    return specs


def build_graph(ctx: GraphContext, hp: HParams) -> torch.Tensor:
    """Forward pass of one ubatch; returns logits ``(n_out, n_vocab)`` for the wanted rows."""
    x = ctx.build_inp_embd("token_embd.weight") * math.sqrt(hp.n_embd)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        swa = hp.is_swa(il)
        cur = ctx.build_norm(x, b + "attn_norm.weight", hp.eps)
        q, k, v = base.build_qkv(ctx, hp, b, cur)
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
