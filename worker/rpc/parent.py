"""A worker started by ``loraplane serve`` stops when ``serve`` dies, however it dies.

``serve`` creates a pipe for each worker it starts, keeps the write end (never inherited by
anything else: Python's pipes are close-on-exec) and passes the read end to the worker, naming
its number in ``$LORAPLANE_PARENT_FD``. Nothing is ever written: the worker's watch thread
blocks in ``read`` and gets end-of-file exactly when the last holder of the write end is gone,
that is when the ``serve`` process exited — a clean exit, a crash or ``kill -9`` alike. The
worker then stops at once (no drain: the control plane that relayed its streams died with
``serve``), so it never outlives its parent to heartbeat a later ``serve``'s control plane
from the port that ``serve``'s own worker needs.

Why a pipe and not ``prctl(PR_SET_PDEATHSIG)``: the parent-death signal fires when the *thread*
that forked the child exits, and ``serve`` starts (and restarts) its worker from a supervisor
thread; it also needs a ``getppid`` check to close the fork race. The pipe follows the process.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import structlog

from loraplane.env import ENV_PARENT_FD

log = structlog.get_logger("loraplane.worker.rpc.parent")

EXIT_FALLBACK_S = 10.0
"""After the parent died, seconds the orderly stop may take before the process exits hard."""
EXIT_CODE_PARENT_GONE = 3
"""Exit status of a worker that stopped hard because its parent died."""


class ParentWatch:
    """Watches the pipe from ``$LORAPLANE_PARENT_FD`` on a daemon thread.

    Attributes:
        on_parent_death: called once on the watch thread when the parent is gone; until the
            worker replaces it (``serve_worker`` does, with "stop now"), it ends the process
            at once (the model may still be loading). Whatever it is, the process exits with
            `EXIT_CODE_PARENT_GONE` if it is still alive `EXIT_FALLBACK_S` seconds later.
        parent_gone: set when end-of-file was read.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.parent_gone = threading.Event()
        self.on_parent_death: Callable[[], None] = _exit_now
        self._thread = threading.Thread(target=self._run, name="parent-watch", daemon=True)

    def start(self) -> ParentWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass  # nothing is written; bytes would only be ignored
        except OSError as exc:
            log.warning("parent_watch_failed", fd=self.fd, error=str(exc))
            return
        self.parent_gone.set()
        log.warning("parent_died_stopping", parent_fd=self.fd)
        timer = threading.Timer(EXIT_FALLBACK_S, _exit_now)
        timer.daemon = True
        timer.start()
        try:
            self.on_parent_death()
        except BaseException:  # noqa: BLE001 - whatever happens, the process must go
            _exit_now()


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
