"""Quantized matmul kernels for GGUF linear weights (CPU: AVX2 / AVX-512 VNNI / AMX; CUDA: torch).

Public API (shapes in torch order; a GGUF weight with ggml ``ne = [k, d]`` is ``(d, k)``):

- :func:`pack_tensor` ``(rec) -> QuantLinear``;
  :func:`pack_experts` ``(rec 3-D) -> [QuantLinear] * E``
- :class:`QuantLinear`: ``.matmul(x (n, k)) -> (n, d) f32``, ``.get_rows(ids (m,)) -> (m, k) f32``,
  ``.dequantize() -> (d, k) f32``, ``.nbytes``; ``.act`` its activation precision ('i16' | 'i8' |
  'bf16', set per weight at model load; :func:`resolve_act` with ``LORAPLANE_KERNEL_ACT`` overrides)
- :func:`quantize_activations` ``(x (n, k)) -> QuantizedActivations`` to share one
  quantization between matmuls with the same input
- :func:`resolve_path`, :func:`cpu_flags`: which ISA path runs (``LORAPLANE_KERNELS``)
"""

from worker.runtime.kernels.build import KernelBuildError
from worker.runtime.kernels.cpu import (
    KernelPathError,
    best_path,
    cpu_flags,
    cpu_model,
    resolve_path,
    supported,
)
from worker.runtime.kernels.linear import (
    ACTS,
    KernelError,
    QuantizedActivations,
    QuantLinear,
    pack_experts,
    pack_tensor,
    quantize_activations,
    resolve_act,
)

__all__ = [
    "ACTS",
    "KernelBuildError",
    "KernelError",
    "KernelPathError",
    "QuantLinear",
    "QuantizedActivations",
    "best_path",
    "cpu_flags",
    "cpu_model",
    "pack_experts",
    "pack_tensor",
    "quantize_activations",
    "resolve_act",
    "resolve_path",
    "supported",
]
