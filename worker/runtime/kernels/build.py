"""Build and load the C kernels (``csrc/qmm.cpp``, ``csrc/qmm16.cpp``, ``csrc/qmm_amx.cpp``, ``csrc/qmm16_amx.cpp``,
``csrc/threadpool.cpp``,
``csrc/sample.cpp``, ``csrc/attn.cpp``, ``csrc/lora.cpp``, ``csrc/norm.cpp``)
for each x86 ISA path.

Three shared libraries, each compiled with its own target flags (never ``-march=native``), so
the AVX2 library runs on an AVX2-only CPU:

- ``avx2``:   ``qmm.cpp qmm16.cpp`` with ``-mavx2 -mfma -mf16c``
- ``avx512``: ``qmm.cpp qmm16.cpp`` with ``-mavx512f -mavx512bw -mavx512vl -mavx512vnni`` (+ the AVX2 flags)
- ``amx``:    ``qmm_amx.cpp qmm16_amx.cpp`` with the avx512 flags + ``-mamx-tile -mamx-int8``: the
  int8- and int16-activation matmuls on AMX tiles (bit-identical to the avx512 library's)

Built with plain ``g++`` (no torch headers, about 1 s each) into ``_build/`` beside this file,
named by a hash of the source and flags so a stale library is never loaded. ``scripts/install.sh``
runs ``python -m worker.runtime.kernels.build``, which fails loudly (non-zero exit) when the
compiler is missing or the build breaks; at run time a missing library is built on first use
(under a file lock), and a failed build raises :class:`KernelBuildError` — there is no silent
fallback. ``LORAPLANE_KERNELS=torch`` selects the documented torch path explicitly instead.

Threads: ``lp::parallel_for`` runs on our own pool (``csrc/threadpool.cpp``) by default, or on
OpenMP with ``LORAPLANE_KERNEL_THREADS=omp`` (:func:`threads_config`). For the latter the
libraries are linked ``-fopenmp`` against ``libgomp.so.1``; torch's CPU wheel loads its own
``libgomp.so.1`` first (``import torch`` happens before we load), and the dynamic loader reuses a
loaded soname, so those parallel regions share torch's OpenMP thread pool.
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
SOURCES = [
    CSRC_DIR / "qmm.cpp",
    CSRC_DIR / "qmm16.cpp",
    CSRC_DIR / "qmm_amx.cpp",
    CSRC_DIR / "qmm16_amx.cpp",
    CSRC_DIR / "threadpool.cpp",
    CSRC_DIR / "sample.cpp",
    CSRC_DIR / "attn.cpp",
    CSRC_DIR / "lora.cpp",
    CSRC_DIR / "norm.cpp",
]
HEADERS = [
    CSRC_DIR / "export.h",
    CSRC_DIR / "qmm_common.h",
    CSRC_DIR / "parallel.h",
    CSRC_DIR / "qmm8.h",
    CSRC_DIR / "qmm16.h",
]  # included: part of the build key
# Which sources each ISA's library is compiled from (every one exports the SIGNATURES below).
_COMMON = [
    CSRC_DIR / "threadpool.cpp",
    CSRC_DIR / "sample.cpp",
    CSRC_DIR / "attn.cpp",
    CSRC_DIR / "lora.cpp",
    CSRC_DIR / "norm.cpp",
]
ISA_SOURCES = {
    "avx2": [CSRC_DIR / "qmm.cpp", CSRC_DIR / "qmm16.cpp", *_COMMON],
    "avx512": [CSRC_DIR / "qmm.cpp", CSRC_DIR / "qmm16.cpp", *_COMMON],
    "amx": [CSRC_DIR / "qmm_amx.cpp", CSRC_DIR / "qmm16_amx.cpp", *_COMMON],
}
BUILD_DIR = Path(os.environ.get("LORAPLANE_KERNEL_BUILD_DIR", Path(__file__).resolve().parent / "_build"))

COMMON_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-fopenmp", "-fno-math-errno"]
ISA_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-DLP_AVX512", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
}
ISA_FLAGS["amx"] = ["-DLP_AMX", *ISA_FLAGS["avx512"], "-mamx-tile", "-mamx-int8"]


_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_QUANT = [_P, _I64, _I32, _I32, _P, _P, _P, _P, _I32]
_QMM = [_P, _P, _P, _F32, _I32, _I32, _I32, _I32, _P, _P, _P, _P, _I32, _P, _I32]
_QMM_F32 = [_P, _I64, _I32, _I32, _P, _P, _P, _F32, _I32, _I32, _I32, _P, _I32]
_ATTN = [_P, _I64, _P, _P, _I32, *[_I64] * 6, _P, _P, *[_I32] * 5, _F32, _F32, _I32, _I32, _I64, _P, _I32]
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
    # norm.cpp (RMS norm rows, sum of squares in double in a fixed order)
    "rms_norm": ([_P, _I64, _P, _I32, _I32, _F32, _P, _I64, _I64, _I32], None),
    # lora.cpp (gathered multi-LoRA, f32)
    "lora_bgmv": (_BGMV, _I32),
    # attn.cpp (decode attention over the KV cache)
    "attn_decode": (_ATTN, _I32),
    # sample.cpp (fused max / log-sum-exp / top-k of logits rows)
    "logits_summary": ([_P, _I64, _P, _I32, _I32, _I32, _P, _P, _P, _P, _I32], _I32),
    # threadpool.cpp (the threading backend of lp::parallel_for)
    "threads_config": ([_I32, _I32, _I32], None),
    "pool_size": ([], _I32),
}
# Functions only one ISA's library exports.
ISA_SIGNATURES: dict[str, dict[str, tuple[list, object]]] = {
    # qmm_amx.cpp: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) -> 0 or errno
    "amx": {"request_tile_perm": ([], _I32)},
}


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded (message holds the compiler's output)."""


