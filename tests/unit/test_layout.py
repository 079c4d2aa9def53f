"""Import rules inside the worker (README "How a request flows"): LoRA code never imports serving
code, the runtime never imports the gRPC edge; product packages never import ``bench`` at module
level. The rules between the planes and for ``loraplane/formats/`` are
``test_plane_independence.py``'s."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(module, line, at module level) for every import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(n) for n in tree.body}
    out: list[tuple[str, int, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno, id(node) in top))
    return out


def _py(*dirs: str) -> list[Path]:
    """The ``.py`` files under the repository folders ``dirs``."""
    return [p for d in dirs for p in (ROOT / d).rglob("*.py") if "node_modules" not in p.parts]


@pytest.mark.parametrize(
    "package, forbidden",
    [
        (
            "worker/lora",
            (
                "worker.serving",
                "worker.rpc",
                "worker.runtime.context",
                "control_plane",
                "clients",
            ),
        ),
        (
            "worker/runtime",
            ("worker.serving", "worker.rpc", "control_plane", "clients"),
        ),
        ("worker/serving", ("worker.rpc", "grpc", "control_plane", "clients")),
        ("loraplane", ("worker", "control_plane", "clients", "torch")),
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


def test_client_library_does_not_import_the_cli():
    """``clients/`` outside ``clients/cli/`` is the library: usable without the command line, so
    it imports neither the CLI nor its toolkits (click, rich) nor either plane."""
    library = [p for p in (ROOT / "clients").glob("*.py")]
    assert {p.name for p in library} >= {"__init__.py", "client.py", "channel.py", "wire.py", "results.py"}
    forbidden = ("clients.cli", "click", "rich", "control_plane", "worker")
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {mod}"
        for p in library
        for mod, line, top in _imports(p)
        if any(mod == f or mod.startswith(f + ".") for f in forbidden)
    ]
    assert not bad, bad


def test_server_options_stay_with_their_server():
    """Each server's options module (beside its config) imports the shared click pieces and its
    own package only: the control plane's never the worker, the worker's never the control plane."""
    rules = {"control_plane/options.py": ("worker", "clients"), "worker/options.py": ("control_plane", "clients")}
    bad = [
        f"{path}:{line} imports {mod}"
        for path, forbidden in rules.items()
        for mod, line, _ in _imports(ROOT / path)
        if any(mod == f or mod.startswith(f + ".") for f in forbidden)
    ]
    assert not bad, bad


def test_product_packages_do_not_import_bench_at_module_level():
    bad = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in _py("worker", "control_plane", "clients", "loraplane")
        for mod, line, top in _imports(p)
        if top and (mod == "bench" or mod.startswith("bench."))
    ]
    assert not bad, bad
