"""The markers a test's folder gives it: the folder is the only source of ``integration``,
``parity`` and ``gpu``.

Every test under ``tests/<folder>/`` for a folder in ``FOLDER_MARKS`` carries that folder's mark,
added at collection by the folder's ``conftest.py`` (``mark_folder``); no test module writes one
of these marks itself (``tests/unit/test_repo_hygiene.py`` checks both). The per-test markers are
``slow`` (the tier: the fast tier is ``-m "not slow"``) and ``cuda`` (needs a CUDA device:
skipped without one, saying why), written where they apply, in any folder.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parents[1]
"""The ``tests/`` folder of the repository."""

FOLDER_MARKS = {"integration": "integration", "parity": "parity", "gpu": "gpu"}
"""``tests/`` subfolder name → the mark every test in it carries."""


def folder_mark(path: Path) -> str | None:
    """The mark of the ``tests/`` subfolder that ``path`` (a test module, or any file) lies in;
    None for a path in another folder or outside ``tests/``."""
    try:
        parts = path.resolve().relative_to(TESTS_DIR).parts
    except ValueError:
        return None
    return FOLDER_MARKS.get(parts[0]) if len(parts) > 1 else None


def mark_folder(items: Iterable[pytest.Item], folder: Path) -> None:
    """Add ``folder``'s mark (``FOLDER_MARKS``) to each of ``items`` collected from a module under
    ``folder``; the others are left alone (pytest hands every conftest all the session's items).

    Raises ``KeyError`` when ``folder`` is not one of ``FOLDER_MARKS``'s folders."""
    folder = folder.resolve()
    mark = getattr(pytest.mark, FOLDER_MARKS[folder.relative_to(TESTS_DIR).as_posix()])
    for item in items:
        if item.path.resolve().is_relative_to(folder):
            item.add_marker(mark)
