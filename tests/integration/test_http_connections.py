"""Connections that hold the HTTP front without asking for anything, over real sockets against
`HttpServer` (uvicorn with `GuardedH11Protocol`) and `BodySizeLimit`: idle sockets and trickled
request heads are closed after the head deadline, connections past the cap are closed at once,
a trickled body is answered 408; a request in progress is never cut by these guards. Floods
come from several loopback addresses (127.0.0.2, .3, …: the client sockets are bound to them),
so the per-client cap is not what stops them: an idle flood past 3/4 of the cap is shed within
the busy head deadline, one address past its own cap is refused while another is served, and
a real control plane answers ``/health`` and ``/metrics`` on ``--metrics-addr`` while its API's
cap is full."""

from __future__ import annotations

import json
import logging
import select
import socket
import time

import anyio
import pytest
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse

from control_plane.http.app import BodySizeLimit
from control_plane.http.errors import install_error_handlers
from control_plane.http.server import HttpServer

pytestmark = pytest.mark.slow  # timers of 0.5-1.5 s: seconds of waiting, kept off the fast tier


async def echo(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"bytes": len(body)})


async def ok(_request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


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
    app.add_api_route("/ok", ok)
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


def none_closed(socks: list[socket.socket]) -> bool:
    """True when the server has closed none of ``socks`` (none readable: no EOF, no reset)."""
    readable, _, _ = select.select(socks, [], [], 0.05)
    return not readable


def connect(port: int, src: str = "127.0.0.1") -> socket.socket:
    """A TCP connection to 127.0.0.1:``port`` from the loopback address ``src``."""
    return socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(src, 0))


def get(port: int, path: str, src: str = "127.0.0.1") -> dict:
    with connect(port, src) as s:
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
        assert server.guard.refused == {"max_connections": 1, "max_connections_per_client": 0}
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


def test_an_idle_flood_is_shed_once_the_cap_is_three_quarters_full():
    server = start(max_connections=40)  # head deadline 30 s; 2 s from 30 open connections on
    early: list[socket.socket] = []
    flood: list[socket.socket] = []
    try:
        early = [connect(server.port, "127.0.0.2") for _ in range(5)]
        time.sleep(2.5)  # past the busy deadline, below the high-water mark: kept
        assert none_closed(early)
        t0 = time.monotonic()
        flood = [connect(server.port, f"127.0.0.{3 + i % 4}") for i in range(35)]  # 40 open: the cap
        # idle for > 2 s when the mark was passed: shed by the sweep the flood sets off, far before their
        # 30 s deadline (5 s: the server's loop may accept the flood late on a loaded machine)
        assert all(closed_within(s, 5.0) for s in early)
        assert all(closed_within(s, max(0.01, t0 + 10.0 - time.monotonic())) for s in flood)
        shed_s = time.monotonic() - t0
        assert 1.5 < shed_s < 10.0, shed_s  # their own 2 s, not the 30 s deadline
        assert server.guard.head_timeouts == 40 and server.guard.open == 0
        assert get(server.port, "/ok", "127.0.0.3") == {"ok": True}
    finally:
        for s in early + flood:
            s.close()
        server.stop()


def test_connections_opened_below_the_mark_while_closes_held_it_are_still_shed():
    """Busy mode's sweep runs at most every 0.25 s; one asked for sooner is deferred, not
    dropped. Here the first sweep closes the stale connections (the count falls under the mark),
    new ones arrive below it with the 30 s deadline, and the mark is passed again inside the
    0.25 s: the deferred sweep still gives them the busy deadline."""
    server = start(max_connections=8, head_timeout_busy_s=1.0)  # mark: 6 open; head deadline 30 s
    stale: list[socket.socket] = []
    second: list[socket.socket] = []
    third: list[socket.socket] = []
    try:
        stale = [connect(server.port, "127.0.0.2") for _ in range(3)]
        time.sleep(1.3)  # idle past the busy deadline
        second = [connect(server.port, "127.0.0.3") for _ in range(3)]  # 6 open: sweep, the stale closed
        assert all(closed_within(s, 5.0) for s in stale)
        t0 = time.monotonic()
        third = [connect(server.port, "127.0.0.4") for _ in range(3)]  # 4, 5 (30 s deadline), 6 open
        assert all(closed_within(s, 8.0) for s in second + third)
        assert time.monotonic() - t0 < 8.0  # the busy 1 s, not the 30 s deadline
        assert server.guard.head_timeouts == 9 and server.guard.open == 0
    finally:
        for s in stale + second + third:
            s.close()
        server.stop()


