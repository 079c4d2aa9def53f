"""Load the prebuilt kernel library of an ISA and bind its exports from ``csrc/api.h``.

The libraries are built with the package (``build.py``: ``pip install``, ``pip wheel``,
``python setup.py build_ext --inplace``), never here: a library missing from ``_build/`` beside
this file, or built from other sources than those beside it (its name carries their hash),
raises :class:`KernelBuildError` saying what to run. ``LORAPLANE_KERNELS=torch`` selects the
documented torch path instead.

Signatures are declared once, in ``csrc/api.h``: every source includes it (the compiler rejects
a definition that differs) and :func:`exports` parses it into ctypes argtypes, so there is no
second list to keep in step.

Threads: ``lp::parallel_for`` runs on our own pool (``csrc/threadpool.cpp``) by default, or on
OpenMP with ``LORAPLANE_KERNEL_THREADS=omp`` (:func:`threads_config`). For the latter the
libraries are linked ``-fopenmp`` against ``libgomp.so.1``; torch's CPU wheel loads its own
``libgomp.so.1`` first (``import torch`` happens before we load), and the dynamic loader reuses a
loaded soname, so those parallel regions share torch's OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before ours; see module docstring)

from worker.runtime.kernels.build import (
    API_HEADER,
    CSRC_DIR,
    LIB_DIR,
    REBUILD_HINT,
    KernelBuildError,
    library_name,
)

# C parameter types of api.h -> ctypes; any pointer is c_void_p (the callers pass data_ptr() integers)
_ARGTYPES: dict[str, type] = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
_RESTYPES: dict[str, type | None] = {"void": None, "int": ctypes.c_int}  # what the exports return
_DECL = re.compile(r"LP_EXPORT\s+(\w+)\s+LP_FN\((\w+)\)\s*\(([^)]*)\)\s*;")
_PARAM = re.compile(r"(?:const\s+)?(\w+)\s*(\*?)\s*(\w+)")


@dataclass(frozen=True)
class Export:
    """One function of ``csrc/api.h``: ``restype name(params)``; ``params`` are (name, ctype)."""

    name: str
    restype: type | None
    params: tuple[tuple[str, type], ...]
    amx_only: bool


def parse_api(text: str) -> dict[str, Export]:
    """The declarations of an ``api.h`` text, by name (the form is stated at the top of the
    header).

    Raises:
        KernelBuildError: a declaration this parser does not read (unknown type, bad form).
    """
    text = re.sub(r"//[^\n]*", "", text)
    out: dict[str, Export] = {}
    for block, amx_only in _blocks(text):
        for m in _DECL.finditer(block):
            ret, name, raw = m.groups()
            params: list[tuple[str, type]] = []
            for p in [] if raw.strip() == "void" else raw.split(","):
                pm = _PARAM.fullmatch(" ".join(p.split()))
                if pm is None or not (pm[2] or pm[1] in _ARGTYPES):
                    raise KernelBuildError(f"{API_HEADER}: cannot read parameter {p.strip()!r} of {name}")
                params.append((pm[3], ctypes.c_void_p if pm[2] else _ARGTYPES[pm[1]]))
            if ret not in _RESTYPES:
                raise KernelBuildError(f"{API_HEADER}: cannot read return type {ret!r} of {name}")
            out[name] = Export(name, _RESTYPES[ret], tuple(params), amx_only)
    if not out:
        raise KernelBuildError(f"{API_HEADER}: no LP_EXPORT declarations found")
    return out


def _blocks(text: str) -> list[tuple[str, bool]]:
    """The header split into (text, amx_only) around its ``#if defined(LP_AMX)`` blocks."""
    parts = re.split(r"#if defined\(LP_AMX\)(.*?)#endif", text, flags=re.S)
    return [(part, i % 2 == 1) for i, part in enumerate(parts)]


@cache
def exports() -> dict[str, Export]:
    """:func:`parse_api` of the ``csrc/api.h`` beside this module (shipped with the libraries)."""
    return parse_api((CSRC_DIR / API_HEADER).read_text())


THREAD_BACKENDS = {"pool": 0, "omp": 1}  # lp::parallel_for backends (csrc/parallel.h)
DEFAULT_THREADS = "pool"
DEFAULT_SPIN_US = 0  # measured: spinning loses in serving, where the worker shares the cores (README "Threads")
DEFAULT_SPIN_BACKOFF_MS = 100
DEFAULT_BURST_US = 1000  # measured: a futex wake-up of a halted vCPU costs 50-150 us (README "Threads")

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}
_threads: tuple[str, int, int, int] | None = None  # set_threads() override of the environment


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        v = int(raw) if raw else default
    except ValueError:
        v = -1
    if v < 0:
        raise KernelBuildError(f"{name}={raw!r}: expected an integer >= 0")
    return v


