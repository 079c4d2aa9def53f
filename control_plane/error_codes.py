"""The control plane's one error table: what each refusal answers on gRPC and on HTTP.

`ERROR_CODES` maps each domain error class (`control_plane.errors`, and the quota refusal) and
each worker status code the router relays (`router.WorkerRequestError`) to a gRPC status code,
an HTTP status and OpenAI's error ``type`` and ``code``; `codes_of` looks an error up. The
gRPC servicer (`control_plane.servicer`) and the HTTP front (`control_plane.http.errors`) both
read it and keep no table of their own. The why: docs/architecture.md, "Errors".
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from control_plane.errors import (
    AlreadyExistsError,
    ControlPlaneError,
    DataCorruptionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from control_plane.quota_rules import QuotaExceededError
from control_plane.router import WorkerRequestError

Code = grpc.StatusCode


@dataclass(frozen=True)
class ErrorCodes:
    """How one error answers on each API.

    Attributes:
        grpc: the gRPC status code (`control_plane.servicer`).
        http: the HTTP status (`control_plane.http.errors`).
        type: OpenAI's ``error.type`` in the HTTP body.
        code: OpenAI's ``error.code`` (None: the body's ``code`` is null).
    """

    grpc: grpc.StatusCode
    http: int
    type: str
    code: str | None = None


def _relayed(code: grpc.StatusCode, http: int, kind: str) -> ErrorCodes:
    """A worker's refusal: relayed over gRPC with the worker's own code, named in lower case as
    OpenAI's ``code`` over HTTP."""
    return ErrorCodes(code, http, kind, code.name.lower())


ERROR_CODES: dict[type[ControlPlaneError] | grpc.StatusCode, ErrorCodes] = {
    # Domain errors, by class; an error takes the row of the first class of its MRO listed.
    InvalidArgumentError: ErrorCodes(Code.INVALID_ARGUMENT, 400, "invalid_request_error"),
    AlreadyExistsError: ErrorCodes(Code.ALREADY_EXISTS, 400, "invalid_request_error"),  # vLLM: 400 "already loaded"
    NotFoundError: ErrorCodes(Code.NOT_FOUND, 404, "not_found_error"),
    PermissionDeniedError: ErrorCodes(Code.PERMISSION_DENIED, 403, "permission_error"),
    ResourceExhaustedError: ErrorCodes(Code.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    # OpenAI's answer to a caller over its rate limits (its client raises RateLimitError)
    QuotaExceededError: ErrorCodes(Code.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "rate_limit_exceeded"),
    UnauthenticatedError: ErrorCodes(Code.UNAUTHENTICATED, 401, "authentication_error"),
    UnavailableError: ErrorCodes(Code.UNAVAILABLE, 503, "service_unavailable"),
    DataCorruptionError: ErrorCodes(Code.DATA_LOSS, 500, "internal_error"),
    # A worker's status code, relayed as `WorkerRequestError` (the request itself was refused).
    Code.INVALID_ARGUMENT: _relayed(Code.INVALID_ARGUMENT, 400, "invalid_request_error"),
    Code.OUT_OF_RANGE: _relayed(Code.OUT_OF_RANGE, 400, "invalid_request_error"),
    Code.FAILED_PRECONDITION: _relayed(Code.FAILED_PRECONDITION, 400, "invalid_request_error"),
    Code.NOT_FOUND: _relayed(Code.NOT_FOUND, 404, "not_found_error"),
    Code.RESOURCE_EXHAUSTED: _relayed(Code.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    Code.UNAVAILABLE: _relayed(Code.UNAVAILABLE, 503, "service_unavailable"),
}
"""Domain error class or relayed worker code → codes on both APIs (each row is tested)."""

UNLISTED = ErrorCodes(Code.INTERNAL, 500, "internal_error")
"""A `ControlPlaneError` whose classes have no row (none today: tested)."""


def codes_of(exc: ControlPlaneError) -> ErrorCodes:
    """The row of ``exc``: a `WorkerRequestError` by its worker code (an unlisted code, e.g. the
    client's own deadline passing, keeps that code over gRPC and is a 500 over HTTP), any other
    error by the first class of its MRO listed, else `UNLISTED`."""
    if isinstance(exc, WorkerRequestError):
        return ERROR_CODES.get(exc.code) or _relayed(exc.code, 500, "internal_error")
    for cls in type(exc).__mro__:
        row = ERROR_CODES.get(cls)
        if row is not None:
            return row
    return UNLISTED
