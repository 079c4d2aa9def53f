"""uvicorn on its own thread, beside the gRPC server.

Threading: uvicorn's event loop runs on one daemon thread (``loraplane-http``); the
generation routes are sync functions that FastAPI runs on anyio's worker threads (40 by
default), where they block on ``Router.generate`` like the gRPC handlers do on gRPC's pool.
The listening socket is bound here, in the caller's thread, before the loop starts, so a busy
port fails ``start()`` at once and port 0 reports the port it got. uvicorn installs no signal
handlers off the main thread; ``stop()`` asks it to exit and joins.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import structlog
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from loraplane.control_plane.http.delivery import TRANSPORT_EXTENSION
from loraplane.metrics import split_host_port

log = structlog.get_logger("loraplane.control_plane.http.server")

HEAD_TIMEOUT_S = 30.0
"""Seconds a connection may stay open without a complete request head: from its opening, or
from its previous response (uvicorn's keep-alive timer closes idle connections only after a
first response, and not one that trickles bytes)."""
MAX_CONNECTIONS = 1024
"""Default open HTTP connections (``--http-max-connections``); past it new ones are closed at
once, before they cost a file descriptor for long."""


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with two guards against connections that hold resources without
    asking for anything (idle sockets, headers trickled a byte at a time), and the connection's
    transport in each request's scope (``scope["extensions"]``, `TRANSPORT_EXTENSION`: how far
    the client has read, ``loraplane.control_plane.http.delivery``):

    * a head deadline (`head_timeout_s`): a connection with no request in progress that has
      not completed a request head within the deadline of opening (or of its last response)
      is closed;
    * a connection cap (`max_connections`): a connection opened while the server holds that
      many is closed at once (counted, logged at most once per second).

    Class attributes are set per server by `guarded_protocol`.
    """

    head_timeout_s: float = HEAD_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    _refused_logged_at = 0.0
    refused = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            cls = type(self)
            cls.refused += 1
            now = time.monotonic()
            if now - cls._refused_logged_at > 1.0:
                cls._refused_logged_at = now
                log.warning("http_connection_refused", open=len(self.connections), limit=self.max_connections)
            transport.abort()
            return
        self._arm_head_deadline()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None:  # the response watches the connection's TCP state (http.delivery)
            self.cycle.scope.setdefault("extensions", {})[TRANSPORT_EXTENSION] = {"transport": self.transport}

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        deadline = getattr(self, "_head_deadline", None)
        if deadline is not None:
            deadline.cancel()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        if getattr(self, "_head_deadline", None) is not None:
            self._head_deadline.cancel()  # type: ignore[union-attr]
        self._head_deadline = self.loop.call_later(self.head_timeout_s, self._head_deadline_passed, self.cycle)

    def _head_deadline_passed(self, cycle) -> None:
        self._head_deadline = None
        idle = self.cycle is cycle and (cycle is None or cycle.response_complete)
        if idle and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(head_timeout_s: float, max_connections: int) -> type[GuardedH11Protocol]:
    """A `GuardedH11Protocol` class with these limits (each server its own)."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"head_timeout_s": float(head_timeout_s), "max_connections": int(max_connections), "refused": 0},
    )


class HttpServer:
    """``start()`` → bound port; ``stop()`` finishes in-flight responses for up to 5 s.

    The socket is bound at construction (``addr``: ``host:port``, port 0 for any free one).
    Connections are guarded (`GuardedH11Protocol`): at most ``max_connections`` open, and a
    request head due within ``head_timeout_s``.

    Raises:
        OSError: ``addr`` cannot be bound.
    """

    def __init__(
        self, app, addr: str, *, max_connections: int = MAX_CONNECTIONS, head_timeout_s: float = HEAD_TIMEOUT_S
    ) -> None:
        self.addr = addr
        host, port = split_host_port(addr)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError:
            self._sock.close()
            raise
        self.port = int(self._sock.getsockname()[1])
        self.protocol = guarded_protocol(head_timeout_s, max_connections)
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            http=self.protocol,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="loraplane-http", daemon=True
        )

    def start(self, timeout_s: float = 10.0) -> int:
        """Start serving; the bound port once uvicorn is up.

        Raises:
            RuntimeError: uvicorn did not start within ``timeout_s`` seconds, or failed.
        """
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started and self._thread.is_alive():
            if time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server on {self.addr} did not start within {timeout_s:g}s")
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError(f"HTTP server on {self.addr} failed to start")
        return self.port

    def stop(self) -> None:
        """Ask uvicorn to exit, wait for its thread (up to 10 s) and close the socket."""
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
