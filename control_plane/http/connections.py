"""What an open TCP connection may cost an HTTP listener before it asks for anything.

Each listener (the API on ``--http-addr``, ``/health`` and ``/metrics`` on ``--metrics-addr``)
has one `ConnectionGuard`, consulted by uvicorn's h11 protocol subclassed (`GuardedH11Protocol`,
built by `guarded_protocol`): a connection cap (`MAX_CONNECTIONS`), a per-client cap
(`MAX_CONNECTIONS_PER_CLIENT`), a request-head deadline (`HEAD_TIMEOUT_S`) shortened to
`HEAD_TIMEOUT_BUSY_S` past the high-water mark (`HIGH_WATER` of the cap). Refusals are counted
per reason and logged at most once a second; `ConnectionCollector` hands the counts to
`control_plane.metrics` at scrape time. Every method runs on the listener's event loop thread;
the scrape thread reads the counters without a lock (ints: at worst one scrape behind).

The limits, their flags and why each exists: docs/http-api.md, "Input limits" (Connections).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from control_plane.http.delivery import TRANSPORT_EXTENSION

log = structlog.get_logger("loraplane.control_plane.http.connections")

MAX_CONNECTIONS = 1024
"""Default open connections of the API listener (``--http-max-connections``)."""
MAX_CONNECTIONS_PER_CLIENT = 256
"""Default open connections per client address on the API listener
(``--http-max-connections-per-client``): a quarter of the default cap, room for a batch client
running hundreds of concurrent streams."""
HEAD_TIMEOUT_S = 30.0
"""Seconds a connection may stay open without a complete request head (``--http-head-timeout``)."""
HEAD_TIMEOUT_BUSY_S = 2.0
"""The head deadline in busy mode (``--http-head-timeout-busy``): a client that connects sends its
request head within milliseconds, a proxy's pooled connection reconnects."""
HIGH_WATER = 0.75
"""Busy mode starts when the open connections reach this fraction of the cap."""
SWEEP_INTERVAL_S = 0.25
"""In busy mode, the connections already open are swept (deadlines shortened, the overdue
closed) at most this often: a flood of N connections costs O(N) per sweep, not O(N²)."""

REFUSED_MAX_CONNECTIONS = "max_connections"
REFUSED_PER_CLIENT = "max_connections_per_client"


