"""Qwen 3 mixture-of-experts: hyper-parameters and tensors (llama.cpp ``src/models/qwen3moe.cpp``;
the forward pass is ``worker.runtime.arch.qwen3moe``)."""

from __future__ import annotations

from dataclasses import dataclass

from loraplane.formats.arch import base, qwen3
from loraplane.formats.arch.base import ArchError, TensorSpec, meta
from loraplane.formats.gguf.reader import GGUFFile


@dataclass(frozen=True)
class HParams(qwen3.HParams):
    """Qwen 3 MoE hyper-parameters: Qwen 3's plus the expert counts and expert FFN width."""

    n_expert: int
    n_expert_used: int
    n_ff_exp: int


def load_hparams(gguf: GGUFFile) -> HParams:
    """``qwen3moe.*`` metadata (llama.cpp ``llama_model_qwen3moe::load_arch_hparams``); the
    expert width defaults to ``feed_forward_length / expert_used_count`` as llama.cpp does.

    Raises:
        ArchError: a required key is missing, no experts or no used-expert count.
    """
    q = qwen3.load_hparams(gguf)
    n_expert = int(meta(gguf, "expert_count", 0))
    n_used = int(meta(gguf, "expert_used_count", 0))
    if n_expert <= 0 or n_used <= 0:
        raise ArchError(f"{gguf.path}: qwen3moe needs expert_count and expert_used_count > 0")
    n_ff_exp = int(meta(gguf, "expert_feed_forward_length", 0)) or q.n_ff // n_used
    return HParams(**vars(q), n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp)


def tensor_specs(hp: HParams) -> list[TensorSpec]:
    """The tensors of a Qwen 3 MoE file: Qwen 3 attention, then the router ``ffn_gate_inp`` ne
    ``[d, E]`` and the experts ne ``[d, n_ff_exp, E]`` (down: ``[n_ff_exp, d, E]``)."""
    d, f, e = hp.n_embd, hp.n_ff_exp, hp.n_expert
    specs = base.output_specs(hp)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        specs += qwen3.attn_tensor_specs(hp, b)
        specs += [
            TensorSpec(b + "ffn_norm.weight", (d,)),
            TensorSpec(b + "ffn_gate_inp.weight", (d, e)),
            TensorSpec(b + "ffn_gate_exps.weight", (d, f, e)),
            TensorSpec(b + "ffn_up_exps.weight", (d, f, e)),
            TensorSpec(b + "ffn_down_exps.weight", (f, d, e)),
        ]
    return specs
