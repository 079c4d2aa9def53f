"""Gemma 3: hyper-parameters and tensors (llama.cpp ``src/models/gemma3.cpp``, iSWA variant; the
forward pass is ``worker.runtime.arch.gemma3``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from loraplane.formats.arch import base
from loraplane.formats.arch.base import TensorSpec, meta
from loraplane.formats.gguf.reader import GGUFFile


@dataclass(frozen=True)
class HParams(base.HParams):
    """Gemma 3 hyper-parameters: the shared base plus the fields below."""

    rope_freq_base_swa: float
    swa_pattern: int
    f_attention_scale: float

    def is_swa(self, il: int) -> bool:
        """llama.cpp ``set_swa_pattern(6)``: every layer but each 6th uses the sliding window."""
        return self.n_swa > 0 and (il % self.swa_pattern) < (self.swa_pattern - 1)


def load_hparams(gguf: GGUFFile) -> HParams:
    """``gemma3.*`` metadata (llama.cpp ``llama_model_gemma3::load_arch_hparams``).

    Raises:
        ArchError: a required key is missing (`base.common_hparams`).
    """
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
    """The tensors of a Gemma 3 file: the common decoder plus per-head q/k norms and
    post-attention / post-FFN norms."""
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
