"""Progress display for long operations (rich), on a terminal only.

Shown on stderr when it is a TTY, the command is not in ``--json`` mode and
``$LORAPLANE_NO_PROGRESS`` is unset; otherwise every helper here is a no-op, so logs and
machine-readable output never carry progress lines. Used by uploads over `UPLOAD_BAR_BYTES`,
``convert-peft``, ``export-lora``, and model loading in ``serve`` / ``demo`` / ``worker``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from loraplane.env import ENV_NO_PROGRESS

UPLOAD_BAR_BYTES = 4 * 1024 * 1024  # "a few MB": smaller uploads finish before a bar is worth it

Advance = Callable[[int, int], None]
"""``advance(done, total)``: ``done`` of ``total`` units finished."""


def progress_enabled(*, as_json: bool = False) -> bool:
    """True when a progress display may be drawn (see the module docstring)."""
    if as_json or os.environ.get(ENV_NO_PROGRESS):
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def _noop(done: int, total: int) -> None:
    return None


@contextmanager
def progress_bar(description: str, *, enabled: bool, unit: str = "") -> Iterator[Advance]:
    """A transient bar on stderr; yields ``advance(done, total)``. ``unit="bytes"`` shows
    sizes and a transfer rate."""
    if not enabled:
        yield _noop
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )

    columns = [TextColumn("{task.description}"), BarColumn()]
    columns += [DownloadColumn(), TransferSpeedColumn()] if unit == "bytes" else [MofNCompleteColumn()]
    columns.append(TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=None)

        def advance(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield advance


@contextmanager
def spinner(description: str, *, enabled: bool) -> Iterator[None]:
    """A transient spinner with elapsed time on stderr, for work without a known total
    (loading a model)."""
    if not enabled:
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        bar.add_task(description, total=None)
        yield
