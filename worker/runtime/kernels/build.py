"""Build and load the C kernels (``csrc/qmm.cpp``, ``csrc/qmm16.cpp``, ``csrc/lora.cpp``) for each x86 ISA path.

One source, two shared libraries, each compiled with its own target flags (never
``-march=native``), so the AVX2 library runs on an AVX2-only CPU:

- ``avx2``:   ``-mavx2 -mfma -mf16c``
- ``avx512``: ``-mavx512f -mavx512bw -mavx512vl -mavx512vnni`` (+ the AVX2 flags)

Built with plain ``g++`` (no torch headers, about 1 s each) into ``_build/`` beside this file,
named by a hash of the source and flags so a stale library is never loaded. ``scripts/install.sh``
runs ``python -m worker.runtime.kernels.build``, which fails loudly (non-zero exit) when the
compiler is missing or the build breaks; at run time a missing library is built on first use
(under a file lock), and a failed build raises :class:`KernelBuildError` — there is no silent
fallback. ``LORAPLANE_KERNELS=torch`` selects the documented torch path explicitly instead.

OpenMP: the libraries are linked ``-fopenmp`` against ``libgomp.so.1``; torch's CPU wheel loads
its own ``libgomp.so.1`` first (``import torch`` happens before we load), and the dynamic loader
reuses a loaded soname, so our parallel regions share torch's OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before ours; see module docstring)

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC_DIR / "qmm.cpp", CSRC_DIR / "qmm16.cpp", CSRC_DIR / "lora.cpp"]
HEADERS = [CSRC_DIR / "qmm_common.h", CSRC_DIR / "parallel.h"]  # included by both sources: part of the build key
BUILD_DIR = Path(os.environ.get("LORAPLANE_KERNEL_BUILD_DIR", Path(__file__).resolve().parent / "_build"))

COMMON_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-fopenmp", "-fno-math-errno"]
ISA_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-DLP_AVX512", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
}


_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_QUANT = [_P, _I64, _I32, _I32, _P, _P, _P, _P, _I32]
_QMM = [_P, _P, _P, _F32, _I32, _I32, _I32, _I32, _P, _P, _P, _P, _I32, _P, _I32]
_QMM_F32 = [_P, _I64, _I32, _I32, _P, _P, _P, _F32, _I32, _I32, _I32, _P, _I32]
_BGMV = [_P, _I64, _I32, _I32, _P, _P, _I32, _I32, _P, _P, _P, _P, _P, _P, _I64, _I32]

# Every exported function (``lp_<isa>_<name>``) with its ctypes (argtypes, restype); each
# source's functions are listed together.
SIGNATURES: dict[str, tuple[list, object]] = {
    # qmm.cpp (int8 activations)
    "quantize_act": (_QUANT, None),
    "qmm": (_QMM, _I32),
    "qmm_f32": (_QMM_F32, _I32),
    # qmm16.cpp (int16 activations)
    "quantize_act16": (_QUANT, None),
    "qmm16": (_QMM, _I32),
    "qmm16_f32": (_QMM_F32, _I32),
    # lora.cpp (gathered multi-LoRA, f32)
    "lora_bgmv": (_BGMV, _I32),
}


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded (message holds the compiler's output)."""


_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise KernelBuildError(
            "no C++ compiler found (need g++ >= 9 on PATH, or set CXX); "
            "or set LORAPLANE_KERNELS=torch to use the torch fallback"
        )
    return cxx


def library_path(isa: str) -> Path:
    """Where the library for ``isa`` ('avx2' | 'avx512') lives, keyed by source+flags hash."""
    h = hashlib.sha256(
        b"".join(s.read_bytes() for s in SOURCES + HEADERS) + " ".join(COMMON_FLAGS + ISA_FLAGS[isa]).encode()
    ).hexdigest()[:12]
    return BUILD_DIR / f"liblp_{isa}-{h}.so"


def build(isa: str) -> Path:
    """Compile the library for ``isa`` if it is not there yet; returns its path.

    Raises:
        KernelBuildError: unknown ISA, no compiler, or the compiler failed (its stderr included).
    """
    if isa not in ISA_FLAGS:
        raise KernelBuildError(f"unknown kernel ISA '{isa}' (expected one of {', '.join(ISA_FLAGS)})")
    out = library_path(isa)
    if out.exists():
        return out
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    with open(BUILD_DIR / ".lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)  # concurrent test workers / processes build once
        if out.exists():
            return out
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        cmd = [_compiler(), *COMMON_FLAGS, *ISA_FLAGS[isa], *map(str, SOURCES), "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise KernelBuildError(f"building {isa} kernels failed: {' '.join(cmd)}\n{proc.stderr}")
        os.replace(tmp, out)
    return out


def load(isa: str) -> ctypes.CDLL:
    """The loaded library for ``isa`` (built first if needed), with argtypes set.

    Raises:
        KernelBuildError: as :func:`build`, or the library fails to load.
    """
    with _lock:
        lib = _libs.get(isa)
        if lib is not None:
            return lib
        path = build(isa)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise KernelBuildError(f"loading {path} failed: {exc}") from exc
        for fn, (argtypes, restype) in SIGNATURES.items():
            f = getattr(lib, f"lp_{isa}_{fn}")
            f.argtypes, f.restype = argtypes, restype
        _libs[isa] = lib
        return lib


def main(argv: list[str] | None = None) -> int:
    """Build every ISA's library (what install.sh runs); exit status 1 on any failure."""
    try:
        for isa in ISA_FLAGS:
            print(f"kernels: {isa} -> {build(isa)}")
    except KernelBuildError as exc:
        print(f"kernels: BUILD FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
