"""Qwen 3 dense: hyper-parameters and tensors (llama.cpp ``src/models/qwen3.cpp``; the forward
pass is ``worker.runtime.arch.qwen3``)."""

from __future__ import annotations

from loraplane.formats.arch import base, qwen2
from loraplane.formats.arch.base import TensorSpec

# Qwen 3 has Qwen 2's hyper-parameters (llama.cpp ``llama_model_qwen3::load_arch_hparams``
# reads the same keys; ``meta`` prefixes them with the file's own ``general.architecture``).
HParams = qwen2.HParams
load_hparams = qwen2.load_hparams


def attn_tensor_specs(hp: base.HParams, b: str) -> list[TensorSpec]:
    """Attention tensors of one Qwen 3 layer with prefix ``b`` (``blk.N.``): q/k/v/o and the
    per-head q/k norms ``(head_dim,)`` (shared with ``qwen3moe``)."""
    return base.attn_specs(hp, b) + [
        TensorSpec(b + "attn_q_norm.weight", (hp.n_embd_head_k,)),
        TensorSpec(b + "attn_k_norm.weight", (hp.n_embd_head_k,)),
    ]


def tensor_specs(hp: HParams) -> list[TensorSpec]:
    """The tensors of a Qwen 3 file: the common decoder plus per-head q/k norms, no biases."""
    specs = base.output_specs(hp)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        specs += attn_tensor_specs(hp, b) + base.ffn_specs(hp, b)
    return specs
