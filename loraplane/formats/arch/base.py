"""What every architecture shares: the hyper-parameter base record, tensor specs, metadata reads
(torch-free: the control plane and the worker both read them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplane.formats.gguf.reader import GGUFFile


class ArchError(ValueError):
    """A base model GGUF does not fit the architecture table: an architecture we do not serve,
    or a required ``{arch}.*`` metadata key missing or out of range. Messages name the file and
    the key or architecture at fault (the worker re-raises them as ``ModelError``)."""


@dataclass(frozen=True)
class HParams:
    """Hyper-parameters every architecture has (llama.cpp ``llama_hparams``).

    Attributes:
        n_vocab / n_embd / n_layer / n_ff: vocabulary, width, blocks, FFN width.
        n_head / n_head_kv: query and key/value heads (GQA when they differ).
        n_embd_head_k / n_embd_head_v: per-head K and V widths.
        eps: RMS-norm epsilon.
        rope_freq_base / rope_freq_scale: rope theta and 1/scaling-factor (linear scaling).
        n_swa: sliding-window size in tokens (0: none).
        n_ctx_train: training context (informational).
    """

    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int
    eps: float
    rope_freq_base: float
    rope_freq_scale: float
    n_swa: int
    n_ctx_train: int

    def is_swa(self, il: int) -> bool:
        """Whether layer ``il`` attends through the sliding window (default: never)."""
        return False


def common_hparams(
    gguf: GGUFFile, *, n_vocab: int, eps: float, rope_freq_base: float, n_ctx_train: int, n_swa: int = 0
) -> dict[str, Any]:
    """The ``HParams`` base fields read from ``{arch}.*`` metadata (llama.cpp
    ``llama_model::load_hparams``), with the architecture's defaults for the optional keys.

    Raises:
        ArchError: a required key (embedding_length, attention.head_count,
            block_count, feed_forward_length) is missing.
    """
    n_embd = int(meta(gguf, "embedding_length", required=True))
    n_head = int(meta(gguf, "attention.head_count", required=True))
    head_k = int(meta(gguf, "attention.key_length", n_embd // n_head))
    scale_factor = meta(gguf, "rope.scaling.factor", None)
    return dict(
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=int(meta(gguf, "block_count", required=True)),
        n_ff=int(meta(gguf, "feed_forward_length", required=True)),
        n_head=n_head,
        n_head_kv=int(meta(gguf, "attention.head_count_kv", n_head)),
        n_embd_head_k=head_k,
        n_embd_head_v=int(meta(gguf, "attention.value_length", head_k)),
        eps=float(meta(gguf, "attention.layer_norm_rms_epsilon", eps)),
        rope_freq_base=float(meta(gguf, "rope.freq_base", rope_freq_base)),
        rope_freq_scale=1.0 / float(scale_factor) if scale_factor else 1.0,
        n_swa=n_swa,
        n_ctx_train=int(meta(gguf, "context_length", n_ctx_train)),
    )


@dataclass(frozen=True)
class TensorSpec:
    """A tensor an architecture declares: GGUF name, expected ggml ``ne`` (None: any), required."""

    name: str
    ne: tuple[int, ...] | None
    required: bool = True


def meta(gguf: GGUFFile, key: str, default: Any = None, *, required: bool = False) -> Any:
    """``{arch}.{key}`` from metadata (``default`` when absent).

    Raises:
        ArchError: ``required`` and absent (names the file and the full key).
    """
    full = f"{gguf.arch}.{key}"
    if full in gguf.metadata:
        return gguf.metadata[full]
    if required:
        raise ArchError(f"{gguf.path}: missing metadata key '{full}'")
    return default


def output_specs(hp: HParams, *, output_optional: bool = True) -> list[TensorSpec]:
    """The embedding, final norm and LM head every decoder has: ``token_embd`` ne ``[d, V]``,
    ``output_norm`` ``[d]``, ``output`` ``[d, V]`` (optional where absent means tied to
    ``token_embd``, as llama.cpp's ``load_tensors`` falls back with ``TENSOR_DUPLICATED``)."""
    d = hp.n_embd
    specs = [TensorSpec("token_embd.weight", (d, hp.n_vocab)), TensorSpec("output_norm.weight", (d,))]
    if output_optional:
        specs.append(TensorSpec("output.weight", (d, hp.n_vocab), required=False))
    return specs


def attn_specs(hp: HParams, b: str) -> list[TensorSpec]:
    """Layer ``b`` (``blk.N.``)'s pre-attention norm and separate q/k/v/o projections:
    q ne ``[d, H·dk]``, k ``[d, Hkv·dk]``, v ``[d, Hkv·dv]``, o ``[H·dv, d]``."""
    d = hp.n_embd
    return [
        TensorSpec(b + "attn_norm.weight", (d,)),
        TensorSpec(b + "attn_q.weight", (d, hp.n_head * hp.n_embd_head_k)),
        TensorSpec(b + "attn_k.weight", (d, hp.n_head_kv * hp.n_embd_head_k)),
        TensorSpec(b + "attn_v.weight", (d, hp.n_head_kv * hp.n_embd_head_v)),
        TensorSpec(b + "attn_output.weight", (hp.n_head * hp.n_embd_head_v, d)),
    ]


def ffn_specs(hp: HParams, b: str) -> list[TensorSpec]:
    """Layer ``b``'s FFN norm and gated FFN: gate/up ne ``[d, n_ff]``, down ``[n_ff, d]``."""
    d = hp.n_embd
    return [
        TensorSpec(b + "ffn_norm.weight", (d,)),
        TensorSpec(b + "ffn_gate.weight", (d, hp.n_ff)),
        TensorSpec(b + "ffn_up.weight", (d, hp.n_ff)),
        TensorSpec(b + "ffn_down.weight", (hp.n_ff, d)),
    ]
