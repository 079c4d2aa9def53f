"""Tenant admin routes on the HTTP front, mirroring the gRPC tenant RPCs:
``GET /v1/tenants`` (limits and usage), ``POST /v1/tenants`` (add; answers the tenant with its
API key, ``api_key``, this once),
``DELETE /v1/tenants/{name}``.

Guarded like the other admin routes (`control_plane.http.admin.require_admin`: the admin
token when one is configured; a tenant key never opens them, `control_plane.auth`). The
JSON shapes are the CLI's ``tenants … --json`` ones (`tenant_json`). Errors in OpenAI's shape:
400 bad name / setting / key, 404 unknown tenant, 409 name or key taken.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict
from starlette.concurrency import run_in_threadpool

from control_plane.errors import AlreadyExistsError, ControlPlaneError
from control_plane.http.admin import require_admin
from control_plane.http.deps import HttpDeps
from control_plane.http.errors import OpenAIError, from_control_plane
from control_plane.http.schemas import HttpBody, parse_body
from control_plane.tenant_admin import TenantAdmin, TenantView


class AddTenantBody(HttpBody):
    """``POST /v1/tenants``: the name, an optional key (else one is generated) and settings.

    Strict types: ``true`` is not a ``max_concurrent`` of 1, nor ``"2"`` a weight (an integer
    passes for ``weight``); a setting of the wrong JSON type is 400 naming it.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    api_key: str | None = None
    weight: float | None = None
    priority: int | None = None
    max_concurrent: int | None = None
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None

    def settings(self) -> dict[str, float | int]:
        """The settings given (the others take their defaults)."""
        fields = ("weight", "priority", "max_concurrent", "tokens_per_minute", "requests_per_minute")
        return {f: getattr(self, f) for f in fields if getattr(self, f) is not None}


def tenant_json(view: TenantView) -> dict[str, Any]:
    """A tenant as JSON: its settings, key count and ``usage`` (the CLI's shape)."""
    r, u = view.record, view.usage
    return {
        "name": r.name,
        "weight": r.weight,
        "priority": r.priority,
        "max_concurrent": r.max_concurrent,
        "tokens_per_minute": r.tokens_per_minute,
        "requests_per_minute": r.requests_per_minute,
        "key_count": r.key_count,
        "usage": {
            "in_flight": u.in_flight,
            "tokens_available": u.tokens_available,
            "requests_available": u.requests_available,
            "requests_total": u.requests_total,
            "tokens_total": u.tokens_total,
            "rejected_total": u.rejected_total,
        },
    }


def _error(exc: ControlPlaneError) -> OpenAIError:
    if isinstance(exc, AlreadyExistsError):
        return OpenAIError(409, str(exc), code="already_exists")
    return from_control_plane(exc)


def tenants_router(deps: HttpDeps) -> APIRouter:
    """The tenant routes over ``deps.tenant_admin``."""
    router = APIRouter()

    def admin(authorization: str | None) -> TenantAdmin:
        require_admin(authorization, deps.admin_token)
        if deps.tenant_admin is None:
            raise OpenAIError(503, "tenants are not served by this control plane", type="service_unavailable")
        return deps.tenant_admin

    @router.get("/v1/tenants")
    async def list_tenants(request: Request) -> Response:
        return await run_in_threadpool(listing, request.headers.get("authorization"))

    def listing(authorization: str | None) -> Response:
        tenants = admin(authorization)
        try:
            views = tenants.list()
        except ControlPlaneError as exc:
            raise _error(exc) from None
        return JSONResponse({"tenants": [tenant_json(v) for v in views]})

    @router.post("/v1/tenants")
    async def add_tenant(request: Request) -> Response:
        raw = await request.body()
        return await run_in_threadpool(add, raw, request.headers.get("authorization"))

    def add(raw: bytes, authorization: str | None) -> Response:
        tenants = admin(authorization)
        body = parse_body(raw, AddTenantBody)
        try:
            view, key = tenants.add(body.name, body.settings(), body.api_key or "")
        except ControlPlaneError as exc:
            raise _error(exc) from None
        return JSONResponse({**tenant_json(view), "api_key": key})

    @router.delete("/v1/tenants/{name:path}")
    async def remove_tenant(name: str, request: Request) -> Response:
        return await run_in_threadpool(remove, name, request.headers.get("authorization"))

    def remove(name: str, authorization: str | None) -> Response:
        tenants = admin(authorization)
        try:
            tenants.remove(name)
        except ControlPlaneError as exc:
            raise _error(exc) from None
        return JSONResponse({"name": name, "removed": True})

    return router
