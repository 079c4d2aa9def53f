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
from dataclasses import dataclass

import torch

from worker.runtime.arch import base
from worker.runtime.arch.base import TensorSpec, meta
from worker.runtime.graph import GraphContext


@dataclass(frozen=True)
class HParams(base.HParams):
    """Gemma 2 hyper-parameters: the shared base plus the fields below.

    Attributes:
        rope_freq_base_swa: rope theta on sliding layers (``rope.freq_base_swa``, default the
            global one).
        swa_layers: per layer, whether it uses the sliding window.
        f_attention_scale: query scale.
        attn_softcap / final_softcap: attention and final logit soft-capping constants.
    """

    rope_freq_base_swa: float
    swa_layers: tuple[bool, ...]
    f_attention_scale: float
    attn_softcap: float
    final_softcap: float

    def is_swa(self, il: int) -> bool:
        """Whether layer ``il`` attends through the sliding window."""
        return self.n_swa > 0 and self.swa_layers[il]


def swa_layers(n_layer: int, pattern: int) -> tuple[bool, ...]:
    """llama.cpp ``llama_hparams::set_swa_pattern(pattern)``: layer il is sliding when
    ``il % pattern < pattern - 1`` (every layer when pattern is 0)."""
    return tuple(pattern == 0 or il % pattern < pattern - 1 for il in range(n_layer))


def load_hparams(gguf) -> HParams:
    """``gemma2.*`` metadata (llama.cpp ``llama_model_gemma2::load_arch_hparams``)."""
    n_vocab = int(gguf.tensors["token_embd.weight"].ne[1]) if "token_embd.weight" in gguf.tensors else 0
    common = base.common_hparams(
        gguf,
        n_vocab=n_vocab,
        eps=1e-6,
        rope_freq_base=10000.0,
        n_ctx_train=8192,
        n_swa=int(meta(gguf, "attention.sliding_window", 4096)),
    )
    pattern = meta(gguf, "attention.sliding_window_pattern", 2)
    layers = (
        tuple(bool(p) for p in pattern)
        if isinstance(pattern, list | tuple)
        else swa_layers(common["n_layer"], int(pattern))
    )
    att_scale = (
        1.0 / math.sqrt(common["n_embd"] // common["n_head"])
        if common["n_layer"] == 46
        else 1.0 / math.sqrt(common["n_embd_head_k"])
    )
    return HParams(
        **common,
        rope_freq_base_swa=float(meta(gguf, "rope.freq_base_swa", common["rope_freq_base"])),
        swa_layers=layers,
        f_attention_scale=att_scale,
        attn_softcap=float(meta(gguf, "attn_logit_softcapping", 50.0)),
        final_softcap=float(meta(gguf, "final_logit_softcapping", 30.0)),
    )


def tensor_specs(hp: HParams) -> list[TensorSpec]:
    d = hp.n_embd
    specs = base.output_specs(hp, output_optional=False)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        specs += base.attn_specs(hp, b) + [TensorSpec(b + "post_attention_norm.weight", (d,))]
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
        fbase = hp.rope_freq_base_swa if swa else hp.rope_freq_base
        q = ctx.build_rope(q, n_rot=hp.n_embd_head_k, freq_base=fbase, freq_scale=hp.rope_freq_scale, neox=True)
        k = ctx.build_rope(k, n_rot=hp.n_embd_head_k, freq_base=fbase, freq_scale=hp.rope_freq_scale, neox=True)
        q = q * hp.f_attention_scale
        cur = ctx.build_attn(
            il,
            q,
            k,
            v,
            wo=b + "attn_output.weight",
            kq_scale=1.0,
            n_swa=hp.n_swa if swa else 0,
            softcap=hp.attn_softcap,
        )
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
    logits = ctx.build_output(x)
    if hp.final_softcap > 0:
        logits = torch.tanh(logits / hp.final_softcap) * hp.final_softcap
    return logits