def threads_config() -> tuple[str, int, int, int]:
    """The kernels' threading setting: ``(backend, spin_us, backoff_ms, burst_us)``.

    - ``backend``: ``LORAPLANE_KERNEL_THREADS`` — 'pool' (default: our thread pool,
      ``csrc/threadpool.cpp``) or 'omp' (OpenMP in torch's libgomp, where ``OMP_WAIT_POLICY``
      applies).
    - ``spin_us``: ``LORAPLANE_KERNEL_SPIN_US`` (default 0) — microseconds a pool thread polls
      for work, and the caller for completion, before it sleeps on a futex; 0 sleeps at once.
    - ``backoff_ms``: ``LORAPLANE_KERNEL_SPIN_BACKOFF_MS`` (default 100) — when a spinning
      thread finds it was descheduled (another process wants the core), the pool stops spinning
      for this many milliseconds; 0 never stops.
    - ``burst_us``: ``LORAPLANE_KERNEL_BURST_US`` (default 1000) — within one layer kernel call
      (a burst of dispatches microseconds apart) the pool's threads poll this long for the next
      dispatch, and the caller for completion, instead of ``spin_us``; they stop polling when
      the call returns. 0: the call's dispatches wait like any other.

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
        _env_int("LORAPLANE_KERNEL_BURST_US", DEFAULT_BURST_US),
    )


def _apply(isa: str, lib: ctypes.CDLL, cfg: tuple[str, int, int, int]) -> None:
    getattr(lib, f"lp_{isa}_threads_config")(THREAD_BACKENDS[cfg[0]], cfg[1], cfg[2], cfg[3])


def set_threads(
    backend: str | None = None, spin_us: int | None = None, backoff_ms: int | None = None, burst_us: int | None = None
) -> tuple[str, int, int, int]:
    """Switch every loaded (and later loaded) library's threading backend, spin budget, spin
    back-off and/or burst budget (see :func:`threads_config`; ``None`` keeps the current
    value); returns the new setting.

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
            cur[3] if burst_us is None else int(burst_us),
        )
        if new[0] not in THREAD_BACKENDS or min(new[1:]) < 0:
            raise KernelBuildError(f"set_threads{new}: backend pool|omp, spin_us, backoff_ms and burst_us >= 0")
        _threads = new
        for isa, lib in _libs.items():
            _apply(isa, lib, new)
        return new


def library_path(isa: str) -> Path:
    """The prebuilt library of ``isa`` ('avx2' | 'avx512' | 'amx') for the sources beside this
    module.

    Raises:
        KernelBuildError: unknown ISA, or no such file (stale or missing: the message lists what
            is there and what to run).
    """
    path = LIB_DIR / library_name(isa)
    if not path.is_file():
        found = sorted(p.name for p in LIB_DIR.glob(f"liblp_{isa}-*.so")) if LIB_DIR.is_dir() else []
        state = f"only {', '.join(found)} (built from other sources)" if found else "none"
        raise KernelBuildError(
            f"the {isa} kernel library {path.name} is not built (in {LIB_DIR}: {state}); {REBUILD_HINT}"
        )
    return path


def load(isa: str) -> ctypes.CDLL:
    """The loaded library of ``isa``, its exports bound with the argtypes of ``csrc/api.h``.

    Raises:
        KernelBuildError: as :func:`library_path`, the library fails to load, or it lacks a
            declared export.
    """
    with _lock:
        lib = _libs.get(isa)
        if lib is not None:
            return lib
        path = library_path(isa)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise KernelBuildError(f"loading {path} failed: {exc}; {REBUILD_HINT}") from exc
        for e in exports().values():
            if e.amx_only and isa != "amx":
                continue
            try:
                f = getattr(lib, f"lp_{isa}_{e.name}")
            except AttributeError as exc:
                raise KernelBuildError(f"{path} lacks lp_{isa}_{e.name}, declared in {API_HEADER}") from exc
            f.argtypes, f.restype = [t for _, t in e.params], e.restype
        _apply(isa, lib, threads_config())
        _libs[isa] = lib
        return lib
