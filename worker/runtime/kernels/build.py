"""The one build description of the C kernels (``csrc/``), and the compiler step it names.

Every ISA's library is compiled from the same sources (:data:`SOURCES`) with its own target
flags (:data:`ISA_FLAGS`, never ``-march=native``), so the AVX2 library runs on an AVX2-only CPU;
the headers pick each ISA's instructions (``csrc/simd.h``; the AMX tiles in ``csrc/qmm*_amx.h``):

- ``avx2``:   ``-mavx2 -mfma -mf16c``
- ``avx512``: ``-mavx512f -mavx512bw -mavx512vl -mavx512vnni`` (+ the AVX2 flags)
- ``amx``:    the avx512 flags + ``-mamx-tile -mamx-int8``: the int8/int16 tiles (bit-identical to
  avx512's) and the bf16 tiles (``csrc/qmmbf16.cpp`` names AMX-BF16, AVX512-BF16, VBMI itself).
  Optional: without ``-mamx-int8`` (g++ < 11) it is left out and the amx path is unavailable.

The libraries are built by the build system, never at run time: ``setup.py``'s ``build_ext``
reads this file (by path: stdlib only, no torch) and calls :func:`compile_library` per ISA into
the wheel, or into ``_build/`` beside this file for an editable install
(``pip install -e .``, which ``scripts/install.sh`` runs) and for
``python setup.py build_ext --inplace``. ``python -m worker.runtime.kernels.build`` rebuilds in
place too. Each library is named by a hash of its sources, headers and flags
(:func:`library_name`), so ``worker.runtime.kernels.library`` loads only a library built from
the sources beside it, and says what to run when there is none.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent
CSRC_DIR = KERNELS_DIR / "csrc"
LIB_DIR = KERNELS_DIR / "_build"  # where an in-place build puts the libraries, and the loader looks
# Compiled into every ISA's library (each exports what csrc/api.h declares).
SOURCES = [
    "qmm.cpp",
    "qmm16.cpp",
    "qmmbf16.cpp",
    "threadpool.cpp",
    "sample.cpp",
    "attn.cpp",
    "lora.cpp",
    "norm.cpp",
    "layer.cpp",
]
API_HEADER = "api.h"  # the exported signatures, read by library.py to bind them

COMMON_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-fopenmp", "-fno-math-errno"]
ISA_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-DLP_AVX512", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
}
ISA_FLAGS["amx"] = ["-DLP_AMX", *ISA_FLAGS["avx512"], "-mamx-tile", "-mamx-int8"]
OPTIONAL_ISAS = frozenset({"amx"})  # a failed build warns and leaves the library out
REBUILD_HINT = (
    "run `pip install -e .` (or scripts/install.sh) in the checkout, or "
    "`python setup.py build_ext --inplace` after editing csrc/; an installed wheel ships them prebuilt"
)


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled, or their library is missing, stale or unloadable
    (the message says which, and what to run)."""


def headers() -> list[Path]:
    """Every header in ``csrc/`` (all are part of each library's build key)."""
    return sorted(CSRC_DIR.glob("*.h"))


def library_name(isa: str) -> str:
    """``liblp_<isa>-<hash>.so``: the hash covers the sources, the headers and the flags, so a
    library built from other sources is never taken for this one.

    Raises:
        KernelBuildError: unknown ISA.
    """
    if isa not in ISA_FLAGS:
        raise KernelBuildError(f"unknown kernel ISA '{isa}' (expected one of {', '.join(ISA_FLAGS)})")
    h = hashlib.sha256()
    for path in [*(CSRC_DIR / s for s in SOURCES), *headers()]:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(" ".join(COMMON_FLAGS + ISA_FLAGS[isa]).encode())
    return f"liblp_{isa}-{h.hexdigest()[:12]}.so"


def compiler() -> str:
    """``$CXX``, else ``g++`` or ``c++`` on PATH.

    Raises:
        KernelBuildError: none found.
    """
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise KernelBuildError("no C++ compiler found to build the kernels (need g++ >= 9 on PATH, or set CXX)")
    return cxx


def compile_library(isa: str, out: Path) -> Path:
    """Compile ``isa``'s library from :data:`SOURCES` to the file ``out`` (written whole, then
    renamed into place, so a reader never loads a partial file).

    Raises:
        KernelBuildError: unknown ISA, no compiler, or the compiler failed (its stderr included).
    """
    if isa not in ISA_FLAGS:
        raise KernelBuildError(f"unknown kernel ISA '{isa}' (expected one of {', '.join(ISA_FLAGS)})")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    cmd = [compiler(), *COMMON_FLAGS, *ISA_FLAGS[isa], *(str(CSRC_DIR / s) for s in SOURCES), "-o", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise KernelBuildError(f"building the {isa} kernels failed: {' '.join(cmd)}\n{proc.stderr}")
    os.replace(tmp, out)
    return out


def build_in_place(log: Callable[[str], None] = print) -> list[Path]:
    """Build every ISA's library whose current one is missing from :data:`LIB_DIR` (the
    editable-install layout), and remove that ISA's older libraries; returns the paths present.
    An optional ISA that fails to build is logged and left out. Concurrent callers (test
    sessions) build once: the work is done under a lock in :data:`LIB_DIR`.

    Raises:
        KernelBuildError: a required ISA failed to build.
    """
    LIB_DIR.mkdir(parents=True, exist_ok=True)
    with open(LIB_DIR / ".lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        return _build_in_place(log)


def _build_in_place(log: Callable[[str], None]) -> list[Path]:
    done = []
    for isa in ISA_FLAGS:
        out = LIB_DIR / library_name(isa)
        if not out.exists():
            try:
                compile_library(isa, out)
            except KernelBuildError as exc:
                if isa not in OPTIONAL_ISAS:
                    raise
                log(f"kernels: the {isa} build failed, its path will be unavailable: {exc}")
                continue
        for old in LIB_DIR.glob(f"liblp_{isa}-*.so"):
            if old != out:
                old.unlink()
        log(f"kernels: {isa} -> {out}")
        done.append(out)
    return done


def main(argv: list[str] | None = None) -> int:
    """``python -m worker.runtime.kernels.build``: rebuild the libraries in place (developer
    command); exit status 1 when a required ISA fails."""
    try:
        build_in_place(log=lambda line: print(line, file=sys.stderr))
    except KernelBuildError as exc:
        print(f"kernels: BUILD FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
