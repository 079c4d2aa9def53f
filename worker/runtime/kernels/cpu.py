"""CPU capability detection and the choice of kernel path.

Paths:

- ``amx``: the ``avx512`` path with the int8-activation matmul on AMX tiles (``csrc/qmm8_amx.h``,
  ``tdpbsud``/``tdpbssd``) and the int16 one on tiles by a byte split (``csrc/qmm16_amx.h``),
  results bit-identical to the avx512 kernels. Needs the avx512 flags + ``amx_tile amx_int8``
  AND the Linux kernel's permission for the tile state, asked once per process with
  ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`` (Linux >= 5.16); if refused,
  ``auto`` logs why and takes ``avx512``.
- ``avx512``: needs ``avx512f avx512bw avx512vl avx512_vnni`` (int8 dot products with
  ``vpdpbusd``, 16 weight rows per instruction).
- ``avx2``: needs ``avx2 fma f16c`` (``vpmaddubsw`` + ``vpmaddwd``); runs on any x86-64 CPU of
  the last decade, including AVX-512 ones (tests force it there).
- ``torch``: no C kernels; the weight is dequantized once to f32 (CPU) or bf16 (CUDA) and
  multiplied with torch. Used on CUDA, on CPUs without AVX2, or when asked for.

``LORAPLANE_KERNELS`` = ``auto`` (default) | ``amx`` | ``avx512`` | ``avx2`` | ``torch`` forces a
path for the process; ``QuantLinear.matmul(..., path=...)`` forces one for a call.
"""

from __future__ import annotations

import os
import platform
from functools import cache, lru_cache

import structlog

log = structlog.get_logger("loraplane.worker.runtime.kernels.cpu")

PATHS = ("amx", "avx512", "avx2", "torch")
NEEDS = {
    "amx": ("amx_tile", "amx_int8", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
}


# What the bf16 tiles (csrc/qmmbf16.cpp, in the amx library) need beyond the amx path's flags.
BF16_TILE_FLAGS = ("amx_bf16", "avx512_bf16", "avx512vbmi")


@lru_cache(maxsize=1)
def bf16_tiles_supported() -> bool:
    """Whether this CPU runs the 'bf16' activation precision: the amx path available
    (:func:`supported`) and the flags of :data:`BF16_TILE_FLAGS` (every AMX CPU so far has them).
    Cached: asked once per process (every matmul of a 'bf16' weight asks)."""
    return all(f in cpu_flags() for f in BF16_TILE_FLAGS) and supported("amx")


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


def _has_flags(path: str) -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return all(f in cpu_flags() for f in NEEDS[path])


@lru_cache(maxsize=1)
def amx_unavailable_reason() -> str | None:
    """None when the amx path can run here, else why not (missing flags, the kernel refused
    the tile state, or the amx library was not built).

    The first call on an AMX CPU asks Linux for the tile data state for the whole process:
    ``arch_prctl(ARCH_REQ_XCOMP_PERM=0x1023, XFEATURE_XTILEDATA=18)`` (Linux >= 5.16), through
    the amx library's ``lp_amx_request_tile_perm``; without that grant the first tile
    instruction raises SIGILL. Cached: asked once per process.
    """
    if not _has_flags("amx"):
        missing = [f for f in NEEDS["amx"] if f not in cpu_flags()]
        return f"CPU ({cpu_model()}) lacks {', '.join(missing) or 'x86-64'}"
    from worker.runtime.kernels import library  # the library is only needed on AMX CPUs
    from worker.runtime.kernels.build import KernelBuildError

    try:
        lib = library.load("amx")
    except KernelBuildError as exc:
        return f"the amx library is unavailable: {str(exc).splitlines()[0]}"
    err = lib.lp_amx_request_tile_perm()
    if err:
        return (
            f"Linux refused the AMX tile state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): "
            f"{os.strerror(err)}; needs Linux >= 5.16, kernel {platform.release()})"
        )
    return None


def supported(path: str) -> bool:
    """Whether this CPU can run ``path`` ('amx' | 'avx512' | 'avx2' | 'torch'); for 'amx' this
    also asks Linux for the tile state (see :func:`amx_unavailable_reason`)."""
    if path == "torch":
        return True
    if path == "amx":
        return amx_unavailable_reason() is None
    return _has_flags(path)


def best_path() -> str:
    """The fastest path this CPU supports: amx, else avx512, else avx2, else torch (with a
    warning). An AMX CPU whose tile state is refused logs the reason and takes avx512."""
    if _has_flags("amx"):
        reason = amx_unavailable_reason()
        if reason is None:
            return "amx"
        log.warning("kernels_amx_unavailable", reason=reason, fallback="avx512")
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
    if want == "amx" and not supported(want):
        raise KernelPathError(f"kernel path 'amx' is unavailable: {amx_unavailable_reason()}")
    if not supported(want):
        missing = [f for f in NEEDS[want] if f not in cpu_flags()]
        raise KernelPathError(
            f"kernel path '{want}' needs CPU flags {', '.join(missing)} that this CPU ({cpu_model()}) lacks"
        )
    return want


__all__ = [
    "PATHS",
    "KernelPathError",
    "amx_unavailable_reason",
    "cpu_flags",
    "cpu_model",
    "supported",
    "best_path",
    "resolve_path",
]
