"""Child-process plumbing shared by ``serve``, the bench and the tests."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

IMPORT_ROOT = Path(__file__).resolve().parent.parent
"""The directory that holds the product's packages (``loraplane``, ``control_plane``, ``worker``,
``clients``, ``bench``): a checkout's root, or ``site-packages`` of an installed wheel. Children
started with ``python -m clients.cli ...`` get it on ``PYTHONPATH``
(so a checkout runs without an install) and may run with it as their working directory; never
a folder inside the package, whose ``logging.py`` would shadow the standard library's."""


def cli_module(checkout: Path) -> str:
    """The CLI's module in ``checkout`` for ``python -m``: ``clients.cli`` (the package
    ``clients/cli/``, run by its ``__main__``; in checkouts before it, the module
    ``clients/cli.py``), or, in a checkout from
    the time ``clients/`` was linked into ``loraplane/`` (the bench's before/after runs),
    ``loraplane.clients.cli``."""
    if (checkout / "loraplane" / "clients").is_dir():
        return "loraplane.clients.cli"
    return "clients.cli"


def child_pythonpath(env: dict[str, str]) -> str:
    """``PYTHONPATH`` for a child Python process: :data:`IMPORT_ROOT`, then ``env``'s own entries."""
    return os.pathsep.join(p for p in (str(IMPORT_ROOT), env.get("PYTHONPATH", "")) if p)


def stop_process(proc: subprocess.Popen | None, grace_s: float = 20.0) -> int | None:
    """Stop ``proc`` politely: SIGTERM, wait up to ``grace_s`` seconds, then SIGKILL.

    Only ``proc`` itself is signalled (by pid), never its process group. An interrupt while
    waiting escalates to SIGKILL at once.

    Returns:
        The exit code (negative: the signal that ended it), or None when ``proc`` is None.
    """
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.kill()
            proc.wait()
    return proc.returncode