@dataclass
class ConnectionGuard:
    """One listener's connection limits and counts (see the module docstring).

    Args:
        listener: the name metrics and logs give the listener ("http", "metrics").
        max_connections: open connections (≥ 1).
        max_connections_per_client: open connections per peer address (0: no limit).
        head_timeout_s: seconds to a complete request head (> 0).
        head_timeout_busy_s: the same in busy mode (> 0; capped at ``head_timeout_s``).

    Raises:
        ValueError: a limit out of range.
    """

    listener: str = "http"
    max_connections: int = MAX_CONNECTIONS
    max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT
    head_timeout_s: float = HEAD_TIMEOUT_S
    head_timeout_busy_s: float = HEAD_TIMEOUT_BUSY_S
    open: int = 0
    """Connections accepted and not yet closed."""
    refused: dict[str, int] = field(default_factory=lambda: {REFUSED_MAX_CONNECTIONS: 0, REFUSED_PER_CLIENT: 0})
    """Connections reset at once, by the limit they met."""
    head_timeouts: int = 0
    """Connections closed for want of a request head (either deadline)."""
    per_client: dict[str, int] = field(default_factory=dict)
    """Open connections per peer address (addresses with none are dropped)."""
    _swept_at: float = -math.inf
    _sweep_pending: asyncio.TimerHandle | None = None
    _logged_at: float = -math.inf
    _unlogged: int = 0

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.max_connections_per_client < 0:
            raise ValueError(f"max_connections_per_client must be >= 0, got {self.max_connections_per_client}")
        timeouts = (self.head_timeout_s, self.head_timeout_busy_s)
        if not all(math.isfinite(t) and t > 0 for t in timeouts):
            raise ValueError(f"head timeouts must be finite and > 0, got {timeouts}")
        self.head_timeout_busy_s = min(self.head_timeout_busy_s, self.head_timeout_s)

    @property
    def high_water(self) -> int:
        """Open connections at which busy mode starts."""
        return max(1, math.ceil(self.max_connections * HIGH_WATER))

    @property
    def busy(self) -> bool:
        """Whether the open connections are at or past the high-water mark."""
        return self.open >= self.high_water

    def head_timeout(self) -> float:
        """The head deadline (seconds) for a connection armed now."""
        return self.head_timeout_busy_s if self.busy else self.head_timeout_s

    def admit(self, client: str | None) -> str | None:
        """Count a new connection from ``client`` (peer address; None: unknown) in, or say which
        limit refuses it (`REFUSED_MAX_CONNECTIONS` / `REFUSED_PER_CLIENT`; counted and logged)."""
        if self.open >= self.max_connections:
            return self._refuse(REFUSED_MAX_CONNECTIONS, client, self.max_connections)
        if client is not None and self.max_connections_per_client:
            held = self.per_client.get(client, 0)
            if held >= self.max_connections_per_client:
                return self._refuse(REFUSED_PER_CLIENT, client, self.max_connections_per_client)
            self.per_client[client] = held + 1
        self.open += 1
        return None

    def release(self, client: str | None) -> None:
        """Count an admitted connection from ``client`` out."""
        self.open -= 1
        if client is not None and self.max_connections_per_client:
            held = self.per_client.get(client, 0) - 1
            if held > 0:
                self.per_client[client] = held
            else:
                self.per_client.pop(client, None)

    def sweep_delay(self, now: float) -> float | None:
        """Seconds until busy mode may sweep the open connections (0.0: now, and the sweep is
        counted as done), or None when not busy or a deferred sweep is already scheduled.
        Sweeps run at most every `SWEEP_INTERVAL_S` seconds of ``now`` (loop time); one asked
        for sooner is deferred, not dropped: connections admitted below the mark with the long
        deadline, while closes kept the count under it, are still shortened once it is passed."""
        if not self.busy or self._sweep_pending is not None:
            return None
        wait = self._swept_at + SWEEP_INTERVAL_S - now
        if wait > 0:
            return wait
        self._swept_at = now
        return 0.0

    def _refuse(self, reason: str, client: str | None, limit: int) -> str:
        self.refused[reason] += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= 1.0:
            log.warning(
                "http_connection_refused",
                listener=self.listener,
                reason=reason,
                limit=limit,
                client=client,
                open=self.open,
                refused_since_last_log=self._unlogged,
            )
            self._logged_at = now
            self._unlogged = 0
        return reason


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a `ConnectionGuard` (the class attribute ``guard``, set per
    listener by `guarded_protocol`): refused connections are reset in ``connection_made``,
    admitted ones get a head deadline, armed again after each response. Each request's scope
    carries the connection's transport (``scope["extensions"]``, `TRANSPORT_EXTENSION`: how far
    the client has read, ``control_plane.http.delivery``)."""

    guard: ConnectionGuard = ConnectionGuard()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._admitted = False
        self._head_deadline: asyncio.TimerHandle | None = None
        self._idle_since = 0.0
        self._idle_cycle: RequestResponseCycle | None = None
        self._client_host = self.client[0] if self.client else None
        if self.guard.admit(self._client_host) is not None:
            transport.abort()
            return
        self._admitted = True
        self._arm_head_deadline()
        delay = self.guard.sweep_delay(self.loop.time())
        if delay is not None:
            args = (self.guard, self.connections, self.loop)
            if delay == 0.0:
                _sweep(*args)
            else:
                self.guard._sweep_pending = self.loop.call_later(delay, _deferred_sweep, *args)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None:  # the response watches the connection's TCP state (http.delivery)
            self.cycle.scope.setdefault("extensions", {})[TRANSPORT_EXTENSION] = {"transport": self.transport}

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_admitted", False):
            self._admitted = False
            self.guard.release(self._client_host)
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _cancel_head_deadline(self) -> None:
        deadline = getattr(self, "_head_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._head_deadline = None

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        self._idle_since = self.loop.time()
        self._idle_cycle = self.cycle
        self._head_deadline = self.loop.call_later(self.guard.head_timeout(), self._head_deadline_passed)

    def _idle(self) -> bool:
        """No request in progress since the deadline was armed (a partial head counts as none)."""
        cycle = self._idle_cycle
        return (
            self._head_deadline is not None
            and self.cycle is cycle
            and (cycle is None or cycle.response_complete)
            and not self.transport.is_closing()
        )

    def _shorten_head_deadline(self, now: float, timeout_s: float) -> None:
        """Busy mode reached: an idle connection's deadline becomes ``timeout_s`` from when it
        went idle (past already: closed now)."""
        if not self._idle():
            return
        due = self._idle_since + timeout_s
        if due <= now:
            self._close_idle()
        elif self._head_deadline is not None and self._head_deadline.when() > due:
            self._head_deadline.cancel()
            self._head_deadline = self.loop.call_at(due, self._head_deadline_passed)

    def _head_deadline_passed(self) -> None:
        if self._idle():
            self._close_idle()
        self._head_deadline = None

    def _close_idle(self) -> None:
        self._cancel_head_deadline()
        self.guard.head_timeouts += 1
        self.transport.close()


def _sweep(guard: ConnectionGuard, connections: set, loop: asyncio.AbstractEventLoop) -> None:
    """Busy mode's sweep: every idle connection of the listener (``connections``: uvicorn's
    server-wide set) gets the busy head deadline from when it went idle; the overdue close now."""
    now = loop.time()
    for conn in list(connections):
        if isinstance(conn, GuardedH11Protocol):
            conn._shorten_head_deadline(now, guard.head_timeout_busy_s)


def _deferred_sweep(guard: ConnectionGuard, connections: set, loop: asyncio.AbstractEventLoop) -> None:
    """A sweep `ConnectionGuard.sweep_delay` deferred: run it if the listener is still busy."""
    guard._sweep_pending = None
    if guard.busy:
        guard._swept_at = loop.time()
        _sweep(guard, connections, loop)


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """A `GuardedH11Protocol` class bound to ``guard`` (each listener its own)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})


