"""The README and ``docs/`` stay true to the tree: every path or module they name in backticks
exists, every relative link resolves inside the repository, nothing points at documents
outside it, the README stays short, and ``docs/architecture.md`` names every package.

Fast and model-free: reads Markdown and looks at the file tree, nothing else.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
# Checked for references outside the repository too (they are linked from the README).
LINKED_READMES = [ROOT / "deploy" / "README.md", ROOT / "bench" / "README.md"]
README_MAX_LINES = 160

SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", "_build", ".mypy_cache", ".ruff_cache"}
# File-name endings: a dotted name ending in one of these is a file name, not a module path.
FILE_SUFFIXES = {
    "py", "pyi", "md", "sh", "proto", "json", "yaml", "yml", "toml", "cpp", "js", "gguf",
    "safetensors", "sqlite3", "service", "txt", "cfg", "ini",
}  # fmt: skip
# A token holding one of these is a pattern, placeholder or expression, not a path.
NOT_A_PATH = set("*?<>{}[]()|=@$,;…\\") | {"://"}

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
OUTSIDE = [
    (re.compile(r"(?<![\w./-])shared/"), "a shared/ path"),
    (re.compile(r"\bCONTRACT\.md\b"), "CONTRACT.md"),
    (re.compile(r"\bSPEC(?:\.md\b|\s*§)"), "SPEC"),
    (re.compile(r"\bissues?\s+#?\d+", re.I), "an issue number"),
]


def _rel(doc: Path) -> str:
    return doc.relative_to(ROOT).as_posix()


def _prose(doc: Path) -> str:
    """The document without its fenced code blocks."""
    return FENCE.sub("", doc.read_text(encoding="utf-8"))


def _top_level() -> set[str]:
    return {p.name for p in ROOT.iterdir() if p.name not in SKIP_DIRS}


def _python_packages() -> set[str]:
    return {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}


def path_tokens(text: str) -> list[str]:
    """Repository-relative paths named in inline code: tokens with a ``/`` whose first component
    is a top-level entry of the repository or whose name ends like a file we keep. URLs,
    absolute paths (``/v1/models``), home paths, options (``--slots``), globs and placeholders
    (``worker/runtime/arch/<arch>.py``) are not paths."""
    top, out = _top_level(), []
    for span in CODE_SPAN.findall(text):
        for raw in span.split():
            tok = raw.strip("'\"").rstrip(".,:;").removeprefix("./")
            if "/" not in tok or tok.startswith(("/", "~", "-", "$")) or any(c in tok for c in NOT_A_PATH):
                continue
            first, _, _ = tok.partition("/")
            if first in top or tok.rsplit(".", 1)[-1] in FILE_SUFFIXES:
                out.append(tok)
    return out


def module_tokens(text: str) -> list[str]:
    """Dotted names in inline code that start with one of our Python packages
    (``worker.lora.pool``, ``clients.LoraplaneClient``); file names (``loraplane.sqlite3``) are
    not."""
    packages, out = _python_packages(), []
    for span in CODE_SPAN.findall(text):
        for raw in span.split():
            tok = raw.strip("'\".,:;()")
            if not DOTTED.fullmatch(tok) or tok.split(".")[0] not in packages:
                continue
            if tok.rsplit(".", 1)[-1] in FILE_SUFFIXES:
                continue
            out.append(tok)
    return out


def module_exists(dotted: str) -> bool:
    """The longest importable prefix is a module or package of the tree, and whatever follows it
    is named in its source: an attribute of a module (``worker.serving.engine.WorkerEngine``);
    after a package, a lower-case name must be a module (or named in ``__init__.py``), a
    capitalised one may live in any of the package's modules (``loraplane.v1.Worker``, the
    generated gRPC service)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        if (base / "__init__.py").is_file():
            sources = [base / "__init__.py"]
            if i < len(parts) and parts[i][:1].isupper():
                sources += sorted(base.glob("*.py"))
        elif base.with_suffix(".py").is_file():
            sources = [base.with_suffix(".py")]
        else:
            continue
        if i == len(parts):
            return True
        name = re.compile(rf"\b{re.escape(parts[i])}\b")
        return any(name.search(src.read_text(encoding="utf-8")) for src in sources)
    return False


def link_targets(text: str) -> list[str]:
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # URLs, mailto:, anchors in the same page
        out.append(target.split("#", 1)[0])
    return out


