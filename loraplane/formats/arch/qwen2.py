"""Qwen 2 / 2.5: hyper-parameters and tensors (llama.cpp ``src/models/qwen2.cpp``; the forward
pass is ``worker.runtime.arch.qwen2``)."""

from __future__ import annotations

from dataclasses import dataclass

from loraplane.formats.arch import base
from loraplane.formats.arch.base import TensorSpec, meta
from loraplane.formats.gguf.reader import GGUFFile


@dataclass(frozen=True)
class HParams(base.HParams):
    """Qwen 2 hyper-parameters: the shared base plus the rope dimension count."""

    n_rot: int


def load_hparams(gguf: GGUFFile) -> HParams:
    """``{arch}.*`` metadata of a Qwen 2 / Qwen 3 file (llama.cpp ``load_hparams``; rope
    dimensions default to the head size).

    Raises:
        ArchError: a required key is missing (`base.common_hparams`).
    """
    n_vocab = int(meta(gguf, "vocab_size", 0)) or int(gguf.tensors["token_embd.weight"].ne[1])
    common = base.common_hparams(gguf, n_vocab=n_vocab, eps=1e-6, rope_freq_base=10000.0, n_ctx_train=32768)
    return HParams(**common, n_rot=int(meta(gguf, "rope.dimension_count", common["n_embd_head_k"])))


def tensor_specs(hp: HParams) -> list[TensorSpec]:
    """The tensors of a Qwen 2 file: the common decoder plus q/k/v biases."""
    q, kv_k, kv_v = hp.n_head * hp.n_embd_head_k, hp.n_head_kv * hp.n_embd_head_k, hp.n_head_kv * hp.n_embd_head_v
    specs = base.output_specs(hp)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        specs += base.attn_specs(hp, b)
        specs += [TensorSpec(b + "attn_q.bias", (q,)), TensorSpec(b + "attn_k.bias", (kv_k,))]
        specs += [TensorSpec(b + "attn_v.bias", (kv_v,))]
        specs += base.ffn_specs(hp, b)
    return specs
