"""The worker's last-resort stop: the kernel ends the process at a deadline, whatever its
threads are doing.

Every orderly way a worker stops (the drain's end, a second signal, ``serve`` dying) runs
Python code on some thread, and each of them can be held up for good by something else in the
process: a thread blocked writing a log line to a stderr pipe that nobody reads any more (a
log shipper that stalled, ``serve``'s output piped into a reader that stopped: the signal
handler and the parent watch then block in their own log call before they act), a lock that is
never released, a non-daemon thread that never returns at interpreter exit. A timer thread
calling ``os._exit`` shares those hazards (it needs the interpreter lock, and the thread that
would start it may be the one that is stuck).

`arm` hands the deadline to the kernel instead (``setitimer(ITIMER_REAL)``): when it expires
the kernel delivers SIGALRM, whose default action terminates the process without running any
of its code (exit status -14 from ``Popen``, 142 in a shell). `install` makes sure SIGALRM is
at that default action; nothing else in a worker uses SIGALRM or the real-time interval timer.
"""

from __future__ import annotations

import signal

STOP_GRACE_S = 5.0
"""Seconds an orderly stop may take (closing the gRPC server and the engine, leaving the
interpreter) before the kernel ends the process: after the drain timeout, and after a second
signal or the parent's death (which stop at once)."""


def install() -> None:
    """Set SIGALRM to its default action (terminate); main thread only (`signal.signal`)."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)


def remaining() -> float:
    """Seconds until the armed deadline; 0.0 when none is armed."""
    return signal.getitimer(signal.ITIMER_REAL)[0]


def arm(seconds: float) -> None:
    """Make the kernel end this process ``seconds`` from now at the latest (any thread, signal
    handlers included; an earlier deadline already armed is kept).

    Lock-free on purpose, since a signal handler may run while its own thread is inside this
    call: two threads arming at the same instant may leave the later of their two deadlines.

    Raises:
        ValueError: ``seconds`` is not positive.
    """
    if not seconds > 0:
        raise ValueError(f"a stop deadline must be > 0 seconds, got {seconds}")
    left = remaining()
    if 0 < left <= seconds:
        return
    signal.setitimer(signal.ITIMER_REAL, seconds)


__all__ = ["STOP_GRACE_S", "arm", "install", "remaining"]
