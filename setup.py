"""Builds the C kernels with the package (everything else is in pyproject.toml).

One ``Extension`` per ISA library; ``BuildKernels`` compiles each with the flags and sources of
``worker/runtime/kernels/build.py`` (the one build description, loaded by path: it needs only
the standard library, so the build needs nothing but setuptools and g++). ``pip wheel`` puts the
libraries into the wheel; ``pip install -e .`` and ``python setup.py build_ext --inplace`` put
them into ``worker/runtime/kernels/_build/`` of the checkout. The ``amx`` library is optional: a
compiler without AMX support leaves it out with a warning.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("kernel_build", ROOT / "worker/runtime/kernels/build.py")
assert _spec is not None and _spec.loader is not None
kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernels)

PACKAGE = "worker.runtime.kernels._build"


class KernelLibrary(Extension):
    """The library of one ISA (``isa``), a plain shared object loaded with ctypes."""

    def __init__(self, isa: str) -> None:
        csrc = kernels.CSRC_DIR.relative_to(ROOT)
        super().__init__(
            f"{PACKAGE}.liblp_{isa}",
            sources=[str(csrc / s) for s in kernels.SOURCES],
            depends=[str(h.relative_to(ROOT)) for h in kernels.headers()],
            optional=isa in kernels.OPTIONAL_ISAS,
        )
        self.isa = isa


class BuildKernels(build_ext):
    """``build_ext`` for :class:`KernelLibrary`: ``build.compile_library`` under the hashed name."""

    def finalize_options(self) -> None:
        """The ISA libraries compile side by side (one ``g++`` each, ~15 s apiece on one core)
        unless ``--parallel``/``-j`` says otherwise."""
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def get_ext_filename(self, fullname: str) -> str:
        """``liblp_<isa>-<hash>.so`` (the name the loader expects), under its package's folder
        when ``fullname`` is the dotted name (setuptools asks for both forms)."""
        package, _, name = fullname.rpartition(".")
        isa = name.removeprefix("liblp_")
        if package in ("", PACKAGE) and name.startswith("liblp_") and isa in kernels.ISA_FLAGS:
            filename = kernels.library_name(isa)
            return str(Path(*package.split("."), filename)) if package else filename
        return super().get_ext_filename(fullname)

    def build_extension(self, ext: Extension) -> None:
        """Compile one ISA's library unless it is there (its name is its sources' hash) or
        ``--force``; a failure of an optional one is reported as a ``CompileError``, which
        setuptools turns into a warning."""
        if not isinstance(ext, KernelLibrary):
            return super().build_extension(ext)
        out = Path(self.get_ext_fullpath(ext.name))
        if out.exists() and not self.force:
            return
        try:
            kernels.compile_library(ext.isa, out)
        except kernels.KernelBuildError as exc:
            raise CompileError(str(exc)) from exc

    def copy_extensions_to_source(self) -> None:
        """The in-place copy, then the ISA's libraries of other sources are removed."""
        kernels.LIB_DIR.mkdir(exist_ok=True)
        super().copy_extensions_to_source()
        for isa in kernels.ISA_FLAGS:
            for old in kernels.LIB_DIR.glob(f"liblp_{isa}-*.so"):
                if old.name != kernels.library_name(isa):
                    old.unlink()


setup(
    ext_modules=[KernelLibrary(isa) for isa in kernels.ISA_FLAGS],
    cmdclass={"build_ext": BuildKernels},
)
