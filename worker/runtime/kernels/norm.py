"""RMS norm rows in one C call (``csrc/norm.cpp``): the sum of squares in double in a fixed
order per row, so a row's result does not depend on the other rows of the ubatch.

Same rule as llama.cpp ``ggml_compute_forward_rms_norm_f32`` (squares summed in
``ggml_float`` = double, scaled by ``1/sqrt(mean + eps)``) followed by the weight multiply of
``LLM_NORM_RMS``: ``y = (x · s) · w`` in f32 with ``s = (float)(1/sqrt(Σx²/d + eps))``.
"""

from __future__ import annotations

from typing import Any

import torch

from worker.runtime.kernels import cpu, library
from worker.runtime.kernels.linear import KernelError

MIN_PARALLEL = 1 << 18
"""Elements (rows × d) from which rows are split over threads: below it a wake-up of the
second thread costs more than the norm (a decode step's 16 × 640 is one thread)."""

_FN: dict[str, Any] = {}


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, path: str | None = None) -> torch.Tensor:
    """``(x · s) · weight`` per row over the last dim: x f32 CPU ``(..., d)``, weight f32 ``(d,)``
    (or None), returns f32 of x's shape.

    Args:
        path: ISA path ('amx' | 'avx512' | 'avx2'; default
            :func:`~worker.runtime.kernels.cpu.resolve_path`).
    Raises:
        KernelError: x not f32 on CPU, or a weight of another width or dtype.
        KernelPathError: the 'torch' path (no C kernel) or one this CPU cannot run.
    """
    p = cpu.resolve_path(path)
    if p == "torch":
        raise cpu.KernelPathError("rms_norm is a C kernel; the torch path is GraphContext.build_norm's")
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise KernelError(f"rms_norm: x must be f32 on CPU, got {x.dtype} on {x.device}")
    d = x.shape[-1]
    if weight is not None and (weight.shape != (d,) or weight.dtype != torch.float32 or not weight.is_contiguous()):
        raise KernelError(f"rms_norm: weight must be contiguous f32 ({d},), got {tuple(weight.shape)} {weight.dtype}")
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = x2.shape[0]
    y = torch.empty((n, d), dtype=torch.float32)
    fn = _FN.get(p)
    if fn is None:
        fn = _FN[p] = getattr(library.load(p), f"lp_{p}_rms_norm")
    fn(
        x2.data_ptr(),
        x2.stride(0) if n > 1 else d,
        None if weight is None else weight.data_ptr(),
        n,
        d,
        float(eps),
        y.data_ptr(),
        d,
        MIN_PARALLEL,
        torch.get_num_threads(),
    )
    return y.reshape(x.shape)


__all__ = ["MIN_PARALLEL", "rms_norm"]
