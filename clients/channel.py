"""Channel set-up shared by the sync and async clients: options, retries, connect deadline,
and the choice among several control-plane replicas.

`SERVICE_CONFIG` is gRPC's retry policy for the idempotent reads (`READ_METHODS`), with keepalive
(`KEEPALIVE_MS`, `KEEPALIVE_TIMEOUT_MS`); `Replicas` keeps one channel per address of a
comma-separated list and moves a call to the next replica on UNAVAILABLE (at most
`max_attempts(n)` attempts, `RETRY_BACKOFF_S` doubling to `RETRY_BACKOFF_MAX_S` between
rounds); `wait_ready` is the connect deadline behind `ServerUnreachable`. Which calls are
retried and why: docs/operations.md, "The Python client".
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import socket
import threading
from typing import Any

import grpc

from clients.errors import ServerUnreachable
from loraplane.env import ENV_ADDR, ENV_ADMIN_TOKEN, ENV_API_KEY
from loraplane.interceptors import pushback_s
from loraplane.limits import MAX_MESSAGE_BYTES

SERVICE = "loraplane.v1.ControlPlane"
READ_METHODS = ("ListAdapters", "GetAdapter", "GetDefaultAdapters", "ListWorkers")

# https://github.com/grpc/proposal/blob/master/A6-client-retries.md
SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [{"service": SERVICE, "method": m} for m in READ_METHODS],
            "retryPolicy": {
                "maxAttempts": 4,
                "initialBackoff": "0.1s",
                "maxBackoff": "2s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ]
}

KEEPALIVE_MS = 20_000
"""Keepalive ping period while a call is open, ms (the control plane allows one per 10 s)."""
KEEPALIVE_TIMEOUT_MS = 10_000
"""A ping unanswered this long closes the connection: open calls end with UNAVAILABLE."""
RETRY_BACKOFF_S = 0.2
RETRY_BACKOFF_MAX_S = 2.0

CHANNEL_OPTIONS: tuple[tuple[str, object], ...] = (
    ("grpc.enable_retries", 1),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)

_C = grpc.ChannelConnectivity


def auth_metadata(admin_token: str | None, api_key: str | None = None) -> tuple[tuple[str, str], ...]:
    """``authorization: Bearer <token>``: the admin token (argument, else
    ``$LORAPLANE_ADMIN_TOKEN``), else the inference API key (argument, else
    ``$LORAPLANE_API_KEY``). The admin token passes wherever the API key does, so it wins when
    both are known; none → no metadata."""
    token = admin_token if admin_token is not None else os.environ.get(ENV_ADMIN_TOKEN)
    if not token:
        token = api_key if api_key is not None else os.environ.get(ENV_API_KEY)
    if not token:
        return ()
    return (("authorization", f"Bearer {token}"),)


def wait_ready(channel: grpc.Channel, addr: str, timeout: float, wait_for_server: bool = False) -> None:
    """Block until ``channel`` is READY; raise `ServerUnreachable` otherwise (see module doc)."""
    done = threading.Event()
    final: list[grpc.ChannelConnectivity] = []  # the state that ended the wait

    def on_change(state: grpc.ChannelConnectivity) -> None:
        if done.is_set():
            return
        if state in (_C.READY, _C.SHUTDOWN) or (state is _C.TRANSIENT_FAILURE and not wait_for_server):
            final.append(state)
            done.set()

    channel.subscribe(on_change, try_to_connect=True)
    try:
        if not done.wait(timeout):
            raise ServerUnreachable(addr, f"not ready within {timeout:g}s")
    finally:
        channel.unsubscribe(on_change)
    if final[0] is not _C.READY:
        raise ServerUnreachable(addr, describe_failure(final[0], addr))


async def wait_ready_async(channel: grpc.aio.Channel, addr: str, timeout: float, wait_for_server: bool = False) -> None:
    """`wait_ready` for a ``grpc.aio`` channel."""

    async def until_ready() -> grpc.ChannelConnectivity:
        state = channel.get_state(try_to_connect=True)
        while state is not _C.READY:
            if state is _C.SHUTDOWN or (state is _C.TRANSIENT_FAILURE and not wait_for_server):
                return state
            await channel.wait_for_state_change(state)
            state = channel.get_state(try_to_connect=True)
        return state

    try:
        state = await asyncio.wait_for(until_ready(), timeout)
    except asyncio.TimeoutError:
        raise ServerUnreachable(addr, f"not ready within {timeout:g}s") from None
    if state is not _C.READY:  # the probe of describe_failure blocks up to HTTP_PROBE_TIMEOUT_S
        raise ServerUnreachable(addr, await asyncio.to_thread(describe_failure, state, addr))


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""The first bytes of every HTTP/2 (so gRPC) connection, RFC 9113 section 3.4."""
HTTP_PROBE_TIMEOUT_S = 1.0
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+):([0-9]{1,5})")

