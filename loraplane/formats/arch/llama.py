"""Llama 1/2/3.x, dense and mixture-of-experts: hyper-parameters and tensors (llama.cpp
``src/models/llama.cpp``; the forward pass is ``worker.runtime.arch.llama``)."""

from __future__ import annotations

from dataclasses import dataclass

from loraplane.formats.arch import base
from loraplane.formats.arch.base import TensorSpec, meta
from loraplane.formats.gguf.reader import GGUFFile


@dataclass(frozen=True)
class HParams(base.HParams):
    """Llama hyper-parameters: the shared base plus the fields below.

    Attributes:
        n_rot: rope dimensions.
        n_expert / n_expert_used: experts per layer and experts per token (0: dense).
    """

    n_rot: int
    n_expert: int
    n_expert_used: int


def load_hparams(gguf: GGUFFile) -> HParams:
    """``llama.*`` metadata (llama.cpp ``llama_model::load_hparams``).

    Raises:
        ArchError: a required key is missing (`base.common_hparams`).
    """
    n_vocab = int(meta(gguf, "vocab_size", 0)) or int(gguf.tensors["token_embd.weight"].ne[1])
    common = base.common_hparams(gguf, n_vocab=n_vocab, eps=1e-5, rope_freq_base=10000.0, n_ctx_train=4096)
    return HParams(
        **common,
        n_rot=int(meta(gguf, "rope.dimension_count", common["n_embd_head_k"])),
        n_expert=int(meta(gguf, "expert_count", 0)),
        n_expert_used=int(meta(gguf, "expert_used_count", 0)),
    )


ROPE_FREQS = "rope_freqs.weight"
"""Llama 3 per-dimension rope frequency factors, ne ``[n_rot/2]`` (one tensor shared by all layers)."""


def tensor_specs(hp: HParams) -> list[TensorSpec]:
    """The tensors of a Llama file: dense FFN, or experts ne ``[d, n_ff, E]`` when ``n_expert``."""
    d = hp.n_embd
    specs = base.output_specs(hp) + [TensorSpec(ROPE_FREQS, (hp.n_rot // 2,), required=False)]
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        specs += base.attn_specs(hp, b)
        if hp.n_expert > 0:
            specs += [
                TensorSpec(b + "ffn_norm.weight", (d,)),
                TensorSpec(b + "ffn_gate_inp.weight", (d, hp.n_expert)),
                TensorSpec(b + "ffn_gate_exps.weight", (d, hp.n_ff, hp.n_expert)),
                TensorSpec(b + "ffn_up_exps.weight", (d, hp.n_ff, hp.n_expert)),
                TensorSpec(b + "ffn_down_exps.weight", (hp.n_ff, d, hp.n_expert)),
            ]
        else:
            specs += base.ffn_specs(hp, b)
    return specs
