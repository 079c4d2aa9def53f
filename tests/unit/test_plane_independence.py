"""The two planes stand apart (docs/architecture.md "Layering"): the control plane and the worker
share only ``loraplane`` (the torch-free formats layer ``loraplane.formats`` and the gRPC stubs
``loraplane.v1``), never each other.

- No module under ``control_plane/`` imports ``worker``, and none under ``worker/`` imports
  ``control_plane``, counting every ``import`` statement: at module level, inside functions (a
  lazy import is how a dependency hides) and under ``if TYPE_CHECKING:``.
- ``loraplane/formats/`` imports neither plane, nor ``clients`` or ``bench``, and never ``torch``.
- In a fresh interpreter, importing every ``control_plane`` module leaves ``os.environ`` as it
  was (a worker package's import-time ``os.environ.setdefault`` would change the control
  plane's process-wide settings) and does not load ``torch``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module_name(path: Path) -> str:
    """Dotted module name of a product file: its path from the repository root."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _py(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def imported_modules(text: str, module: str, *, is_package: bool = False) -> list[tuple[str, int]]:
    """``(module, line)`` for every import statement in ``text`` (the source of ``module``),
    wherever it sits, in line order; relative imports are resolved against its package."""
    package = module if is_package else module.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((base, node.lineno))
    return sorted(out, key=lambda t: t[1])


def _offenders(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line} imports {mod}"
        for path in _py(folder)
        for mod, line in imported_modules(
            path.read_text(encoding="utf-8"), _module_name(path), is_package=path.name == "__init__.py"
        )
        if any(mod == f or mod.startswith(f + ".") for f in forbidden)
    ]


def test_import_finder_sees_lazy_and_relative_imports():
    """The finder itself: an import inside a function, a ``TYPE_CHECKING`` import and relative
    imports all count."""
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import worker.config\n"
        "def f():\n    import worker.errors\n"
        "from .errors import X\n"
        "from . import registry\n"
    )
    mods = [m for m, _ in imported_modules(src, "control_plane.probe")]
    assert mods == ["typing", "worker.config", "worker.errors", "control_plane.errors", "control_plane"]
    assert [m for m, _ in imported_modules("from .. import x", "worker.lora", is_package=True)] == ["worker"]


@pytest.mark.parametrize(
    "folder, forbidden",
    [
        ("control_plane", ("worker",)),
        ("worker", ("control_plane",)),
        ("loraplane/formats", ("worker", "control_plane", "clients", "bench", "torch")),
    ],
)
def test_folder_does_not_import(folder, forbidden):
    assert _py(folder), f"{folder}/ has no Python files"
    bad = _offenders(folder, forbidden)
    assert not bad, "\n".join(bad)


def test_importing_the_control_plane_sets_no_environment_and_loads_no_torch():
    """Every ``control_plane`` module imported in one fresh interpreter: ``os.environ`` is
    unchanged afterwards and ``torch`` is not in ``sys.modules``."""
    mods = sorted(_module_name(p) for p in _py("control_plane"))
    assert "control_plane.registry" in mods and "control_plane.base_model" in mods
    code = (
        "import importlib, json, os, sys\n"
        "before = dict(os.environ)\n"
        "for name in json.load(sys.stdin):\n"
        "    importlib.import_module(name)\n"
        "after = dict(os.environ)\n"
        "changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))\n"
        "torch = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:5]\n"
        "worker = sorted(m for m in sys.modules if m == 'worker' or m.startswith('worker.'))[:5]\n"
        "print(json.dumps({'changed': changed, 'torch': torch, 'worker': worker}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(mods),
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == {"changed": [], "torch": [], "worker": []}