THREAD_BACKENDS = {"pool": 0, "omp": 1}  # lp::parallel_for backends (csrc/parallel.h)
DEFAULT_THREADS = "pool"
DEFAULT_SPIN_US = 0  # measured: spinning loses in serving, where the worker shares the cores (README "Threads")
DEFAULT_SPIN_BACKOFF_MS = 100

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}
_threads: tuple[str, int, int] | None = None  # set_threads() override of the environment


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        v = int(raw) if raw else default
    except ValueError:
        v = -1
    if v < 0:
        raise KernelBuildError(f"{name}={raw!r}: expected an integer >= 0")
    return v


def threads_config() -> tuple[str, int, int]:
    """The kernels' threading setting: ``(backend, spin_us, backoff_ms)``.

    - ``backend``: ``LORAPLANE_KERNEL_THREADS`` — 'pool' (default: our thread pool,
      ``csrc/threadpool.cpp``) or 'omp' (OpenMP in torch's libgomp, where ``OMP_WAIT_POLICY``
      applies).
    - ``spin_us``: ``LORAPLANE_KERNEL_SPIN_US`` (default 0) — microseconds a pool thread polls
      for work, and the caller for completion, before it sleeps on a futex; 0 sleeps at once.
    - ``backoff_ms``: ``LORAPLANE_KERNEL_SPIN_BACKOFF_MS`` (default 100) — when a spinning
      thread finds it was descheduled (another process wants the core), the pool stops spinning
      for this many milliseconds; 0 never stops.

    Measured in worker/runtime/kernels/README.md ("Threads"). :func:`set_threads` overrides
    the environment.

    Raises:
        KernelBuildError: an unknown backend, or a number that is not an integer >= 0.
    """
    if _threads is not None:
        return _threads
    backend = os.environ.get("LORAPLANE_KERNEL_THREADS", "").strip().lower() or DEFAULT_THREADS
    if backend not in THREAD_BACKENDS:
        raise KernelBuildError(f"LORAPLANE_KERNEL_THREADS={backend!r}: expected one of {', '.join(THREAD_BACKENDS)}")
    return (
        backend,
        _env_int("LORAPLANE_KERNEL_SPIN_US", DEFAULT_SPIN_US),
        _env_int("LORAPLANE_KERNEL_SPIN_BACKOFF_MS", DEFAULT_SPIN_BACKOFF_MS),
    )


def _apply(isa: str, lib: ctypes.CDLL, cfg: tuple[str, int, int]) -> None:
    getattr(lib, f"lp_{isa}_threads_config")(THREAD_BACKENDS[cfg[0]], cfg[1], cfg[2])


def set_threads(
    backend: str | None = None, spin_us: int | None = None, backoff_ms: int | None = None
) -> tuple[str, int, int]:
    """Switch every loaded (and later loaded) library's threading backend, spin budget and/or
    spin back-off (see :func:`threads_config`; ``None`` keeps the current value); returns the
    new setting.

    Raises:
        KernelBuildError: unknown backend, or a negative number.
    """
    global _threads
    with _lock:
        cur = threads_config()
        new = (
            cur[0] if backend is None else backend,
            cur[1] if spin_us is None else int(spin_us),
            cur[2] if backoff_ms is None else int(backoff_ms),
        )
        if new[0] not in THREAD_BACKENDS or new[1] < 0 or new[2] < 0:
            raise KernelBuildError(f"set_threads{new}: backend pool|omp, spin_us and backoff_ms >= 0")
        _threads = new
        for isa, lib in _libs.items():
            _apply(isa, lib, new)
        return new


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise KernelBuildError(
            "no C++ compiler found (need g++ >= 9 on PATH, or set CXX); "
            "or set LORAPLANE_KERNELS=torch to use the torch fallback"
        )
    return cxx


def library_path(isa: str) -> Path:
    """Where the library for ``isa`` ('avx2' | 'avx512' | 'amx') lives, keyed by source+flags hash."""
    h = hashlib.sha256(
        b"".join(s.read_bytes() for s in ISA_SOURCES[isa] + HEADERS) + " ".join(COMMON_FLAGS + ISA_FLAGS[isa]).encode()
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
        cmd = [_compiler(), *COMMON_FLAGS, *ISA_FLAGS[isa], *map(str, ISA_SOURCES[isa]), "-o", str(tmp)]
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
        for fn, (argtypes, restype) in {**SIGNATURES, **ISA_SIGNATURES.get(isa, {})}.items():
            f = getattr(lib, f"lp_{isa}_{fn}")
            f.argtypes, f.restype = argtypes, restype
        _apply(isa, lib, threads_config())
        _libs[isa] = lib
        return lib


def main(argv: list[str] | None = None) -> int:
    """Build every ISA's library (what install.sh runs); exit status 1 on any failure of the
    avx2/avx512 builds. The optional ``amx`` library (needs g++ >= 11 for ``-mamx-int8``) only
    warns when it fails: ``cpu.py`` then reports the amx path unavailable and ``auto`` takes
    avx512."""
    try:
        for isa in ISA_FLAGS:
            try:
                print(f"kernels: {isa} -> {build(isa)}")
            except KernelBuildError as exc:
                if isa != "amx":
                    raise
                print(f"kernels: amx build failed, the amx path will be unavailable: {exc}", file=sys.stderr)
    except KernelBuildError as exc:
        print(f"kernels: BUILD FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
