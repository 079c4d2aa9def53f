"""Repository hygiene (fast tier, no model): the clone stands alone and the code has no import
cycles.

- Nothing in the tracked tree reads outside the clone: no ``shared/`` fixture folder, no
  relative path that climbs above the repository root, no ``Path(__file__).parents[N]`` that
  leaves it. Caches, temp and system paths (``~/.cache``, ``/tmp``, ``/usr/...``) stay allowed.
- No import cycle among the product packages, counting every ``import`` statement (also those
  inside functions: a lazy import is how a cycle hides), except ``if TYPE_CHECKING:`` blocks.
- One path per file: a module's dotted name is its path from the repository root, and that is
  where Python finds it (no links, no mapping; docs/architecture.md "One path per file").
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("worker", "control_plane", "clients", "loraplane", "bench")
GENERATED = ("loraplane/v1/",)
TEXT_SUFFIXES = {
    ".cpp",
    ".h",
    ".py",
    ".sh",
    ".md",
    ".toml",
    ".yaml",
    ".yml",
    ".proto",
    ".js",
    ".mjs",
    ".ts",
    ".cfg",
    ".ini",
    ".txt",
}


@functools.cache
def _tracked() -> tuple[Path, ...]:
    """Tracked files plus untracked ones git does not ignore (what a commit would hold); listed
    once per session (the tree does not change while the tests run)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return tuple(ROOT / line for line in out.splitlines() if line and (ROOT / line).is_file())


@functools.cache
def _tree(path: Path) -> ast.Module:
    """``path`` parsed once per session: several checks walk the same files, and parsing the
    ~300 Python files of the repository takes seconds of a core each time."""
    return ast.parse(path.read_text(encoding="utf-8"))


def _text_files() -> list[Path]:
    # the checkers themselves name the patterns they look for
    skip = (
        "clients/node/node_modules/",
        "clients/node/package-lock.json",
        "tests/unit/test_repo_hygiene.py",
        "tests/unit/test_docs.py",
    )
    return [
        p
        for p in _tracked()
        if p.suffix in TEXT_SUFFIXES or p.name in {".gitignore", "run"}
        if not str(p.relative_to(ROOT)).startswith(skip)
    ]


_CLIMB = re.compile(r"(?:(?<=[\s\"'`(=:,])|^)((?:\.\./)+[\w.\-][\w.\-/]*)")
_ISSUE = re.compile(r"\b[Ii]ssue \d+\b")  # our issue tracker is not in the clone
CODE_SUFFIXES = {".py", ".proto", ".sh", ".js", ".cpp", ".h"}
_SHARED = re.compile(r"(?<![\w-])shared/(?:fixtures|SPEC|CONTRACT|STYLE|seeds)|\b(?:SPEC|CONTRACT|STYLE)\.md\b")


def test_nothing_reads_outside_the_clone():
    """No reference to the old ``shared/`` folder or its documents, and no ``../`` path that
    resolves above the repository root from the file that writes it (or from the root)."""
    bad: list[str] = []
    for path in _text_files():
        rel = path.relative_to(ROOT)
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if _SHARED.search(line) or (path.suffix in CODE_SUFFIXES and _ISSUE.search(line)):
                bad.append(f"{rel}:{n}: {line.strip()[:100]}")
            for m in _CLIMB.finditer(line):
                target = m.group(1)
                if not any((base / target).resolve().is_relative_to(ROOT) for base in (path.parent, ROOT)):
                    bad.append(f"{rel}:{n}: climbs out of the clone: {target}")
    assert not bad, "\n".join(bad)


def test_no_file_path_climbs_out_through_parents():
    """``Path(__file__).parents[N]`` / ``.parent.parent…`` chains stay inside the clone."""
    bad: list[str] = []
    for path in _tracked():
        if path.suffix != ".py":
            continue
        depth = len(path.relative_to(ROOT).parts) - 1  # parents[depth] is ROOT
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"__file__\)(?:\.resolve\(\))?\.parents\[(\d+)\]", text):
            if int(m.group(1)) > depth:
                bad.append(f"{path.relative_to(ROOT)}: parents[{m.group(1)}] is above the repository")
        for m in re.finditer(r"__file__\)(?:\.resolve\(\))?((?:\.parent)+)", text):
            if m.group(1).count(".parent") - 1 > depth:
                bad.append(f"{path.relative_to(ROOT)}: {m.group(0)} is above the repository")
    assert not bad, "\n".join(bad)


