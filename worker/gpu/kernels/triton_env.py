"""Where the Triton kernels may run, and their lazy import.

Triton is imported by the private kernel modules (``_lora_triton``, ``_attention_triton``), which
the public modules import at their first kernel call, never at import: a CPU-only machine
without Triton imports the worker unchanged. A kernel runs on CUDA tensors, or on CPU tensors
when Triton's interpreter is on (``TRITON_INTERPRET=1``; Triton reads it when a kernel module is
first imported, so it must be set before that).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch

_TRUE = ("1", "true", "on", "yes")


class KernelUnavailableError(RuntimeError):
    """A Triton kernel cannot run here: Triton is not installed, or the tensors are on the CPU
    without the interpreter (the message says which and what to do)."""


def triton_available() -> bool:
    """Whether the ``triton`` package is importable (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton's interpreter is requested (``TRITON_INTERPRET``, read as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def load(name: str) -> ModuleType:
    """Import the kernel module ``worker.gpu.kernels.<name>`` (which imports Triton).

    Raises:
        KernelUnavailableError: Triton is not installed.
    """
    if not triton_available():
        raise KernelUnavailableError(
            "the GPU kernels need Triton: it ships with the CUDA builds of torch, or install the 'cuda' extra"
        )
    return importlib.import_module(f"worker.gpu.kernels.{name}")


def check_device(what: str, *tensors: torch.Tensor) -> None:
    """Raise unless every tensor is on one device where a Triton kernel can run: one CUDA
    device, or the CPU under the interpreter.

    Raises:
        KernelUnavailableError: CPU tensors without ``TRITON_INTERPRET=1``.
        ValueError: tensors on different devices.
    """
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            raise ValueError(f"{what}: tensors on {dev} and {t.device}; all must be on one device")
    if dev.type == "cuda":
        return
    if dev.type == "cpu" and interpreting():
        return
    raise KernelUnavailableError(
        f"{what}: Triton kernels run on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1 "
        f"set before the first kernel call (got {dev.type} tensors)"
    )


def next_pow2(x: int) -> int:
    """Smallest power of two ≥ ``x`` (1 for ``x`` ≤ 1): Triton block shapes are powers of two."""
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def dot_in_f32(*dtypes: torch.dtype, device: torch.device) -> bool:
    """Whether a kernel's ``tl.dot`` should take f32 operands (IEEE, no TF32) rather than the
    tiles' own 16-bit dtype.

    f32 inputs: always (f32 is the fidelity path; TF32 would round operands to 10 mantissa
    bits). Mixed dtypes: both sides upcast (exact). On the CPU interpreter, also for 16-bit
    inputs: Triton 3.6's interpreter mis-reads bf16 ``tl.dot`` operands; a bf16 or f16 product
    is exact in f32, so the upcast computes what the GPU's 16-bit dot with f32 accumulation
    does, up to the order of the additions.
    """
    if len(set(dtypes)) > 1 or torch.float32 in dtypes:
        return True
    return device.type == "cpu"
