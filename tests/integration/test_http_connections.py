"""Connections that hold the HTTP front without asking for anything, over real sockets against
`HttpServer` (uvicorn with `GuardedH11Protocol`) and `BodySizeLimit`: idle sockets and trickled
request heads are closed after the head deadline, connections past the cap are closed at once,
a trickled body is answered 408; a request in progress is never cut by these guards."""

from __future__ import annotations

import json
import socket
import time

import anyio
import pytest
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse

from loraplane.control_plane.http.app import BodySizeLimit
from loraplane.control_plane.http.errors import install_error_handlers
from loraplane.control_plane.http.server import HttpServer

pytestmark = pytest.mark.slow  # timers of 0.5-1.5 s: seconds of waiting, kept off the fast tier


async def echo(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"bytes": len(body)})


async def slow(_request: Request) -> JSONResponse:
    await anyio.sleep(1.5)  # longer than the head deadline below
    return JSONResponse({"slow": True})


def start(**kw) -> HttpServer:
    """The guards as `create_app` installs them, over two routes (body limit 1 MiB, body
    deadline 1 s)."""
    app = FastAPI()
    install_error_handlers(app)
    app.add_api_route("/echo", echo, methods=["POST"])
    app.add_api_route("/slow", slow)
    app.add_middleware(BodySizeLimit, max_bytes=1 << 20, body_timeout_s=1.0)
    server = HttpServer(app, "127.0.0.1:0", **kw)
    server.start()
    return server


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the server closes ``sock`` within ``seconds`` (EOF or reset)."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def get(port: int, path: str) -> dict:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return json.loads(body)


def test_idle_and_trickled_heads_are_closed_but_slow_requests_are_not():
    server = start(head_timeout_s=0.5)
    try:
        idle = socket.create_connection(("127.0.0.1", server.port))
        trickle = socket.create_connection(("127.0.0.1", server.port))
        t0 = time.monotonic()
        for ch in b"GET /slow HTTP/1.1\r\nHo":
            trickle.sendall(bytes([ch]))
            time.sleep(0.02)
        assert closed_within(idle, 10.0) and closed_within(trickle, 10.0)
        assert time.monotonic() - t0 < 10.0
        assert get(server.port, "/slow") == {"slow": True}  # 1.5 s in progress: not cut at 0.5 s
    finally:
        server.stop()


def test_connections_past_the_cap_are_closed_at_once():
    server = start(max_connections=4, head_timeout_s=30.0)
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    try:
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", server.port))
        assert closed_within(extra, 5.0)
        assert server.protocol.refused >= 1
        for s in held:
            s.close()
        time.sleep(0.2)
        assert get(server.port, "/slow") == {"slow": True}
    finally:
        for s in held:
            s.close()
        server.stop()


def test_a_trickled_body_is_408_in_openai_shape():
    server = start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), head
        assert json.loads(body)["error"]["code"] == "request_timeout"
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            assert data.startswith(b"HTTP/1.1 200") and data.endswith(b'{"bytes":3}'), data
    finally:
        server.stop()
