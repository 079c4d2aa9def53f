"""What the GPU engine's tests (``tests/gpu/``) run on: CUDA when the machine has it, else CPU
tensors under Triton's interpreter.

Without CUDA, importing this module sets ``TRITON_INTERPRET=1`` (unless the environment already
sets it) before ``worker.gpu.kernels`` imports Triton (they do at the first kernel call);
``tests/gpu/conftest.py`` imports it, so that happens before any test module of that folder is
imported.
"""

from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.gpu.kernels import triton_env  # noqa: E402 - after TRITON_INTERPRET is set

TRITON = triton_env.triton_available()
NO_TRITON = "triton is not installed (the 'test' extra pins it; CUDA builds of torch ship it)"

GPU_DTYPES = ("f32", "bf16", "f16")
"""Compute dtypes the device is tested in: f32 against the CPU's bounds, the 16-bit ones against
looser bounds (each module states them)."""


def is_16bit(dtype: str) -> bool:
    """True for the 16-bit compute dtypes (``"bf16"``, ``"f16"``) of ``GPU_DTYPES``."""
    return dtype in ("bf16", "f16")
