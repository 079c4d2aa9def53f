"""``tests/integration/``: real control planes, workers and servers over sockets. Every test here
is marked ``integration`` (by this folder, ``tests/helpers/folder_marks.py``); the fixtures of
the scripted workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.folder_marks import mark_folder


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of this folder is ``integration`` (``tests/helpers/folder_marks.py``)."""
    mark_folder(items, Path(__file__).parent)


@pytest.fixture
def adapters_dir(fixtures_dir: Path) -> Path:
    """``tests/fixtures/adapters`` (the fixture adapters of Gemma 3 270M)."""
    return fixtures_dir / "adapters"


@pytest.fixture
def cluster(start_control_plane, adapters_dir):
    """``cluster(n_workers, **config) -> (ControlPlane, [ScriptedMember])``."""
    from tests.helpers.scripted_worker import ScriptedMember

    workers: list[ScriptedMember] = []

    def make(n_workers: int = 1, **overrides):
        overrides.setdefault("adapter_dirs", (str(adapters_dir),))
        overrides.setdefault("heartbeat_interval_s", 0.2)
        overrides.setdefault("dead_after_missed", 5)
        cp = start_control_plane(**overrides)
        for i in range(n_workers):
            workers.append(ScriptedMember(f"w{i + 1}", cp.addr))
        return cp, list(workers)

    yield make
    for w in workers:
        w.close()
