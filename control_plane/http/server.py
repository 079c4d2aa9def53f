"""uvicorn on its own thread, beside the gRPC server.

Threading: uvicorn's event loop runs on one daemon thread (``loraplane-http``; the listener for
``/health`` and ``/metrics`` on ``--metrics-addr`` has its own, ``loraplane-metrics``); the
generation routes are sync functions that FastAPI runs on anyio's worker threads (40 by
default), where they block on ``Router.generate`` like the gRPC handlers do on gRPC's pool.
The listening socket is bound here, in the caller's thread, before the loop starts, so a busy
port fails ``start()`` at once and port 0 reports the port it got. uvicorn installs no signal
handlers off the main thread; ``stop()`` asks it to exit and joins.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from control_plane.http.connections import (
    HEAD_TIMEOUT_BUSY_S,
    HEAD_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_CLIENT,
    ConnectionGuard,
    guarded_protocol,
)
from loraplane.metrics import split_host_port


class HttpServer:
    """``start()`` → bound port; ``stop()`` finishes in-flight responses for up to 5 s.

    The socket is bound at construction (``addr``: ``host:port``, port 0 for any free one).
    Connections are guarded (`connections.ConnectionGuard`, ``self.guard``): at most
    ``max_connections`` open, ``max_connections_per_client`` per peer address (0: no limit), a
    request head due within ``head_timeout_s`` seconds, ``head_timeout_busy_s`` once the open
    connections reach 3/4 of the cap. ``listener`` names it in metrics, logs and its thread.

    Raises:
        OSError: ``addr`` cannot be bound; ValueError: a limit out of range.
    """

    def __init__(
        self,
        app,
        addr: str,
        *,
        listener: str = "http",
        max_connections: int = MAX_CONNECTIONS,
        max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT,
        head_timeout_s: float = HEAD_TIMEOUT_S,
        head_timeout_busy_s: float = HEAD_TIMEOUT_BUSY_S,
    ) -> None:
        self.addr = addr
        self.guard = ConnectionGuard(
            listener=listener,
            max_connections=max_connections,
            max_connections_per_client=max_connections_per_client,
            head_timeout_s=head_timeout_s,
            head_timeout_busy_s=head_timeout_busy_s,
        )
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
        self.protocol = guarded_protocol(self.guard)
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
            target=self._server.run, kwargs={"sockets": [self._sock]}, name=f"loraplane-{listener}", daemon=True
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
