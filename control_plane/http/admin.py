"""Admin routes in vLLM's shapes: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``.

When an admin token is configured they need ``Authorization: Bearer <token>`` (the same token
and check as the gRPC admin methods, `control_plane.auth.check_bearer`), else 401. Loading
registers a server-side path (GGUF file or PEFT folder); nothing is sent to workers, which
fetch an adapter's bytes the first time a request needs it. Unloading unregisters the adapter
and drops it from every worker.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from control_plane.auth import BearerCheck, check_bearer
from control_plane.errors import ControlPlaneError
from control_plane.http.deps import HttpDeps
from control_plane.http.errors import OpenAIError, from_control_plane
from control_plane.http.models import ID_PREFIX, resolve_model
from control_plane.http.schemas import LoadLoraRequest, UnloadLoraRequest, parse_body
from control_plane.resolution import parse_adapter_id


def require_admin(authorization: str | None, admin_token: str | None) -> None:
    """Pass when no token is configured or ``authorization`` (the request's header) carries it
    as its bearer token. Checked before the body is parsed.

    Raises:
        OpenAIError: 401 ``authentication_error`` / ``invalid_api_key``: no bearer token, or
            the wrong one.
    """
    if admin_token is None:
        return
    found = check_bearer(authorization, admin_token)
    if found is BearerCheck.MISSING:
        raise OpenAIError(
            401,
            "admin endpoint: send 'Authorization: Bearer <token>' (admin token configured)",
            type="authentication_error",
            code="invalid_api_key",
        )
    if found is BearerCheck.REJECTED:
        raise OpenAIError(401, "admin endpoint: token rejected", type="authentication_error", code="invalid_api_key")


def unload_target(name: str, deps: HttpDeps) -> int:
    """The adapter id ``lora_name`` names: ``adapter:<id>`` verbatim, else by `resolve_model`.

    Raises:
        OpenAIError: 400 for the base model's name or an ambiguous name, 404 for an unknown one.
    """
    if name == deps.base_name:
        raise OpenAIError(
            400, f"'{name}' is the base model; only adapters can be unloaded", param="lora_name", code="base_model"
        )
    if name.startswith(ID_PREFIX) and (adapter_id := parse_adapter_id(name[len(ID_PREFIX) :])) is not None:
        return adapter_id
    found = resolve_model(name, base_name=deps.base_name, registry=deps.registry)
    if len(found) != 1:  # "<base>:<base>": the base model again
        raise OpenAIError(
            400, f"'{name}' names the base model; only adapters can be unloaded", param="lora_name", code="base_model"
        )
    return next(iter(found))


def admin_router(deps: HttpDeps) -> APIRouter:
    """The LoRA load / unload routes over ``deps.registry`` and ``deps.pool``."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        raw = await request.body()  # parsed, like the work, on a worker thread
        return await run_in_threadpool(load, raw, request.headers.get("authorization"))

    def load(raw: bytes, authorization: str | None) -> Response:
        require_admin(authorization, deps.admin_token)
        body = parse_body(raw, LoadLoraRequest)
        try:
            reg = deps.registry.register_server_path(body.lora_path, name=body.lora_name)
        except ControlPlaneError as exc:
            raise from_control_plane(exc) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully (id {reg.record.id}).")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        raw = await request.body()
        return await run_in_threadpool(unload, raw, request.headers.get("authorization"))

    def unload(raw: bytes, authorization: str | None) -> Response:
        require_admin(authorization, deps.admin_token)
        body = parse_body(raw, UnloadLoraRequest)
        name = body.lora_name
        try:
            adapter_id = unload_target(name, deps)
            deps.registry.unregister(adapter_id)
            deps.pool.unload_adapter(adapter_id)
        except ControlPlaneError as exc:
            raise from_control_plane(exc) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully (id {adapter_id}).")

    return router
