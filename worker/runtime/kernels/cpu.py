"""CPU capability detection and the choice of kernel path.

Paths:

- ``avx512``: needs ``avx512f avx512bw avx512vl avx512_vnni`` (int8 dot products with
  ``vpdpbusd``, 16 weight rows per instruction). AMX is never assumed.
- ``avx2``: needs ``avx2 fma f16c`` (``vpmaddubsw`` + ``vpmaddwd``); runs on any x86-64 CPU of
  the last decade, including AVX-512 ones (tests force it there).
- ``torch``: no C kernels; the weight is dequantized once to f32 (CPU) or bf16 (CUDA) and
  multiplied with torch. Used on CUDA, on CPUs without AVX2, or when asked for.

``LORAPLANE_KERNELS`` = ``auto`` (default) | ``avx512`` | ``avx2`` | ``torch`` forces a path
for the process; ``QuantLinear.matmul(..., path=...)`` forces one for a call.
"""

from __future__ import annotations

import os
import platform
from functools import cache, lru_cache

import structlog

log = structlog.get_logger("loraplane.worker.runtime.kernels.cpu")

PATHS = ("avx512", "avx2", "torch")
NEEDS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
}


class KernelPathError(RuntimeError):
    """A kernel path was asked for that this CPU (or configuration) cannot run."""


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags the kernel reports (``/proc/cpuinfo``; empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def supported(path: str) -> bool:
    """Whether this CPU can run ``path`` ('avx512' | 'avx2' | 'torch')."""
    if path == "torch":
        return True
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return all(f in cpu_flags() for f in NEEDS[path])


def best_path() -> str:
    """The fastest path this CPU supports: avx512, else avx2, else torch (with a warning)."""
    for p in ("avx512", "avx2"):
        if supported(p):
            return p
    log.warning(
        "kernels_torch_fallback",
        reason="CPU lacks AVX2/FMA/F16C: quantized matmuls use the torch fallback (weights dequantized to f32)",
    )
    return "torch"


def resolve_path(path: str | None = None) -> str:
    """The path to use: ``path`` if given, else ``$LORAPLANE_KERNELS``, else :func:`best_path`.

    Raises:
        KernelPathError: unknown name, or a C path this CPU cannot run.
    """
    return _resolve(path or os.environ.get("LORAPLANE_KERNELS", "auto"))


@cache
def _resolve(want: str) -> str:
    if want == "auto":
        return best_path()
    if want not in PATHS:
        raise KernelPathError(f"unknown kernel path '{want}' (expected auto, {', '.join(PATHS)})")
    if not supported(want):
        missing = [f for f in NEEDS[want] if f not in cpu_flags()]
        raise KernelPathError(
            f"kernel path '{want}' needs CPU flags {', '.join(missing)} that this CPU ({cpu_model()}) lacks"
        )
    return want


__all__ = ["PATHS", "KernelPathError", "cpu_flags", "cpu_model", "supported", "best_path", "resolve_path"]
