"""`ApiKeyAuth`: the HTTP front's inference API key (``--api-key`` / ``$LORAPLANE_API_KEY``).

When a key is configured, every request whose path is not in `control_plane.auth.OPEN_HTTP_PATHS`
(``/health``, ``/metrics``, ``/openapi.json``) needs ``Authorization: Bearer <key>``; the admin
token is accepted as well (admin ⊇ inference). Anything else is answered 401 in OpenAI's error
shape with ``code: "invalid_api_key"`` (what the official ``openai`` client raises as
``AuthenticationError``) before the app runs, so no byte of the body is read. The admin routes
check the admin token afterwards as before (`control_plane.http.admin.require_admin`): with an
admin token configured, the API key alone does not load or unload adapters.

A tenant's API key (`control_plane.tenants`) passes as well, except on the admin routes
(`control_plane.auth.ADMIN_HTTP_PATHS`): a tenant runs inference, never administers.

The rule follows vLLM's ``--api-key`` middleware (``vllm/entrypoints/openai/api_server.py``,
which guards ``/v1``) but guards by default: a route added later is covered without a list to
update.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from control_plane.auth import OPEN_HTTP_PATHS, BearerCheck, check_api_key, is_admin_http_path
from control_plane.http.errors import OpenAIError


def api_key_error(found: BearerCheck) -> OpenAIError:
    """The 401 for a request without the key (``MISSING``) or with a wrong one (``REJECTED``);
    the presented value is never echoed."""
    if found is BearerCheck.MISSING:
        message = "this server needs an API key: send 'Authorization: Bearer <key>' (--api-key)"
    else:
        message = "API key rejected"
    return OpenAIError(401, message, type="authentication_error", code="invalid_api_key")


class ApiKeyAuth:
    """Pure ASGI middleware: non-open paths need the API key (or the admin token) as bearer token.

    Args:
        app: the wrapped application.
        api_key: the inference key (non-empty).
        admin_token: also accepted (None: only the key).
        tenant_key: ``tenant_key(token)``: whether ``token`` is a tenant's API key (accepted
            outside the admin routes); None: no tenant keys.

    Non-HTTP scopes (lifespan) pass through untouched.
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str,
        admin_token: str | None = None,
        tenant_key: Callable[[str], bool] | None = None,
    ) -> None:
        if not api_key:
            raise ValueError("an empty API key would accept anyone")
        self.app = app
        self.api_key = api_key
        self.admin_token = admin_token
        self.tenant_key = tenant_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path", "") in OPEN_HTTP_PATHS:
            await self.app(scope, receive, send)
            return
        authorization = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                authorization = value.decode("utf-8", "replace")
                break
        path = scope.get("path", "")
        tenant_key = None if is_admin_http_path(path) else self.tenant_key
        found = check_api_key(authorization, self.api_key, self.admin_token, tenant_key)
        if found is BearerCheck.ACCEPTED:
            await self.app(scope, receive, send)
            return
        err = api_key_error(found)
        body = json.dumps(err.body()).encode()
        headers: list[Any] = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