def _modules() -> dict[str, Path]:
    """``{module name: file}`` of the product (generated stubs excepted): the name is the path."""
    mods: dict[str, Path] = {}
    for path in _tracked():
        rel = path.relative_to(ROOT)
        if path.suffix != ".py" or rel.parts[0] not in PRODUCT or str(rel).startswith(GENERATED):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def import_graph() -> dict[str, set[str]]:
    """``{module: {product modules it imports}}``; ``from a.b import c`` is an edge to ``a.b.c``
    when that is a module, else to ``a.b``. Relative imports are resolved. A copy of the graph,
    which is built once per session (one test per product package reads it)."""
    return {mod: set(edges) for mod, edges in _import_graph().items()}


@functools.cache
def _import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = _tree(path)
        skip = _type_checking_lines(tree)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if getattr(node, "lineno", 0) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_import_graph_sees_the_packages():
    """The graph is built from the real tree (a guard against a vacuous cycle check)."""
    g = import_graph()
    assert "worker.runtime.model" in g
    assert "worker.runtime.errors" in g["worker.runtime.model"]
    assert "control_plane.server" in g and len(g) > 80


def test_cycle_finder_finds_a_cycle():
    """The detector itself: a 3-cycle and a self-contained chain."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(g) == [["a", "b", "c"]]


@pytest.mark.parametrize("package", PRODUCT)
def test_no_import_cycles(package):
    cycles = [c for c in _cycles(import_graph()) if any(m.split(".")[0] == package for m in c)]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_python_finds_each_module_at_its_path():
    """One path per file: in a fresh interpreter with the checkout first on ``sys.path``, Python
    finds every product module of the import graph at the file the graph named it after, so the
    graph built from file paths (above, and any tool's that follows paths) is the one Python
    resolves."""
    mods = _modules()
    code = (
        "import importlib.util, json, sys\n"
        "print(json.dumps({n: importlib.util.find_spec(n).origin for n in json.load(sys.stdin)}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(sorted(mods)),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    bad = [f"{name}: found at {found[name]}, path {path}" for name, path in mods.items() if found[name] != str(path)]
    assert not bad, "\n".join(bad)


def test_no_tracked_symlinks():
    """A link to a folder gives every file under it a second path (the layout this replaced)."""
    out = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    links = [line.split("\t", 1)[1] for line in out.splitlines() if line.startswith("120000 ")]
    assert not links, links


MAX_FUNCTION_LINES = 120


def test_no_long_functions_in_product_code():
    """No function or method in product code is longer than 120 lines; a long function is where
    several jobs hide."""
    long: list[str] = []
    for path in _tracked():
        rel = path.relative_to(ROOT)
        if path.suffix != ".py" or rel.parts[0] not in PRODUCT or str(rel).startswith(GENERATED):
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    assert not long, "\n".join(long)


MAX_CLASS_LINES = 450


def _long_classes(limit: int) -> dict[tuple[str, str], int]:
    """``{(path, class name): lines}`` of the product classes (every top-level package of
    ``PRODUCT``, generated stubs excepted; nested classes counted on their own too) longer
    than ``limit`` lines, from the ``class`` line to the last line of its body."""
    out: dict[tuple[str, str], int] = {}
    for path in _tracked():
        rel = path.relative_to(ROOT)
        if path.suffix != ".py" or rel.parts[0] not in PRODUCT or str(rel).startswith(GENERATED):
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > limit:
                    out[(str(rel), node.name)] = n
    return out


def test_no_long_classes_in_product_code():
    """No class in product code (``worker/``, ``control_plane/``, ``clients/``, ``loraplane/``,
    ``bench/``) is longer than 450 lines: a long class is several jobs sharing one ``self``."""
    long = _long_classes(MAX_CLASS_LINES)
    assert not long, "\n".join(f"{p} {c}: {n} lines" for (p, c), n in sorted(long.items()))


def test_long_class_finder_measures_the_class_span():
    """The measure itself: the longest product class is found with its real span (from the
    ``class`` line to its body's last line), and a limit of exactly that span leaves it out."""
    long = _long_classes(100)
    ((path, name), n) = max(long.items(), key=lambda item: item[1])
    node = next(c for c in ast.walk(_tree(ROOT / path)) if isinstance(c, ast.ClassDef) and c.name == name)
    assert n == node.end_lineno - node.lineno + 1 > 100
    assert (path, name) not in _long_classes(n)
    assert (path, name) in _long_classes(n - 1)


_LOGGER = re.compile(r"(?:structlog\.get_logger|logging\.getLogger)\(([^)]*)\)")
_EVENT = re.compile(r"\blog\.(?:debug|info|warning|error|exception|critical)\(\s*(f?)([\"'])(.*?)\2")


def _product_sources() -> list[tuple[Path, str]]:
    out = []
    for path in _tracked():
        rel = path.relative_to(ROOT)
        if path.suffix == ".py" and rel.parts[0] in PRODUCT and not str(rel).startswith(GENERATED):
            out.append((rel, path.read_text(encoding="utf-8")))
    return out


def test_loggers_are_named_loraplane_dot_module():
    """Every logger is ``loraplane.<dotted module path>`` (one filter catches all of ours)."""
    bad = []
    for rel, text in _product_sources():
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        want = module if module.startswith("loraplane.") else f"loraplane.{module}"
        for m in _LOGGER.finditer(text):
            if m.group(1).strip() != f'"{want}"':
                bad.append(f"{rel}: logger {m.group(1) or '()'}, want {want!r}")
    assert not bad, "\n".join(bad)


def test_log_events_are_snake_case():
    """Log events are snake_case names; details go in key/value fields, not in the event."""
    bad = []
    for rel, text in _product_sources():
        for m in _EVENT.finditer(text):
            if m.group(1) or not re.fullmatch(r"[a-z][a-z0-9_]*", m.group(3)):
                bad.append(f"{rel}: event {m.group(3)!r}")
    assert not bad, "\n".join(bad)


# ---- the test suite: helpers in tests/helpers/, markers from the folders ----------------------

TESTS = ROOT / "tests"


def _imported_modules(tree: ast.AST, package: str) -> list[str]:
    """Every module an ``import`` / ``from ... import`` in ``tree`` names (also inside functions),
    with ``from a import b`` counted as both ``a`` and ``a.b`` (``b`` may be a module) and
    relative imports resolved against ``package``."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names)
    return names


def _suite_imports_of_test_modules(path: Path, text: str) -> list[str]:
    """The modules of the suite that ``text`` (the file at ``path`` under tests/) imports and no
    module should: a test module (``test_*``) or a folder's ``conftest``."""
    package = ".".join(path.relative_to(ROOT).parent.parts)
    return [
        name
        for name in _imported_modules(ast.parse(text), package)
        if name.startswith("tests.") and (name.rsplit(".", 1)[-1].startswith("test_") or name.endswith(".conftest"))
    ]


def test_the_test_module_import_check_sees_each_form():
    path = TESTS / "unit" / "test_x.py"
    text = (
        "import tests.integration.test_a as a\n"
        "from tests.unit.test_b import helper\n"
        "from tests.unit import test_c\n"
        "from .test_d import E\n"
        "from tests.gpu.conftest import CUDA\n"
        "def f():\n    from tests.parity.test_e import g\n"
        "from tests.helpers.http_fakes import Front\n"
    )
    found = _suite_imports_of_test_modules(path, text)
    assert found == [
        "tests.integration.test_a",
        "tests.unit.test_b",
        "tests.unit.test_c",
        "tests.unit.test_d",
        "tests.gpu.conftest",
        "tests.parity.test_e",
    ]


def test_no_test_module_imports_another():
    """Shared helpers live in ``tests/helpers/``, fixtures in a folder's ``conftest.py``: no module
    of the suite imports a test module or a conftest (a test module imported by another runs its
    module-level code twice and drags its fixtures along under ``noqa``)."""
    bad = []
    for path in sorted(TESTS.rglob("*.py")):
        found = _suite_imports_of_test_modules(path, path.read_text(encoding="utf-8"))
        bad.extend(f"{path.relative_to(ROOT)} imports {name}" for name in found)
    assert not bad, "\n".join(bad)


def test_helpers_define_no_fixtures():
    """A fixture in ``tests/helpers/`` could only reach a test by being imported into it (a
    re-export under ``noqa``); fixtures belong in a ``conftest.py``."""
    bad = [
        str(path.relative_to(ROOT))
        for path in sorted((TESTS / "helpers").glob("*.py"))
        if re.search(r"@pytest\.fixture\b", path.read_text(encoding="utf-8"))
    ]
    assert not bad, bad


def _folder_marks_written(text: str) -> list[str]:
    """``pytest.mark.<m>`` uses in ``text`` for the marks only a folder gives (``FOLDER_MARKS``)."""
    from tests.helpers.folder_marks import FOLDER_MARKS

    marks = set(FOLDER_MARKS.values())
    return [
        f"line {node.lineno}: pytest.mark.{node.attr}"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Attribute)
        and node.attr in marks
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
    ]


def test_no_test_module_writes_a_folder_marker():
    """``integration``, ``parity`` and ``gpu`` come from the folder (its conftest), never from a
    test module: a hand-written one would put a test in a suite its folder is not."""
    assert _folder_marks_written("import pytest\npytestmark = [pytest.mark.slow, pytest.mark.parity]\n") == [
        "line 2: pytest.mark.parity"
    ]
    assert _folder_marks_written("x = [pytest.param(1, marks=pytest.mark.gpu)]\n") == ["line 1: pytest.mark.gpu"]
    bad = []
    for path in sorted(TESTS.rglob("test_*.py")):
        bad.extend(f"{path.relative_to(ROOT)} {hit}" for hit in _folder_marks_written(path.read_text(encoding="utf-8")))
    assert not bad, "\n".join(bad)


def test_each_marked_folder_marks_its_tests_in_its_conftest():
    """Each folder of ``FOLDER_MARKS`` has a ``conftest.py`` whose collection hook hands its own
    folder to ``mark_folder``; no other folder of tests/ holds tests without one."""
    from tests.helpers.folder_marks import FOLDER_MARKS

    for folder in FOLDER_MARKS:
        text = (TESTS / folder / "conftest.py").read_text(encoding="utf-8")
        assert "def pytest_collection_modifyitems(" in text and "mark_folder(items, Path(__file__).parent)" in text
    test_folders = {p.parent.relative_to(TESTS).parts[0] for p in TESTS.rglob("test_*.py") if p.parent != TESTS}
    assert test_folders == {*FOLDER_MARKS, "unit"}


def test_folder_mark_of_paths():
    from tests.helpers.folder_marks import folder_mark

    assert folder_mark(TESTS / "integration" / "test_cli.py") == "integration"
    assert folder_mark(TESTS / "parity" / "test_tokenizer.py") == "parity"
    assert folder_mark(TESTS / "gpu" / "test_gpu_check.py") == "gpu"
    assert folder_mark(TESTS / "unit" / "test_pool.py") is None
    assert folder_mark(TESTS / "conftest.py") is None
    assert folder_mark(ROOT / "worker" / "gpu" / "engine.py") is None


def test_every_collected_test_carries_exactly_its_folders_marker(request):
    """Every test collected in this session (the whole fast tier when it runs) carries its folder's
    mark and no other folder's: the marks ``-m integration`` / ``parity`` / ``gpu`` select by."""
    from tests.helpers.folder_marks import FOLDER_MARKS, folder_mark

    bad = []
    for item in request.session.items:
        want = folder_mark(Path(item.path))
        have = {m.name for m in item.iter_markers()} & set(FOLDER_MARKS.values())
        if have != ({want} if want else set()):
            bad.append(f"{item.nodeid}: {sorted(have)}, want {want}")
    assert request.node in request.session.items
    assert not bad, "\n".join(bad[:20])


def test_the_debian_packages_test_sh_installs_are_the_ones_readme_and_the_proto_test_name():
    """``scripts/test.sh`` (as root) installs ``PROTO_PACKAGES``; docs/architecture.md lists them
    and ``tests/integration/test_proto_clients.py`` asks for them (``DEBIAN_PACKAGES``, read from
    its source: no test module imports another)."""
    script = (ROOT / "scripts" / "test.sh").read_text(encoding="utf-8")
    m = re.search(r'PROTO_PACKAGES="([^"]*)"', script)
    assert m, "PROTO_PACKAGES not found in scripts/test.sh"
    installed = m.group(1).replace("\\\n", " ").split()
    tree = ast.parse((TESTS / "integration" / "test_proto_clients.py").read_text(encoding="utf-8"))
    (asked,) = [
        ast.literal_eval(node.value).split()
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "DEBIAN_PACKAGES" for t in node.targets)
    ]
    docs = " ".join((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").split())
    assert installed == asked and len(installed) == 11
    assert f"`{' '.join(installed)}`" in docs


MAX_MODULE_DOCSTRING_LINES = 20


def test_module_docstrings_are_short():
    """A product module's docstring says what the module does in at most 20 lines and points to
    docs/ for the why; design prose lives in docs/, where one copy is kept true."""
    long: list[str] = []
    for path in _tracked():
        rel = path.relative_to(ROOT).as_posix()
        if path.suffix != ".py" or rel.split("/")[0] not in PRODUCT or rel.startswith(GENERATED):
            continue
        doc = ast.get_docstring(_tree(path), clean=False) or ""
        n = len(doc.splitlines())
        if n > MAX_MODULE_DOCSTRING_LINES:
            long.append(f"{rel}: {n} lines")
    assert not long, f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines:\n" + "\n".join(sorted(long))
