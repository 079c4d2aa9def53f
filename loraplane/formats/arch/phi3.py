"""Phi-3 / Phi-3.5 / Phi-4-mini dense: hyper-parameters and tensors (llama.cpp
``src/models/phi3.cpp``; the forward pass is ``worker.runtime.arch.phi3``)."""

from __future__ import annotations

from dataclasses import dataclass

from loraplane.formats.arch import base
from loraplane.formats.arch.base import TensorSpec, meta
from loraplane.formats.gguf.reader import GGUFFile

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


def load_hparams(gguf: GGUFFile) -> HParams:
    """``phi3.*`` metadata (llama.cpp ``llama_model_phi3::load_arch_hparams`` and the shared
    rope-scaling keys of ``llama_model::load_hparams``).

    Raises:
        ArchError: a required key is missing (`base.common_hparams`).
    """
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
    """The tensors of a Phi-3 file: fused ``attn_qkv`` ne ``[d, q + k + v]`` (or separate
    q/k/v) and the fused gate|up ``ffn_up`` ne ``[d, 2·n_ff]``."""
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
