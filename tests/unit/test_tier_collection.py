"""``tests/helpers/tier_collection.py``: which modules a ``-m`` expression leaves out unimported."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tier_collection import markexpr_excludes, module_marks

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("source", "marks"),
    [
        ("import pytest\npytestmark = pytest.mark.slow\n", {"slow"}),
        ("import pytest\npytestmark = [pytest.mark.slow, pytest.mark.integration]\n", {"slow", "integration"}),
        ("import pytest\npytestmark = (pytest.mark.parity, pytest.mark.skipif(True, reason='x'))\n", {"parity"}),
        ("import pytest\n\n@pytest.mark.slow\ndef test_a():\n    pytestmark = pytest.mark.slow\n", set()),
        ("import pytest\nif True:\n    pytestmark = pytest.mark.slow\n", set()),  # not a top-level statement
        ("def broken(:\n", set()),
    ],
)
def test_module_marks_reads_the_top_level_pytestmark(tmp_path, source, marks):
    path = tmp_path / "test_mod.py"
    path.write_text(source)
    assert module_marks(path) == marks


@pytest.mark.parametrize(
    ("markexpr", "excluded"),
    [
        ("not slow", True),
        ("not slow and not gpu", True),
        ("not (slow or gpu)", True),
        ("not integration", True),
        ("slow", False),
        ("slow and parity", False),
        ("gpu or not slow", False),  # a test of the module may carry gpu too
        ("parity", False),
        ("", False),
    ],
)
def test_markexpr_excludes_only_what_no_test_of_the_module_can_match(markexpr, excluded):
    assert markexpr_excludes(markexpr, frozenset({"slow", "integration"})) is excluded


def test_unmarked_modules_are_never_excluded():
    assert markexpr_excludes("not slow", frozenset()) is False


def test_the_fast_tier_leaves_out_the_modules_marked_slow():
    """The repository's own modules: the fully slow ones are found (a guard against a check that
    never fires), and a module with fast tests is not among them."""
    slow = {p.name for p in ROOT.glob("tests/**/test_*.py") if markexpr_excludes("not slow", module_marks(p))}
    assert {"test_qwen_parity.py", "test_bench.py", "test_export_parity.py"} <= slow
    assert "test_model_parity.py" not in slow and "test_tier_collection.py" not in slow
