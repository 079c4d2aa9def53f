"""What every architecture shares: the hyper-parameter base record, tensor specs, metadata reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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


@dataclass(frozen=True)
class TensorSpec:
    """A tensor an architecture declares: GGUF name, expected ggml ``ne`` (None: any), required."""

    name: str
    ne: tuple[int, ...] | None
    required: bool = True


def meta(gguf: Any, key: str, default: Any = None, *, required: bool = False) -> Any:
    """``{arch}.{key}`` from metadata; raises ModelError naming the key when required and absent."""
    full = f"{gguf.arch}.{key}"
    if full in gguf.metadata:
        return gguf.metadata[full]
    if required:
        from worker.runtime.model import ModelError

        raise ModelError(f"{gguf.path}: missing metadata key '{full}'")
    return default
