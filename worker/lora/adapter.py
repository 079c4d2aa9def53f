"""LoRA adapters as device tensors: ``LoraPair`` / ``LoraAdapter`` built from a validated
``worker.lora.adapter_file.AdapterFile`` (the rules and shapes are documented there).

Mirrors llama.cpp ``llama_adapter_lora_init`` (src/llama-adapter.cpp) and
``llama_adapter_lora::get_scale``; it only loads, it never activates anything (that is the
context's job, see ``worker.lora.plan``). Torch shapes are ggml ``ne`` reversed.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from worker.lora.adapter_file import (
    MAX_RANK,
    NODES_PER_LORA_WEIGHT,
    TOKEN_EMBD,
    AdapterError,
    AdapterFile,
    base_tensor_index,
    lora_scale,
    read_adapter_gguf,
    read_lora_adapter,
    validate_lora_adapter,
)


@dataclass(frozen=True, eq=False)
class LoraPair:
    """The A/B matrices that patch one base tensor (torch shapes; see the module table).

    Attributes:
        base_name: the base tensor patched, e.g. ``blk.0.attn_q.weight``.
        lora_a: linear ``(r, k)``; token_embd ``(V, r)``; experts ``(E, r, k)``.
        lora_b: linear ``(d, r)``; token_embd ``(d, r)``; experts ``(E, d, r)``.
    """

    base_name: str
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    @property
    def rank(self) -> int:
        """``r`` = ``B.ne[0]`` = ``lora_b.shape[-1]`` (derived, never stored twice)."""
        return int(self.lora_b.shape[-1])


# eq=False: identity equality/hash (tensors cannot be compared with ==); content identity
# is ``sha256``.
@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A validated LoRA adapter, tensors on their target devices. Immutable.

    Attributes:
        path: the GGUF file; sha256: hex digest of its bytes (content identity).
        arch: ``general.architecture``; name: ``general.name``, else the file stem.
        alpha: ``adapter.lora.alpha``; 0.0 when absent (no alpha/rank factor).
        pairs: base tensor name → ``LoraPair`` (read-only mapping, file order).
        alora_invocation_tokens: ``adapter.alora.invocation_tokens`` (empty: not an aLoRA).
        task_name / prompt_prefix: ``adapter.lora.task_name`` / ``.prompt_prefix`` or "".
        size_bytes: bytes of all A/B tensors as loaded (dtype and count), i.e. the memory the
            adapter occupies; not the file size.
    """

    path: str
    sha256: str
    arch: str
    name: str
    alpha: float
    pairs: Mapping[str, LoraPair]
    alora_invocation_tokens: tuple[int, ...]
    task_name: str
    prompt_prefix: str
    size_bytes: int

    @property
    def n_nodes(self) -> int:
        """Graph nodes llama.cpp reserves for this adapter: 6 per patched weight."""
        return NODES_PER_LORA_WEIGHT * len(self.pairs)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Sorted distinct ranks over all pairs."""
        return tuple(sorted({p.rank for p in self.pairs.values()}))

    def scale(self, adapter_scale: float, pair: LoraPair) -> float:
        """Effective scale of ``pair`` at ``adapter_scale`` (see ``lora_scale``)."""
        return lora_scale(adapter_scale, self.alpha, pair.rank)


def load_lora_adapter(
    path: str | os.PathLike[str],
    *,
    base_arch: str,
    base_tensors: Mapping[str, tuple[int, ...]],
    device_for: Callable[[str], torch.device] = lambda name: torch.device("cpu"),
    dtype: torch.dtype = torch.float32,
) -> LoraAdapter:
    """Load and validate an adapter GGUF against a base model (llama_adapter_lora_init).

    Args:
        path: the adapter GGUF.
        base_arch: the base model's ``general.architecture``.
        base_tensors: base tensor name → ggml ``ne`` (e.g. from ``base_tensor_index``).
        device_for: device of the base tensor a pair patches; A and B go there.
        dtype: torch dtype the A/B tensors are converted to.

    Returns:
        The adapter, pairs keyed by base tensor name.

    Raises:
        AdapterError: listing every problem found (``worker.lora.adapter_file`` rules).
    """
    return adapter_from_file(
        read_lora_adapter(path, base_arch=base_arch, base_tensors=base_tensors), device_for=device_for, dtype=dtype
    )


def adapter_from_file(
    af: AdapterFile,
    *,
    device_for: Callable[[str], torch.device] = lambda name: torch.device("cpu"),
    dtype: torch.dtype = torch.float32,
) -> LoraAdapter:
    """``LoraAdapter`` with ``af``'s A/B as ``dtype`` tensors on ``device_for(base name)``."""
    pairs: dict[str, LoraPair] = {}
    size = 0
    for base, (a_np, b_np) in af.pairs.items():
        dev = torch.device(device_for(base))
        a = torch.from_numpy(a_np).to(dtype=dtype, device=dev)
        b = torch.from_numpy(b_np).to(dtype=dtype, device=dev)
        pairs[base] = LoraPair(base, a, b)
        size += a.numel() * a.element_size() + b.numel() * b.element_size()
    return LoraAdapter(
        path=af.path,
        sha256=af.sha256,
        arch=af.arch,
        name=af.name,
        alpha=af.alpha,
        pairs=types.MappingProxyType(pairs),
        alora_invocation_tokens=af.alora_invocation_tokens,
        task_name=af.task_name,
        prompt_prefix=af.prompt_prefix,
        size_bytes=size,
    )


__all__ = [
    "MAX_RANK",
    "NODES_PER_LORA_WEIGHT",
    "TOKEN_EMBD",
    "AdapterError",
    "AdapterFile",
    "LoraAdapter",
    "LoraPair",
    "adapter_from_file",
    "base_tensor_index",
    "load_lora_adapter",
    "lora_scale",
    "read_adapter_gguf",
    "validate_lora_adapter",
]
