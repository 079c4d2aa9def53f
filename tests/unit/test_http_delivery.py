"""A streaming HTTP client that stops reading is cut after the write timeout even when the
kernel buffers take every write (on loopback the send buffer alone grows to 4 MiB): the relay
watches the bytes the client acknowledges (``control_plane.http.delivery``).

The real HTTP server (uvicorn with the control plane's protocol) on a loopback port serves a
`RelayResponse` of a generation that never ends by itself (``endless_stream``: ~150-byte SSE
chunks, 1 ms apart, 10 000 of them); the clients are raw sockets with a 4 KiB receive buffer.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from control_plane.http.server import HttpServer
from control_plane.http.streaming import RelayResponse
from tests.helpers.http_fakes import endless_stream
from tests.helpers.live_servers import wait_until

WRITE_TIMEOUT_S = 0.3


@pytest.fixture
def relay_server():
    """``(port, consumed, released)``: each request relays one endless generation."""
    consumed: list[int] = []
    released = threading.Event()

    async def app(scope, receive, send):
        assert scope["type"] == "http"
        response = RelayResponse(endless_stream(consumed, released), sse=True, write_timeout_s=WRITE_TIMEOUT_S)
        await response(scope, receive, send)

    server = HttpServer(app, "127.0.0.1:0")
    port = server.start()
    yield port, consumed, released
    server.stop()


def _connect(port: int) -> socket.socket:
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", port))
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Length: 0\r\n\r\n")
    return client


def test_a_client_that_never_reads_is_cut_though_the_buffers_take_every_write(relay_server):
    port, consumed, released = relay_server
    client = _connect(port)
    try:
        # the write timeout + sampling; the generation would run ~10 s and ~1.5 MB (all buffered)
        assert released.wait(WRITE_TIMEOUT_S + 4), len(consumed)
        assert len(consumed) < 10_000
        client.settimeout(5)
        with pytest.raises(ConnectionResetError):  # reset: a close would wait for a reader
            while client.recv(65536):
                pass
    finally:
        client.close()


@pytest.mark.slow  # 2 s of reading
def test_a_slow_client_that_keeps_reading_is_not_cut(relay_server):
    port, consumed, released = relay_server
    client = _connect(port)
    try:
        end = time.monotonic() + 4 * WRITE_TIMEOUT_S
        while time.monotonic() < end:
            assert client.recv(4096)
            time.sleep(WRITE_TIMEOUT_S / 5)
        assert not released.is_set()
        assert wait_until(lambda: len(consumed) > 0, 1)
    finally:
        client.close()
