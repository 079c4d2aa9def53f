"""A worker started by ``loraplane serve`` stops when ``serve`` dies, however it dies.

`watch_parent_from_env` starts a `ParentWatch` when ``$LORAPLANE_PARENT_FD`` names the read end
of a pipe whose write end only ``serve`` holds: its thread blocks in ``read`` until end-of-file
(``serve`` exited: a clean exit, a crash or ``kill -9`` alike), and also checks every
`REPARENT_CHECK_S` whether the worker was re-parented. The worker then stops at once, with no
drain, and exits `EXIT_CODE_PARENT_GONE`; before anything else, logging included, the watch
hands the kernel a deadline of `STOP_GRACE_S` (`worker.rpc.deadline`).

Why a pipe (and not ``PR_SET_PDEATHSIG``), and why the re-parent check: docs/operations.md,
"``serve``".
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable

import structlog

from loraplane.env import ENV_PARENT_FD
from worker.rpc.deadline import STOP_GRACE_S, arm

log = structlog.get_logger("loraplane.worker.rpc.parent")

EXIT_CODE_PARENT_GONE = 3
"""Exit status of a worker that stopped hard because its parent died."""
REPARENT_CHECK_S = 0.5
"""Seconds between two checks of the parent's pid while the pipe stays silent."""


class ParentWatch:
    """Watches the pipe from ``$LORAPLANE_PARENT_FD`` on a daemon thread.

    Attributes:
        on_parent_death: called once on the watch thread when the parent is gone; until the
            worker replaces it (``serve_worker`` does, with "stop now"), it ends the process
            at once with `EXIT_CODE_PARENT_GONE` (the model may still be loading). Whatever it
            is, the kernel ends the process `STOP_GRACE_S` seconds later if it still lives.
        parent_gone: set when the parent is seen gone (end-of-file, or re-parented).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.parent_pid = os.getppid()
        self.parent_gone = threading.Event()
        self.on_parent_death: Callable[[], None] = _exit_now
        self._thread = threading.Thread(target=self._run, name="parent-watch", daemon=True)

    def start(self) -> ParentWatch:
        self._thread.start()
        return self

    def _wait_gone(self) -> str:
        """Block until the parent is gone; returns how that was seen."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)  # end of file reads as POLLHUP, always reported
        while True:
            if poller.poll(REPARENT_CHECK_S * 1000) and not os.read(self.fd, 4096):  # bytes are ignored
                return "end of file"
            if os.getppid() != self.parent_pid:
                return "re-parented"

    def _run(self) -> None:
        try:
            how = self._wait_gone()
        except OSError as exc:
            log.warning("parent_watch_failed", fd=self.fd, error=str(exc))
            return
        self.parent_gone.set()
        arm(STOP_GRACE_S)  # first: anything below may block for good (a log line)
        try:
            self.on_parent_death()
        except BaseException:  # noqa: BLE001 - whatever happens, the process must go
            _exit_now()
        log.warning("parent_died_stopping", parent_fd=self.fd, parent_pid=self.parent_pid, seen=how)


def _exit_now() -> None:
    os._exit(EXIT_CODE_PARENT_GONE)


def watch_parent_from_env(environ: dict[str, str] | None = None) -> ParentWatch | None:
    """Start a `ParentWatch` on the fd named by ``$LORAPLANE_PARENT_FD`` (removed from the
    environment so that nothing this process starts inherits the duty); None when unset.

    Raises:
        ValueError: the variable is set but not a file descriptor number.
    """
    env = os.environ if environ is None else environ
    value = env.pop(ENV_PARENT_FD, None)
    if not value:
        return None
    try:
        fd = int(value)
    except ValueError:
        raise ValueError(f"${ENV_PARENT_FD}={value!r} is not a file descriptor number") from None
    return ParentWatch(fd).start()


__all__ = ["EXIT_CODE_PARENT_GONE", "ParentWatch", "watch_parent_from_env"]
