"""Gemma 2: hyper-parameters and tensors (llama.cpp ``src/models/gemma2.cpp``; the forward pass
is ``worker.runtime.arch.gemma2``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from loraplane.formats.arch import base
from loraplane.formats.arch.base import TensorSpec, meta
from loraplane.formats.gguf.reader import GGUFFile


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


def load_hparams(gguf: GGUFFile) -> HParams:
    """``gemma2.*`` metadata (llama.cpp ``llama_model_gemma2::load_arch_hparams``).

    Raises:
        ArchError: a required key is missing (`base.common_hparams`).
    """
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
    """The tensors of a Gemma 2 file: the common decoder plus post-attention and post-FFN norms;
    the output is always tied to ``token_embd``."""
    d = hp.n_embd
    specs = base.output_specs(hp, output_optional=False)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        specs += base.attn_specs(hp, b) + [TensorSpec(b + "post_attention_norm.weight", (d,))]
        specs += base.ffn_specs(hp, b) + [TensorSpec(b + "post_ffw_norm.weight", (d,))]
    return specs