HTTP_NOT_GRPC = (
    "the address answers HTTP/1.x, not gRPC: it is an HTTP port (the control plane's "
    "--http-addr, or a metrics port), not the gRPC one; point --addr (or $" + ENV_ADDR + ") at the "
    "control plane's gRPC address, its own --addr (default port 50051)"
)
"""Why a connection failed when the peer is an HTTP/1.x server (`answers_http1`)."""


def answers_http1(addr: str, timeout: float = HTTP_PROBE_TIMEOUT_S) -> bool:
    """True when ``addr`` (``host:port``; other target forms are not probed) accepts a TCP
    connection and answers gRPC's HTTP/2 preface (`HTTP2_PREFACE`) with an HTTP/1.x status line,
    as the OpenAI-compatible HTTP front (uvicorn) and Prometheus' exporter do; gRPC core only
    says "Trying to connect an http1.x server" deep in a call's error. Any socket error: False."""
    m = _HOST_PORT.fullmatch(addr.strip())
    if m is None:
        return False
    host = m.group(1).strip("[]")
    try:
        with socket.create_connection((host, int(m.group(2))), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(HTTP2_PREFACE)
            return sock.recv(16).startswith(b"HTTP/1.")
    except (OSError, ValueError):
        return False


def describe_failure(state: grpc.ChannelConnectivity, addr: str) -> str:
    """Why the channel to ``addr`` is not READY, for `ServerUnreachable`: a failed connection
    says whether the address answers HTTP/1.x (`HTTP_NOT_GRPC`) rather than gRPC."""
    if state is _C.TRANSIENT_FAILURE:
        if answers_http1(addr):
            return HTTP_NOT_GRPC
        return "connection failed (is the server running and the address right?)"
    if state is _C.SHUTDOWN:
        return "the client was closed"
    return f"channel state {state.name}"


def parse_addresses(addr: str) -> list[str]:
    """``"a:1, b:2"`` → ``["a:1", "b:2"]`` (order kept, duplicates dropped).

    Raises:
        ValueError: an empty list or an empty element.
    """
    parts = [p.strip() for p in addr.split(",")]
    if not all(parts):
        raise ValueError(f"address list {addr!r} has an empty element")
    return list(dict.fromkeys(parts))


def max_attempts(n_addrs: int) -> int:
    """Attempts one retried call makes over ``n_addrs`` replicas: two rounds, at least 3."""
    return max(3, 2 * n_addrs)


def backoff_before(attempt: int, n_addrs: int) -> float:
    """Seconds to wait before attempt ``attempt`` (0-based): 0 except after a full round."""
    if attempt == 0 or attempt % n_addrs:
        return 0.0
    rounds = attempt // n_addrs
    return min(RETRY_BACKOFF_S * 2 ** (rounds - 1), RETRY_BACKOFF_MAX_S)


class BusyRetries:
    """Retries of one call that a server refused as busy: RESOURCE_EXHAUSTED carrying gRPC's
    server pushback (``grpc-retry-pushback-ms``, gRFC A6; the control plane's concurrency
    limits send it). Other RESOURCE_EXHAUSTED answers (an upload over the size limit, a
    worker queue that is full for Generate) carry none and are not retried.

    At most ``max_retries`` retries, each after the pushback plus up to 50 % jitter.
    """

    def __init__(self, max_retries: int = 50) -> None:
        self.left = max_retries

    def wait_s(self, code: grpc.StatusCode | None, trailing: Any) -> float | None:
        """Seconds to wait before retrying, or None when the error is not a busy refusal."""
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED or self.left <= 0:
            return None
        pushback = pushback_s(trailing)
        if pushback is None:
            return None
        self.left -= 1
        return pushback * (1.0 + 0.5 * random.random())


class Replicas:
    """Which replica to try first, and in what order to try the rest (no I/O).

    Thread-safe. A replica that failed moves to the back: the next call starts on the one
    after it, so a dead replica costs one failed attempt, not one per call.
    """

    def __init__(self, addrs: list[str]) -> None:
        self.addrs = list(addrs)
        self._first = 0
        self._lock = threading.Lock()

    def order(self) -> list[str]:
        """Every address, the preferred one first."""
        with self._lock:
            i = self._first
        return self.addrs[i:] + self.addrs[:i]

    def failed(self, addr: str) -> None:
        """``addr`` failed a call: prefer the next address from now on (if it is preferred)."""
        with self._lock:
            if self.addrs[self._first] == addr:
                self._first = (self._first + 1) % len(self.addrs)
