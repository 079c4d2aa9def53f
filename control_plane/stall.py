"""Cutting off streaming callers that stop reading: ``FetchAdapter`` and ``Generate``.

grpc's sync server sends a streamed response from the handler thread: after each message the
thread waits until the transport has taken it, and the transport stops taking messages when the
client stops reading (HTTP/2 flow control: measured with grpcio 1.85, a FetchAdapter reader
that stops after one chunk lets 5-17 MiB be buffered, then the thread blocks for good: no
server-side send timeout exists, and a client that set no deadline holds it forever). A
``Generate`` relay blocked that way also keeps its worker capacity. `StallWatchdog` gives the
threads back: one daemon thread that cancels (``RpcContext.cancel()``, the client sees
CANCELLED; the context's callbacks release what the call held) every watched call whose reader

- has not accepted the message being sent for ``stall_timeout_s`` (only time spent sending
  counts: a ``Generate`` waiting for its worker's next token is not stalled), or
- (when a minimum rate is set, `FetchAdapter`) stays slower than `MIN_RATE_BYTES_S` once
  `GRACE_S` has passed (a reader that takes one chunk every few seconds would otherwise hold
  a permit for hours on a large adapter).

Cancelling fails the pending send, so the handler's generator is closed at its ``yield`` and
the thread returns to the pool (measured: within one watchdog tick).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import grpc
import structlog

log = structlog.get_logger("loraplane.control_plane.stall")

MIN_RATE_BYTES_S = 256 * 1024
"""Slowest accepted average reading rate after `GRACE_S` (bytes/s): 87 MB in under 6 minutes."""
GRACE_S = 30.0
"""Seconds a fetch may take before `MIN_RATE_BYTES_S` applies."""


T = TypeVar("T")


class _Watched:
    __slots__ = ("context", "what", "started", "sending", "sent", "cut")

    def __init__(self, context: grpc.RpcContext, what: str, now: float) -> None:
        self.context = context
        self.what = what
        self.started = now
        self.sending: float | None = None  # monotonic time the message being sent was handed over
        self.sent = 0
        self.cut = ""


class StallWatchdog:
    """Cancels watched streaming calls whose reader stalls (see the module docstring).

    Args:
        stall_timeout_s: longest wait for the reader to accept one message, seconds.
        min_rate_bytes_s / grace_s: the slowest average rate tolerated after ``grace_s``
            (bytes/s; 0 turns the rate rule off).
        kind: ``adapter_fetch`` or ``generate``: the cut-off call's log event
            (``adapter_fetch_cut_off`` / ``generate_cut_off``) and the thread's name.

    The checking thread runs only while some call is watched (it exits when none is), so a
    process with many control planes (tests) keeps no idle threads.
    """

    def __init__(
        self,
        stall_timeout_s: float,
        *,
        min_rate_bytes_s: float = MIN_RATE_BYTES_S,
        grace_s: float = GRACE_S,
        kind: str = "adapter_fetch",
    ) -> None:
        if stall_timeout_s <= 0:
            raise ValueError(f"{kind} stall timeout must be > 0 seconds, got {stall_timeout_s}")
        self.kind = kind
        self.stall_timeout_s = stall_timeout_s
        self.min_rate_bytes_s = min_rate_bytes_s
        self.grace_s = grace_s
        self.tick_s = min(1.0, stall_timeout_s / 4)
        self.cut_off = 0
        """Calls cancelled so far (tests and logs)."""
        self._lock = threading.Lock()
        self._calls: dict[int, _Watched] = {}
        self._thread: threading.Thread | None = None

    def stream(
        self, context: grpc.RpcContext, pieces: Iterable[T], what: str, size: Callable[[Any], int] = len
    ) -> Iterator[T]:
        """``pieces`` passed through, the call cancelled when its reader stalls.

        A piece counts as being sent from its ``yield`` until the caller (grpc, once the
        transport took it) asks for the next one; ``size(piece)`` bytes are then counted for
        the rate rule.
        """
        watched = _Watched(context, what, time.monotonic())
        with self._lock:
            self._calls[id(watched)] = watched
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self.kind}-watchdog", daemon=True)
                self._thread.start()
        it = iter(pieces)
        try:
            for piece in it:
                watched.sending = time.monotonic()
                yield piece
                watched.sending = None
                watched.sent += size(piece)
        finally:
            with self._lock:
                self._calls.pop(id(watched), None)
            close = getattr(it, "close", None)
            if close is not None:  # a store reader holding a file or a database cursor
                close()

    def _verdict(self, w: _Watched, now: float) -> str:
        sending = w.sending
        if sending is not None and now - sending > self.stall_timeout_s:
            return f"the reader accepted nothing for {now - sending:.1f}s (limit {self.stall_timeout_s:g}s)"
        if self.min_rate_bytes_s <= 0:
            return ""
        elapsed = now - w.started
        if elapsed > self.grace_s + w.sent / self.min_rate_bytes_s:
            return (
                f"{w.sent} bytes read in {elapsed:.1f}s, slower than {self.min_rate_bytes_s:g} bytes/s "
                f"after {self.grace_s:g}s"
            )
        return ""

    def _run(self) -> None:
        while True:
            time.sleep(self.tick_s)
            now = time.monotonic()
            with self._lock:
                if not self._calls:
                    self._thread = None
                    return
                doomed = []
                for key, w in list(self._calls.items()):
                    reason = self._verdict(w, now)
                    if reason:
                        w.cut = reason
                        doomed.append(w)
                        del self._calls[key]
            for w in doomed:
                self.cut_off += 1
                if self.kind == "generate":
                    log.warning("generate_cut_off", request_id=w.what, reason=w.cut, bytes_sent=w.sent)
                else:
                    log.warning("adapter_fetch_cut_off", call=w.what, reason=w.cut, bytes_sent=w.sent)
                w.context.cancel()
