"""What `LoraplaneClient` (`clients.client`) and `AsyncLoraplaneClient`
(`clients.async_client`) share: `ClientBase` (replicas, deadlines, credentials) and the small
request/error helpers both call with."""

from __future__ import annotations

from pathlib import Path

import grpc

from clients.channel import Replicas, auth_metadata, parse_addresses
from clients.errors import LoraplaneError, ServerUnreachable
from clients.peft import adapter_source_problem
from clients.wire import adapter_ref
from loraplane.v1 import common_pb2, control_plane_pb2

DEFAULT_CONNECT_TIMEOUT_S = 5.0
EMPTY = common_pb2.Empty()
"""The request of the calls that take none."""


def pin_request(adapter: int | str, pinned: bool) -> control_plane_pb2.PinRequest:
    """The ``PinAdapter`` request for ``adapter`` (an id or a name / alias)."""
    ref = adapter_ref(adapter)
    return control_plane_pb2.PinRequest(id=ref.id, name=ref.name, pinned=pinned)


def check_upload_source(path: str | Path, server_path: bool) -> None:
    """Fail before the call: an unreadable file inside grpc's request thread only says UNKNOWN."""
    problem = None if server_path else adapter_source_problem(path)
    if problem is not None:
        raise FileNotFoundError(problem)


def stream_ended_early(request_id: str) -> LoraplaneError:
    """The error of a Generate stream that closed without its finished event."""
    return LoraplaneError("UNKNOWN", f"generation stream of request {request_id!r} ended before finishing")


def unreachable(addr: str, errors: list[ServerUnreachable]) -> ServerUnreachable:
    """One `ServerUnreachable` for a list of addresses that all failed to connect."""
    if len(errors) == 1:
        return errors[0]
    return ServerUnreachable(addr, "; ".join(f"{e.addr}: {e.reason}" for e in errors))


def rpc_code(err: grpc.RpcError) -> grpc.StatusCode | None:
    """``err``'s status code, or None when it carries none (a bare ``RpcError``)."""
    code = getattr(err, "code", None)
    return code() if callable(code) else None


class ClientBase:
    """What both clients hold: the replica list, deadlines, the admin-token metadata and
    ``_ready`` (replicas whose channel has connected once). Channels are the subclass's.

    Raises:
        ValueError: an empty address in ``addr``.
    """

    def __init__(
        self,
        addr: str,
        *,
        admin_token: str | None = None,
        timeout: float | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
        wait_for_server: bool = False,
        api_key: str | None = None,
    ) -> None:
        self.addr = addr
        self.timeout = timeout
        self._connect_timeout = connect_timeout
        self._wait_for_server = wait_for_server
        self._metadata = auth_metadata(admin_token, api_key)
        self._replicas = Replicas(parse_addresses(addr))
        self._ready: set[str] = set()
        self._init_channels()

    def _init_channels(self) -> None:
        """Set up the (empty) channel table; called once at the end of ``__init__``."""
        raise NotImplementedError