def _inside_repo(path: Path) -> bool:
    resolved = path.resolve()
    return resolved == ROOT or ROOT in resolved.parents


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_named_paths_exist(doc):
    text = _prose(doc)
    missing = sorted({t for t in path_tokens(text) if not (ROOT / t).exists()})
    missing += sorted({t for t in module_tokens(text) if not module_exists(t)})
    assert not missing, f"{_rel(doc)} names what is not in the repository: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_links_resolve_inside_the_repository(doc):
    bad = [
        t
        for t in link_targets(doc.read_text(encoding="utf-8"))
        if not _inside_repo(doc.parent / t) or not (doc.parent / t).exists()
    ]
    assert not bad, f"{_rel(doc)} links to missing or outside targets: {bad}"


@pytest.mark.parametrize("doc", DOCS + LINKED_READMES, ids=_rel)
def test_no_references_outside_the_repository(doc):
    text = doc.read_text(encoding="utf-8")
    found = [what for pattern, what in OUTSIDE if pattern.search(text)]
    climbing = [m for m in re.findall(r"(?:\.\./)+[\w./-]*", text) if not _inside_repo(doc.parent / m)]
    assert not found and not climbing, f"{_rel(doc)} refers outside the repository: {found + climbing}"


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}); move detail to docs/"


def test_architecture_names_every_package():
    named = set(path_tokens(_prose(ROOT / "docs" / "architecture.md")))
    packages = sorted(
        init.parent.relative_to(ROOT).as_posix() + "/"
        for init in ROOT.rglob("__init__.py")
        if not SKIP_DIRS.intersection(init.relative_to(ROOT).parts) and init.relative_to(ROOT).parts[0] != "tests"
    )
    assert packages, "no packages found"
    missing = [p for p in packages if p not in named]
    assert not missing, f"docs/architecture.md does not name these packages: {missing}"


def test_architecture_names_every_module():
    """Every product module has its line in docs/architecture.md (generated stubs excepted), so a
    new room cannot land undocumented."""
    named = set(path_tokens(_prose(ROOT / "docs" / "architecture.md")))
    modules = sorted(
        py.relative_to(ROOT).as_posix()
        for package in ("worker", "control_plane", "clients", "loraplane", "bench")
        for py in (ROOT / package).rglob("*.py")
        if py.name != "__init__.py"
        and not SKIP_DIRS.intersection(py.relative_to(ROOT).parts)
        and not py.relative_to(ROOT).as_posix().startswith("loraplane/v1/")
    )
    assert len(modules) > 50, "no modules found"
    missing = [m for m in modules if m not in named]
    assert not missing, f"docs/architecture.md does not name these modules: {missing}"


# ---- the checker itself --------------------------------------------------------------------


def test_path_tokens_ignore_what_is_not_a_path():
    text = (
        "`worker/serving/scheduler.py` `https://example.com/a/b.py` `/v1/models` `--slots` "
        "`worker/runtime/arch/<arch>.py` `text/event-stream` `~/.cache` `.venv/bin/python -m pytest` "
        "`sqlite:///PATH` `postgresql://USER@HOST:PORT/DB` `lora_alpha/sqrt(r)` `loraplane/demo/adapters/` `.ci/run`"
    )
    assert path_tokens(text) == ["worker/serving/scheduler.py", "loraplane/demo/adapters/", ".ci/run"]


def test_module_tokens_and_resolution():
    tokens = module_tokens("`worker.lora.pool` `clients.LoraplaneClient` `loraplane.sqlite3` `general.name`")
    assert tokens == ["worker.lora.pool", "clients.LoraplaneClient"]
    assert all(module_exists(t) for t in tokens)
    assert not module_exists("worker.lora.no_such_module")
    assert not module_exists("clients.NoSuchClient")
    assert module_exists("loraplane.v1.Worker") and module_exists("worker.serving.engine.max_piece_bytes")


def test_outside_references_are_caught():
    for text in ("see ../shared/CONTRACT.md", "`shared/fixtures`", "SPEC §4", "SPEC.md", "issue 12's targets"):
        assert any(p.search(text) for p, _ in OUTSIDE), text
    for text in ("a shared 256-token system prompt", "the `tests/shared_state.py` helper", "issues are tracked"):
        assert not any(p.search(text) for p, _ in OUTSIDE), text