class ConnectionCollector:
    """Prometheus collector over listeners' guards, read at scrape time:

    * ``loraplane_http_connections_open{listener}``: connections accepted and not closed;
    * ``loraplane_http_connections_refused_total{listener, reason}``: reset at once, ``reason``
      ``max_connections`` or ``max_connections_per_client``;
    * ``loraplane_http_head_timeouts_total{listener}``: closed for want of a request head.

    ``guards`` may grow after registration (listeners start one after the other).
    """

    def __init__(self, guards: list[ConnectionGuard]) -> None:
        self.guards = guards

    def collect(self) -> Iterator[Metric]:
        opened = GaugeMetricFamily(
            "loraplane_http_connections_open", "Open HTTP connections by listener.", labels=["listener"]
        )
        refused = CounterMetricFamily(
            "loraplane_http_connections_refused",
            "HTTP connections reset at once, by listener and the limit they met.",
            labels=["listener", "reason"],
        )
        timeouts = CounterMetricFamily(
            "loraplane_http_head_timeouts",
            "HTTP connections closed without a complete request head in time, by listener.",
            labels=["listener"],
        )
        for g in list(self.guards):
            opened.add_metric([g.listener], g.open)
            for reason, n in list(g.refused.items()):
                refused.add_metric([g.listener, reason], n)
            timeouts.add_metric([g.listener], g.head_timeouts)
        yield from (opened, refused, timeouts)