def test_one_address_past_its_cap_is_refused_while_another_is_served():
    server = start()  # 1024 connections, 256 per client address
    held = [connect(server.port, "127.0.0.2") for _ in range(256)]
    extra: list[socket.socket] = []
    try:
        extra = [connect(server.port, "127.0.0.2") for _ in range(8)]
        assert all(closed_within(s, 5.0) for s in extra)
        assert none_closed(held)
        assert get(server.port, "/ok", "127.0.0.3") == {"ok": True}
        assert server.guard.refused == {"max_connections": 0, "max_connections_per_client": 8}
        held.pop().close()
        time.sleep(0.2)
        assert get(server.port, "/ok", "127.0.0.2") == {"ok": True}  # its own slot back
    finally:
        for s in held + extra:
            s.close()
        server.stop()


def http_get(port: int, path: str) -> tuple[bytes, bytes]:
    """``GET path`` from 127.0.0.1: (status line and headers, body)."""
    with connect(port) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


def test_health_and_metrics_have_their_own_listener_while_the_api_cap_is_full(start_control_plane):
    cp = start_control_plane(http_addr="127.0.0.1:0", metrics_addr="127.0.0.1:0", http_max_connections=24)
    api, mgmt = cp.state.http_port, cp.state.metrics_port
    # requests whose body never comes: in progress (no head deadline cuts them) for 60 s
    flood = [connect(api, f"127.0.0.{2 + i % 4}") for i in range(24)]
    try:
        for s in flood:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        time.sleep(0.5)
        assert closed_within(connect(api, "127.0.0.6"), 5.0)  # the API's cap is full
        t0 = time.monotonic()
        head, body = http_get(mgmt, "/health")
        assert head.startswith(b"HTTP/1.1 200") and json.loads(body) == {}, (head, body[:200])
        assert time.monotonic() - t0 < 5.0
        head, body = http_get(mgmt, "/metrics")
        assert head.startswith(b"HTTP/1.1 200"), head
        text = body.decode()
        assert 'loraplane_http_connections_open{listener="http"} 24.0' in text
        assert 'loraplane_http_connections_refused_total{listener="http",reason="max_connections"} 1.0' in text
        assert 'loraplane_http_connections_open{listener="metrics"} 1.0' in text
        head, _ = http_get(mgmt, "/v1/models")  # nothing but probes and scrapers there
        assert head.startswith(b"HTTP/1.1 404"), head
        for s in flood:
            s.close()
        deadline = time.monotonic() + 10.0
        while True:  # the API serves again once the flood is gone
            try:
                assert get(api, "/health") == {}
                break
            except (OSError, AssertionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        for s in flood:
            s.close()


def test_a_client_gone_before_its_body_is_no_server_error():
    server = start()
    errors: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = errors.append  # type: ignore[method-assign]
    uvicorn_log = logging.getLogger("uvicorn.error")  # "Exception in ASGI application" goes here
    uvicorn_log.addHandler(handler)
    try:
        for i in range(4):
            with connect(server.port, f"127.0.0.{2 + i}") as s:
                s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
                time.sleep(0.05)  # the route is reading the body
        assert get(server.port, "/ok") == {"ok": True}  # after the event loop went past the four
        time.sleep(0.2)
        assert [r.getMessage() for r in errors if r.levelno >= logging.ERROR] == []
        assert server.guard.open == 0
    finally:
        uvicorn_log.removeHandler(handler)
        server.stop()


def test_one_address_cannot_hold_the_metrics_listener(start_control_plane):
    cp = start_control_plane(metrics_addr="127.0.0.1:0")
    mgmt = cp.state.metrics_port
    # idle connections from one address, more than the listener's cap: all 64 were taken (and
    # a reconnecting flood kept /health refused while the busy deadline shed them)
    flood = [connect(mgmt, "127.0.0.2") for _ in range(80)]
    try:
        time.sleep(0.3)
        head, body = http_get(mgmt, "/health")  # another address still gets in
        assert head.startswith(b"HTTP/1.1 200") and json.loads(body) == {}, (head, body[:200])
        assert sum(closed_within(s, 0.02) for s in flood) == 80 - 16  # past 16: reset at once
        head, body = http_get(mgmt, "/metrics")
        assert (
            'loraplane_http_connections_refused_total{listener="metrics",reason="max_connections_per_client"} 64.0'
            in body.decode()
        )
    finally:
        for s in flood:
            s.close()
