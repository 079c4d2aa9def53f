"""Channel set-up shared by the sync and async clients: options, retries, connect deadline.

Retries: idempotent read calls (ListAdapters, GetAdapter, GetDefaultAdapters, ListWorkers)
carry grpc's built-in retry policy through the channel's service config, so a transient
UNAVAILABLE (a control plane restarting, a dropped connection) is retried by grpc itself with
exponential backoff. Writes and Generate are not retried: a repeated RegisterAdapter is
harmless (same sha256 → same id) but a streamed upload cannot be replayed cheaply, and a
repeated Generate would run twice.

Connecting: before its first call a client waits for the channel to become READY, with a
deadline. Reaching TRANSIENT_FAILURE first (connection refused, name not resolved) or missing
the deadline raises `ServerUnreachable`; ``wait_for_server=True`` keeps waiting through
transient failures until the deadline (for callers that start the server themselves).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading

import grpc

from clients.errors import ServerUnreachable
from loraplane.env import ENV_ADMIN_TOKEN
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

CHANNEL_OPTIONS: tuple[tuple[str, object], ...] = (
    ("grpc.enable_retries", 1),
    ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)

_C = grpc.ChannelConnectivity


def auth_metadata(admin_token: str | None) -> tuple[tuple[str, str], ...]:
    """``authorization: Bearer <token>`` from the argument, else ``$LORAPLANE_ADMIN_TOKEN``."""
    token = admin_token if admin_token is not None else os.environ.get(ENV_ADMIN_TOKEN)
    if not token:
        return ()
    return (("authorization", f"Bearer {token}"),)


def wait_ready(channel: grpc.Channel, addr: str, timeout: float,
               wait_for_server: bool = False) -> None:
    """Block until ``channel`` is READY; raise `ServerUnreachable` otherwise (see module doc)."""
    done = threading.Event()
    final: list[grpc.ChannelConnectivity] = []  # the state that ended the wait

    def on_change(state: grpc.ChannelConnectivity) -> None:
        if done.is_set():
            return
        if state in (_C.READY, _C.SHUTDOWN) or (
                state is _C.TRANSIENT_FAILURE and not wait_for_server):
            final.append(state)
            done.set()

    channel.subscribe(on_change, try_to_connect=True)
    try:
        if not done.wait(timeout):
            raise ServerUnreachable(addr, f"not ready within {timeout:g}s")
    finally:
        channel.unsubscribe(on_change)
    if final[0] is not _C.READY:
        raise ServerUnreachable(addr, _describe(final[0]))


async def wait_ready_async(channel: grpc.aio.Channel, addr: str, timeout: float,
                           wait_for_server: bool = False) -> None:
    """`wait_ready` for a ``grpc.aio`` channel."""

    async def until_ready() -> None:
        state = channel.get_state(try_to_connect=True)
        while state is not _C.READY:
            if state is _C.SHUTDOWN or (state is _C.TRANSIENT_FAILURE and not wait_for_server):
                raise ServerUnreachable(addr, _describe(state))
            await channel.wait_for_state_change(state)
            state = channel.get_state(try_to_connect=True)

    try:
        await asyncio.wait_for(until_ready(), timeout)
    except asyncio.TimeoutError:
        raise ServerUnreachable(addr, f"not ready within {timeout:g}s") from None


def _describe(state: grpc.ChannelConnectivity) -> str:
    if state is _C.TRANSIENT_FAILURE:
        return "connection failed (is the server running and the address right?)"
    if state is _C.SHUTDOWN:
        return "the client was closed"
    return f"channel state {state.name}"
