"""The one table from worker exceptions to gRPC status codes (the gRPC edge's job only)."""

from __future__ import annotations

import grpc

from worker import errors

STATUS_OF: dict[type[errors.WorkerError], grpc.StatusCode] = {
    errors.InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.AdapterNotFoundError: grpc.StatusCode.NOT_FOUND,
    errors.AdapterConflictError: grpc.StatusCode.ALREADY_EXISTS,
    errors.QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DrainTimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    errors.UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
    errors.DecodeFailedError: grpc.StatusCode.INTERNAL,
    # UNAVAILABLE: the control plane marks the worker unusable and retries the request on
    # another one (nothing was relayed yet).
    errors.WorkerDrainingError: grpc.StatusCode.UNAVAILABLE,
    # FAILED_PRECONDITION, not UNAVAILABLE: the control plane relays it as the request's own
    # error instead of marking the worker dead (the bytes, not the worker, are at fault).
    errors.AdapterFetchError: grpc.StatusCode.FAILED_PRECONDITION,
}
"""Exception class → status code; every concrete ``WorkerError`` subclass is listed (tested)."""


def status_of(exc: errors.WorkerError) -> grpc.StatusCode:
    """Status code of ``exc``, looked up by its class then its bases.

    Raises:
        KeyError: a ``WorkerError`` class with no entry (a programming error, caught by tests).
    """
    for cls in type(exc).__mro__:
        code = STATUS_OF.get(cls)
        if code is not None:
            return code
    raise KeyError(f"no gRPC status for {type(exc).__name__}")
