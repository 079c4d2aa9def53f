"""Import rules of the layout (README "How a request flows"), checked in fresh interpreters:
the control plane never loads torch; LoRA code never imports serving code; product packages
never import ``bench`` at module level."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _fresh(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_control_plane_does_not_import_torch():
    r = _fresh(
        "import loraplane.control_plane.server, loraplane.control_plane.registry, sys; "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
        "assert not bad, bad[:5]"
    )
    assert r.returncode == 0, r.stderr


MAPPED = ("control_plane", "worker", "clients", "bench")  # symlinked into loraplane/


def _canonical(module: str) -> str:
    """The import name: a repository folder's modules live under ``loraplane.`` (``worker.x`` is
    ``loraplane.worker.x``)."""
    return f"loraplane.{module}" if module.split(".")[0] in MAPPED else module


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(canonical module, line, at module level) for every import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(n) for n in tree.body}
    out: list[tuple[str, int, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(_canonical(a.name), node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((_canonical(node.module), node.lineno, id(node) in top))
    return out


def _py(*dirs: str) -> list[Path]:
    """The ``.py`` files under the repository folders ``dirs`` (``rglob`` does not follow the
    symlinks in ``loraplane/``: ``_py("loraplane")`` is the shared plumbing only)."""
    return [p for d in dirs for p in (ROOT / d).rglob("*.py") if "node_modules" not in p.parts]


@pytest.mark.parametrize(
    "package, forbidden",
    [
        (
            "worker/lora",
            (
                "loraplane.worker.serving",
                "loraplane.worker.rpc",
                "loraplane.worker.runtime.context",
                "loraplane.control_plane",
                "loraplane.clients",
            ),
        ),
        (
            "worker/gguf",
            (
                "loraplane.worker.lora",
                "loraplane.worker.runtime",
                "loraplane.worker.serving",
                "loraplane.worker.rpc",
                "torch",
            ),
        ),
        (
            "worker/runtime",
            ("loraplane.worker.serving", "loraplane.worker.rpc", "loraplane.control_plane", "loraplane.clients"),
        ),
        ("worker/serving", ("loraplane.worker.rpc", "grpc", "loraplane.control_plane", "loraplane.clients")),
        # the control plane uses only the torch-free parts of the worker: the GGUF format, adapter-file
        # validation and the tokenizer (to show aLoRA invocation text)
        (
            "control_plane",
            (
                "loraplane.worker.runtime.model",
                "loraplane.worker.runtime.context",
                "loraplane.worker.runtime.graph",
                "loraplane.worker.serving",
                "loraplane.worker.rpc",
                "loraplane.worker.lora.adapter",
                "loraplane.worker.lora.plan",
                "torch",
                "loraplane.clients",
            ),
        ),
        ("loraplane", ("loraplane.worker", "loraplane.control_plane", "loraplane.clients", "torch")),
    ],
)
def test_package_does_not_import(package, forbidden):
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {mod}"
        for p in _py(package)
        for mod, line, _ in _imports(p)
        if any(mod == f or mod.startswith(f + ".") for f in forbidden)
    ]
    assert not bad, bad


def test_product_packages_do_not_import_bench_at_module_level():
    bad = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in _py("worker", "control_plane", "clients", "loraplane")
        for mod, line, top in _imports(p)
        if top and (mod == "loraplane.bench" or mod.startswith("loraplane.bench."))
    ]
    assert not bad, bad
