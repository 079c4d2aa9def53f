"""Cutting off FetchAdapter readers that stall (``ControlPlane.FetchAdapter``).

grpc's sync server sends a streamed response from the handler thread: after each chunk the
thread waits until the transport has taken it, and the transport stops taking chunks when the
client stops reading (HTTP/2 flow control: measured with grpcio 1.85, a reader that stops
after one chunk lets 5-17 MiB be buffered, then the thread blocks for good: no server-side
send timeout exists, and a client that set no deadline holds it forever). The concurrency
cap (``max_fetches``) keeps such readers from taking more than their share of the pool;
`FetchWatchdog` gives the threads back: one daemon thread that cancels
(``RpcContext.cancel()``, the client sees CANCELLED) every watched call whose reader

- accepted no chunk for ``stall_timeout_s`` (the handler did not get control back), or
- stays slower than `MIN_RATE_BYTES_S` once `GRACE_S` has passed (a reader that takes one
  chunk every few seconds would otherwise hold a permit for hours on a large adapter).

Cancelling fails the pending send, so the handler's generator is closed at its ``yield`` and
the thread returns to the pool (measured: within one watchdog tick).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator

import grpc
import structlog

log = structlog.get_logger("loraplane.control_plane.fetch")

MIN_RATE_BYTES_S = 256 * 1024
"""Slowest accepted average reading rate after `GRACE_S` (bytes/s): 87 MB in under 6 minutes."""
GRACE_S = 30.0
"""Seconds a fetch may take before `MIN_RATE_BYTES_S` applies."""


class _Watched:
    __slots__ = ("context", "what", "started", "last", "sent", "cut")

    def __init__(self, context: grpc.RpcContext, what: str, now: float) -> None:
        self.context = context
        self.what = what
        self.started = now
        self.last = now
        self.sent = 0
        self.cut = ""


class FetchWatchdog:
    """Cancels watched streaming calls whose reader stalls (see the module docstring).

    Args:
        stall_timeout_s: longest wait for the reader to accept the next chunk, seconds.
        min_rate_bytes_s / grace_s: the slowest average rate tolerated after ``grace_s``.

    The checking thread runs only while some call is watched (it exits when none is), so a
    process with many control planes (tests) keeps no idle threads.
    """

    def __init__(
        self, stall_timeout_s: float, *, min_rate_bytes_s: float = MIN_RATE_BYTES_S, grace_s: float = GRACE_S
    ) -> None:
        if stall_timeout_s <= 0:
            raise ValueError(f"fetch stall timeout must be > 0 seconds, got {stall_timeout_s}")
        self.stall_timeout_s = stall_timeout_s
        self.min_rate_bytes_s = min_rate_bytes_s
        self.grace_s = grace_s
        self.tick_s = min(1.0, stall_timeout_s / 4)
        self.cut_off = 0
        """Calls cancelled so far (tests and logs)."""
        self._lock = threading.Lock()
        self._calls: dict[int, _Watched] = {}
        self._thread: threading.Thread | None = None

    def stream(self, context: grpc.RpcContext, pieces: Iterable[bytes], what: str) -> Iterator[bytes]:
        """``pieces`` passed through, the call cancelled when its reader stalls.

        Progress is noted each time the caller (grpc, after sending the previous piece) asks
        for the next one, so the time between two requests is the time one piece took to be
        accepted.
        """
        watched = _Watched(context, what, time.monotonic())
        with self._lock:
            self._calls[id(watched)] = watched
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fetch-watchdog", daemon=True)
                self._thread.start()
        it = iter(pieces)
        try:
            for piece in it:
                watched.last = time.monotonic()
                yield piece
                watched.sent += len(piece)
        finally:
            with self._lock:
                self._calls.pop(id(watched), None)
            close = getattr(it, "close", None)
            if close is not None:  # a store reader holding a file or a database cursor
                close()

    def _verdict(self, w: _Watched, now: float) -> str:
        if now - w.last > self.stall_timeout_s:
            return f"the reader accepted no chunk for {now - w.last:.1f}s (limit {self.stall_timeout_s:g}s)"
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
                log.warning("adapter_fetch_cut_off", call=w.what, reason=w.cut, bytes_sent=w.sent)
                w.context.cancel()
