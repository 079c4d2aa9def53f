"""OpenAI's error shape and how control-plane errors map onto HTTP statuses.

Body (what OpenAI and vLLM clients parse):
``{"error": {"message": str, "type": str, "param": str | null, "code": str | null}}``.
`install_error_handlers` makes every error of the app, request validation included, answer
with it; a domain error a route lets through (e.g. the database unavailable while listing
``/v1/models``) is mapped by `from_control_plane` there. Every 503 carries ``Retry-After``
(seconds: 2 for a database outage, 1 for no live worker), as vLLM/OpenAI clients expect.
"""

from __future__ import annotations

from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from control_plane.errors import (
    ControlPlaneError,
    DataCorruptionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)

# (HTTP status, OpenAI error type) per domain error; the first matching class in the MRO wins.
STATUS_OF: dict[type[ControlPlaneError], tuple[int, str]] = {
    InvalidArgumentError: (400, "invalid_request_error"),
    NotFoundError: (404, "not_found_error"),
    PermissionDeniedError: (403, "permission_error"),
    ResourceExhaustedError: (429, "rate_limit_error"),
    UnauthenticatedError: (401, "authentication_error"),
    UnavailableError: (503, "service_unavailable"),
    DataCorruptionError: (500, "internal_error"),
}
RETRY_AFTER_S = 1
"""``Retry-After`` of a 503 whose error names no ``retry_after_s`` of its own."""
# A worker's status code (relayed by the router as WorkerRequestError) → HTTP status.
GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
}


class OpenAIError(Exception):
    """An HTTP error with OpenAI's body. ``param`` names the offending request field."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {message, type, param, code}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def unsupported(param: str, detail: str) -> OpenAIError:
    """400 for a parameter loraplane does not implement (named in ``param``)."""
    return OpenAIError(400, f"'{param}' is not supported: {detail}", param=param, code="unsupported_parameter")


def from_control_plane(exc: ControlPlaneError) -> OpenAIError:
    """The HTTP error for a domain error (``control_plane.errors``, router errors); a 503
    carries ``Retry-After`` (the error's ``retry_after_s``, else `RETRY_AFTER_S`)."""
    code = getattr(exc, "code", None)
    if isinstance(code, grpc.StatusCode):
        status, kind = GRPC_TO_HTTP.get(code, (500, "internal_error"))
        err = OpenAIError(status, str(exc), type=kind, code=code.name.lower())
    else:
        status, kind = next((STATUS_OF[c] for c in type(exc).__mro__ if c in STATUS_OF), (500, "internal_error"))
        err = OpenAIError(status, str(exc), type=kind)
    if err.status == 503:
        err.headers = {"Retry-After": str(int(getattr(exc, "retry_after_s", RETRY_AFTER_S)))}
    return err


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """The 400 for a request body that does not parse or validate: names the first offending
    field (dotted path, ``body`` when there is none) and pydantic's message for it."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    return OpenAIError(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param=param)


async def _openai_error_response(_request: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _control_plane_error_response(_request: Request, exc: ControlPlaneError) -> JSONResponse:
    err = from_control_plane(exc)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _validation_error_response(_request: Request, exc: RequestValidationError) -> JSONResponse:
    err = validation_error(exc)
    return JSONResponse(err.body(), status_code=err.status)


def install_error_handlers(app: FastAPI) -> None:
    """Answer `OpenAIError`, domain errors (`from_control_plane`) and request-validation
    errors with OpenAI's error JSON."""
    app.exception_handler(OpenAIError)(_openai_error_response)
    app.exception_handler(ControlPlaneError)(_control_plane_error_response)
    app.exception_handler(RequestValidationError)(_validation_error_response)
