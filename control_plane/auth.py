"""Bearer-token check for the admin RPCs, as one gRPC server interceptor.

When a token is configured (``--admin-token`` or ``$LORAPLANE_ADMIN_TOKEN``), the methods in
`ADMIN_METHODS` need ``authorization: Bearer <token>`` metadata, else UNAUTHENTICATED. Every
other method (reads, Generate, worker membership) stays open. With no token configured nothing
is checked.
"""

from __future__ import annotations

import hmac
import os

import grpc
import structlog

from loraplane.env import ENV_ADMIN_TOKEN

log = structlog.get_logger("control_plane.auth")

_SERVICE = "/loraplane.v1.ControlPlane/"
ADMIN_METHODS = frozenset(_SERVICE + m for m in ("RegisterAdapter", "UnregisterAdapter", "SetDefaultAdapters"))


def admin_token_from(flag: str | None) -> str | None:
    """The configured token: the flag, else the environment; None (or empty) disables the check."""
    token = flag if flag else os.environ.get(ENV_ADMIN_TOKEN, "")
    return token or None


def _presented_token(metadata: tuple) -> str | None:
    for key, value in metadata or ():
        if key.lower() == "authorization":
            scheme, _, token = str(value).partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _refusal(handler: grpc.RpcMethodHandler, method: str, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as ``handler`` that aborts with UNAUTHENTICATED."""

    def abort(_request, context: grpc.ServicerContext):
        log.warning("admin_call_refused", method=method, reason=message)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class AdminAuthInterceptor(grpc.ServerInterceptor):
    """Refuses admin methods without the right bearer token (constant-time comparison)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in ADMIN_METHODS:
            return handler
        presented = _presented_token(handler_call_details.invocation_metadata)
        if presented is None:
            return _refusal(handler, method, f"{method} needs 'authorization: Bearer <token>' metadata "
                                             "(admin token configured)")
        if not hmac.compare_digest(presented.encode(), self._token):
            return _refusal(handler, method, f"{method}: admin token rejected")
        return handler
