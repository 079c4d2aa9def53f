"""The FastAPI application: OpenAI-compatible routes over the control plane's own objects.

Routes, one module per concern:
  * ``GET /v1/models``, ``GET /v1/models/{model}`` (`models`);
  * ``POST /tokenize``, ``POST /detokenize`` (`tokenize`, vLLM's shapes);
  * ``GET /openapi.json``: their schema, request bodies and answers included (`openapi`; no
    ``/docs`` or ``/redoc``: their pages load scripts from a CDN);
  * ``POST /v1/completions``, ``POST /v1/chat/completions`` (`completions`; responses and
    server-sent events from `streaming`);
  * ``POST /v1/responses`` (`responses_api`: OpenAI's Responses API over the chat pipeline);
  * ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (`admin`: bearer token when
    one is configured, as on gRPC); ``GET``/``POST /v1/tenants``, ``DELETE
    /v1/tenants/{name}`` (`tenant_routes`, the same guard);
  * ``GET /health``, ``/ping``, ``/version``, ``/metrics`` (`health`): open even when an API key
    guards the rest (`api_key`).
Every error is OpenAI's JSON shape (`errors.install_error_handlers`).

Request bodies are bounded before they are read (`BodySizeLimit`, ``--http-max-body-bytes``):
a declared ``Content-Length`` over the limit is 413 at once, without reading the body; a chunked
body is counted as it arrives, 413 once past the limit; the connection is then closed.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from control_plane.http.admin import admin_router
from control_plane.http.api_key import ApiKeyAuth
from control_plane.http.completions import completions_router
from control_plane.http.deps import DEFAULT_MAX_BODY_BYTES, HttpDeps
from control_plane.http.errors import OpenAIError, http_error, install_error_handlers
from control_plane.http.health import health_router
from control_plane.http.models import models_router
from control_plane.http.openapi import install_openapi
from control_plane.http.responses_api import responses_router
from control_plane.http.tenant_routes import tenants_router
from control_plane.http.tokenize import tokenize_router

__all__ = ["DEFAULT_MAX_BODY_BYTES", "BodySizeLimit", "HttpDeps", "create_app"]


def too_large_message(limit: int, declared: int | None = None) -> str:
    """What a 413 says: the size (``declared``: its ``Content-Length``) and the limit's flag."""
    got = f"declares {declared} bytes" if declared is not None else f"passed {limit} bytes"
    return f"request body {got}; the limit is {limit} bytes (--http-max-body-bytes)"


class BodyTooLarge(StarletteHTTPException):
    """Raised from the wrapped ``receive`` once a streamed body passes the limit: a Starlette
    HTTP error, so FastAPI's body reader re-raises it as it is (any other exception there
    becomes a 400) and `errors.install_error_handlers` answers it (413, ``Connection: close``)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large_message(limit), headers={"connection": "close"})


HTTP_BODY_TIMEOUT_S = 60.0
"""Seconds a request body may take to arrive, from the request's start (408 past it)."""


class BodyTimeout(StarletteHTTPException):
    """Raised from the wrapped ``receive`` when the body did not arrive within the deadline (a
    Starlette HTTP error, as `BodyTooLarge`: answered 408, ``Connection: close``)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            408,
            f"the request body did not arrive within {timeout_s:g} s of the request's start",
            headers={"connection": "close"},
        )


class BodySizeLimit:
    """Pure ASGI middleware bounding HTTP request bodies to ``max_bytes``.

    * ``Content-Length`` over the limit (or not a number): 413 (400) in OpenAI's error shape
      before the app runs, so not one byte of the body is read.
    * No ``Content-Length`` (chunked): the bytes the app receives are counted; the chunk that
      passes the limit makes ``receive`` raise `BodyTooLarge`, answered 413 here when no
      response has started. At most ``max_bytes`` plus one chunk is ever buffered.

    * A body still incomplete ``body_timeout_s`` after the request began (a client trickling
      it byte by byte holds a connection and a coroutine): 408 in OpenAI's error shape.

    Every refusal carries ``Connection: close``: the server drops the connection instead of
    reading (and discarding) the rest of the body. Non-HTTP scopes pass through untouched.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, body_timeout_s: float = HTTP_BODY_TIMEOUT_S) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive (got {max_bytes})")
        self.app = app
        self.max_bytes = int(max_bytes)
        self.body_timeout_s = float(body_timeout_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared == -1:
            await _send_error(send, OpenAIError(400, "Content-Length is not a non-negative integer", code="bad_header"))
            return
        if declared is not None and declared > self.max_bytes:
            await _send_error(send, http_error(413, too_large_message(self.max_bytes, declared)))
            return
        seen = 0
        started = False
        body_done = False
        deadline = anyio.current_time() + self.body_timeout_s

        async def counted_receive() -> Message:
            nonlocal seen, body_done
            if body_done:  # the body is in: what follows is a wait for the disconnect
                return await receive()
            try:
                with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout(self.body_timeout_s) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
                body_done = not message.get("more_body", False)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge as exc:
            if started:  # a route streaming its answer while reading more body: cannot answer
                raise
            await _send_error(send, http_error(413, exc.detail))
        except BodyTimeout as exc:
            if started:
                raise
            await _send_error(send, http_error(408, exc.detail))


def _content_length(scope: Scope) -> int | None:
    """The request's ``Content-Length``: None when absent, -1 when not a non-negative integer
    (ASCII digits only)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            text = value.strip()
            if not text or not text.isdigit() or len(text) > 19:
                return -1
            return int(text)
    return None


async def _send_error(send: Send, err: OpenAIError) -> None:
    body = json.dumps(err.body()).encode()
    headers: list[Any] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def create_app(deps: HttpDeps) -> FastAPI:
    """The HTTP front over ``deps`` (``/openapi.json``, no Swagger / ReDoc pages), its bodies
    bounded by ``deps.max_body_bytes`` (`BodySizeLimit`) and, with ``deps.api_key``, its routes
    other than ``/health``, ``/metrics`` and ``/openapi.json`` behind the API key
    (`api_key.ApiKeyAuth`); serve it with `server.HttpServer`."""
    app = FastAPI(title="loraplane", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_error_handlers(app)
    app.include_router(health_router(deps))
    app.include_router(models_router(deps))
    app.include_router(completions_router(deps))
    app.include_router(responses_router(deps))
    app.include_router(tokenize_router(deps))
    app.include_router(admin_router(deps))
    app.include_router(tenants_router(deps))
    install_openapi(app)
    app.add_middleware(BodySizeLimit, max_bytes=deps.max_body_bytes)
    if deps.api_key:  # added last: outermost, so an unauthenticated request reaches nothing
        tenant_key = deps.tenants.accepts if deps.tenants is not None else None
        app.add_middleware(ApiKeyAuth, api_key=deps.api_key, admin_token=deps.admin_token, tenant_key=tenant_key)
    return app
