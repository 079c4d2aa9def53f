"""``tests/parity/``: our outputs against llama.cpp's and PEFT's reference outputs (``tests/fixtures``,
teacher-forced with ``tests/helpers/parity_compare.py``). Every test here is marked ``parity`` (by
this folder, ``tests/helpers/folder_marks.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.folder_marks import mark_folder


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of this folder is ``parity`` (``tests/helpers/folder_marks.py``)."""
    mark_folder(items, Path(__file__).parent)
