"""Child-process plumbing shared by ``serve``, the bench and the tests."""

from __future__ import annotations

import signal
import subprocess


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
