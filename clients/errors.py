"""Errors the loraplane client raises.

Every gRPC failure leaves the client as one of two exceptions:

- `ServerUnreachable`: no connection to the server could be made (nothing listens at the
  address, the address does not resolve, or the channel was not ready before its deadline).
  The CLI maps it to exit code 3.
- `LoraplaneError`: the server answered with a non-OK status. ``code`` is the
  ``grpc.StatusCode`` name (``"NOT_FOUND"``, ``"INVALID_ARGUMENT"``, ...) and ``message`` the
  server's details string. The CLI maps it to exit code 1.

`ServerUnreachable` subclasses `LoraplaneError` (code ``"UNAVAILABLE"``) so that code catching
only `LoraplaneError` still sees every failure; catch `ServerUnreachable` first to tell them
apart.
"""

from __future__ import annotations

import grpc

# How the details of an UNAVAILABLE status begin when grpc core produced it locally because
# no connection could be made. Only a prefix counts: the control plane relays worker failures
# as UNAVAILABLE with messages that *contain* such text but begin by naming the worker, and
# those are the server's answer (exit 1), not an unreachable server (exit 3).
_CONNECT_FAILURE_PREFIXES = (
    "failed to connect to all addresses",
    "dns resolution failed",
    "name resolution failure",
    "empty address list",
)


class LoraplaneError(Exception):
    """The server refused a call.

    Attributes:
        code: the gRPC status code name, e.g. ``"NOT_FOUND"``.
        message: the server's explanation (names the thing at fault).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def to_json(self) -> dict:
        """The CLI's ``--json`` error shape."""
        return {"error": {"code": self.code, "message": self.message}}


class ServerUnreachable(LoraplaneError):
    """No connection could be made to the server at ``addr``."""

    def __init__(self, addr: str, reason: str) -> None:
        super().__init__("UNAVAILABLE", f"cannot reach loraplane server at {addr}: {reason}")
        self.addr = addr
        self.reason = reason


def from_rpc_error(err: grpc.RpcError, addr: str) -> LoraplaneError:
    """Convert a grpc error (sync ``grpc.RpcError`` or ``grpc.aio.AioRpcError``) once, here."""
    code_fn = getattr(err, "code", None)
    details_fn = getattr(err, "details", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details = (details_fn() if callable(details_fn) else None) or str(err)
    if code == grpc.StatusCode.UNAVAILABLE and _is_transport_failure(details):
        return ServerUnreachable(addr, details)
    name = code.name if isinstance(code, grpc.StatusCode) else str(code)
    return LoraplaneError(name, details)


def _is_transport_failure(details: str) -> bool:
    return details.lower().lstrip().startswith(_CONNECT_FAILURE_PREFIXES)
