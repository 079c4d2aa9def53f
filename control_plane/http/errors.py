"""OpenAI's error body, and the HTTP front's error handlers.

Body (what OpenAI and vLLM clients parse):
``{"error": {"message": str, "type": str, "param": str | null, "code": str | null}}``.
`install_error_handlers` makes every error of the app answer with it: request validation and
body parsing (400 naming the field), unknown routes (404) and methods (405), a domain error a
route lets through (`from_control_plane`: status, type and code from the control plane's one
error table, `control_plane.error_codes`), a client gone before its body was in, and, as a
last resort, any unexpected exception (500, logged with its traceback). `app.BodySizeLimit`
answers 413 in the same shape before a too-large body is read. Every 503 and 429 carries
``Retry-After`` (2 s for a database outage, a quota's own wait, else 1 s), as vLLM/OpenAI
clients expect. The why: docs/architecture.md, "Errors", and docs/http-api.md.
"""

from __future__ import annotations

from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from control_plane.error_codes import codes_of
from control_plane.errors import ControlPlaneError

log = structlog.get_logger("loraplane.control_plane.http.errors")

INVALID_UNICODE = "invalid_unicode"
"""Error code (and pydantic error type) of a request string holding a lone UTF-16 surrogate."""

RETRY_AFTER_S = 1
"""``Retry-After`` of a 503 or 429 whose error names no ``retry_after_s`` of its own."""
CLIENT_CLOSED_REQUEST = 499
"""nginx's status for a request whose client closed the connection first (never sent)."""


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
    """The HTTP error for a domain error (``control_plane.errors``, router errors): status,
    ``type`` and ``code`` from the control plane's one error table
    (`control_plane.error_codes.codes_of`). A 503 or 429 carries ``Retry-After``: the error's
    own ``retry_after_s`` (a database outage's 2 s, a quota's wait), else `RETRY_AFTER_S`."""
    row = codes_of(exc)
    err = OpenAIError(row.http, str(exc), type=row.type, code=row.code)
    if row.http in (429, 503):
        err.headers = {"Retry-After": str(int(getattr(exc, "retry_after_s", RETRY_AFTER_S)))}
    return err


def _dotted(loc: Any) -> str | None:
    """A pydantic error location as a dotted request field (``messages.0.content``); None for
    the body itself."""
    parts = [str(x) for x in (loc or ()) if x != "body"]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """The 400 for a request body that does not parse or validate: names the first offending
    field (dotted path in ``param``; None when the body as a whole is at fault) and pydantic's
    message for it.

    Body-level faults get their own messages: not JSON (``json_invalid``, with the decoder's
    position), empty, or not a JSON object. A string with a lone UTF-16 surrogate
    (``"\\ud800"``: valid JSON, not valid Unicode) is ``invalid_unicode``, named by its field
    (`schemas.reject_lone_surrogates`).
    """
    errors = exc.errors()
    first = errors[0] if errors else {}
    kind = first.get("type")
    ctx = first.get("ctx") or {}
    if kind == "json_invalid":
        return OpenAIError(
            400, f"request body is not valid JSON: {ctx.get('error', first.get('msg'))}", code="invalid_json"
        )
    if kind == INVALID_UNICODE:
        field = str(ctx.get("field") or "") or None
        return OpenAIError(400, str(first.get("msg")), param=field, code=INVALID_UNICODE)
    param = _dotted(first.get("loc"))
    if param is None and kind == "missing":
        return OpenAIError(400, "request body is empty: expected a JSON object", code="invalid_json")
    if param is None and kind in ("model_attributes_type", "dict_type"):
        return OpenAIError(
            400, "request body must be a JSON object (Content-Type: application/json)", code="invalid_json"
        )
    return OpenAIError(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param=param)


def http_error(status: int, detail: Any) -> OpenAIError:
    """Starlette's own HTTP errors (unknown route 404, wrong method 405, ...) in OpenAI's shape."""
    kind = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}.get(
        status, "invalid_request_error" if 400 <= status < 500 else "internal_error"
    )
    code = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large"}.get(status)
    return OpenAIError(status, str(detail), type=kind, code=code)


def internal_error() -> OpenAIError:
    """The 500 for an exception no handler expected (logged with its traceback by the handler;
    the client sees no internals)."""
    return OpenAIError(500, "internal server error (logged on the control plane)", type="internal_error")


async def _openai_error_response(_request: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _control_plane_error_response(_request: Request, exc: ControlPlaneError) -> JSONResponse:
    err = from_control_plane(exc)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _validation_error_response(_request: Request, exc: RequestValidationError) -> JSONResponse:
    err = validation_error(exc)
    return JSONResponse(err.body(), status_code=err.status)


async def _http_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code < 400:  # not an error (Starlette raises none today): keep its meaning
        return Response(status_code=exc.status_code, headers=exc.headers)
    detail = exc.detail
    if exc.status_code == 404 and detail == "Not Found":
        detail = f"no route {request.method} {request.url.path} (served: /v1/models, /v1/completions, ...)"
    elif exc.status_code == 405 and detail == "Method Not Allowed":
        allowed = next((v for k, v in (exc.headers or {}).items() if k.lower() == "allow"), "")
        detail = f"method {request.method} is not allowed on {request.url.path}" + (
            f" (allowed: {allowed})" if allowed else ""
        )
    err = http_error(exc.status_code, detail)
    headers = dict(exc.headers or {})
    if err.status in (408, 413):  # the rest of the body is never read: do not keep the connection
        headers["connection"] = "close"
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def _client_gone_response(request: Request, _exc: Exception) -> Response:
    # The client closed its connection before its request body was in: nobody reads an answer
    # (uvicorn drops it), and it is no server error: counted as a 500 with a traceback, a flood
    # of half-sent bodies, then closed, would write two tracebacks per connection to the logs.
    log.debug("http_client_gone", method=request.method, path=request.url.path)
    return Response(status_code=CLIENT_CLOSED_REQUEST, headers={"connection": "close"})


async def _unexpected_error_response(request: Request, exc: Exception) -> JSONResponse:
    log.error(
        "http_unhandled_error",
        method=request.method,
        path=request.url.path,
        error=f"{type(exc).__name__}: {exc}",
        exc_info=exc,
    )
    err = internal_error()
    return JSONResponse(err.body(), status_code=err.status)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error in OpenAI's JSON: `OpenAIError`, domain errors (`from_control_plane`),
    request validation (400), Starlette's HTTP errors (404 unknown route, 405 wrong method), a
    client gone before its body was in (no answer, no error logged), and any other exception
    (500, logged)."""
    app.exception_handler(OpenAIError)(_openai_error_response)
    app.exception_handler(ControlPlaneError)(_control_plane_error_response)
    app.exception_handler(RequestValidationError)(_validation_error_response)
    app.exception_handler(StarletteHTTPException)(_http_error_response)
    app.exception_handler(ClientDisconnect)(_client_gone_response)
    app.exception_handler(Exception)(_unexpected_error_response)
