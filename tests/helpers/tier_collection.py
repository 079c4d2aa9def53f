"""Which test modules a ``-m`` expression leaves out before they are imported.

A module whose top-level ``pytestmark`` carries ``pytest.mark.slow`` holds only slow tests:
pytest adds a module's marks to each of its tests, and no test can take one away. Under
``-m "not slow"`` (the fast tier) none of its tests can be selected, yet collecting the module
imports it (torch, grpc, openai, ...) and rewrites its asserts: ~5 s of a core for the two dozen
such modules, every fast run. ``markexpr_excludes`` answers, from the module's source alone,
whether the expression is false for every test the module could hold; ``tests/conftest.py``,
which adds the mark of the module's folder (``tests/helpers/folder_marks.py``) to these,
leaves those modules out of collection (they are then neither collected nor counted as
deselected). A module that cannot be parsed is collected, so its error is reported.
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
from pathlib import Path

_IDENT = re.compile(r"[A-Za-z_]\w*")
_OPERATORS = {"and", "or", "not"}
_MAX_FREE = 8  # marker names the expression may test beyond the module's own (2**8 cases)


def _mark_name(node: ast.expr) -> str | None:
    """``x`` for the expression ``pytest.mark.x`` (a mark without arguments), else None."""
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "pytest"
    ):
        return node.attr
    return None


@functools.cache
def module_marks(path: Path) -> frozenset[str]:
    """Names of the argument-free ``pytest.mark.<name>`` marks in the top-level ``pytestmark =``
    of the test module at ``path`` (one mark, or a list or tuple of them). Marks with arguments
    (``skipif(...)``) are not counted; an unreadable or unparsable file has none."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text) if "pytestmark" in text else None
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    if tree is None:
        return frozenset()
    names: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets):
            values = stmt.value.elts if isinstance(stmt.value, (ast.List, ast.Tuple)) else [stmt.value]
            names.update(n for v in values if (n := _mark_name(v)) is not None)
    return frozenset(names)


def markexpr_excludes(markexpr: str, marks: frozenset[str]) -> bool:
    """True when the ``-m`` expression ``markexpr`` is false for a test carrying ``marks`` whatever
    other marks it also carries (every combination of the other names the expression tests).
    False when it could be true, when ``marks`` is empty, and for expressions this does not
    read (marks matched by their arguments, more than ``_MAX_FREE`` other names)."""
    if not marks or not markexpr.strip() or "=" in markexpr:  # "=": a mark matched by its arguments
        return False
    try:
        from _pytest.mark.expression import Expression

        expr = Expression.compile(markexpr)
    except Exception:  # a newer pytest or an expression it refuses: collect as usual
        return False
    free = sorted(set(_IDENT.findall(markexpr)) - _OPERATORS - marks)
    if len(free) > _MAX_FREE:
        return False
    for values in itertools.product((False, True), repeat=len(free)):
        on = marks | {name for name, v in zip(free, values, strict=True) if v}
        if expr.evaluate(lambda name, /, on=on, **kwargs: not kwargs and name in on):
            return False
    return True
