"""Admin routes in vLLM's shapes: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``.

When an admin token is configured they need ``Authorization: Bearer <token>`` (the same token
and check as the gRPC admin methods, `control_plane.auth.check_bearer`), else 401. Loading
registers a server-side path (GGUF file or PEFT folder); nothing is sent to workers, which
fetch an adapter's bytes the first time a request needs it.

Lifecycle, as vLLM's ``serving_models.py`` (``load_lora_adapter`` / ``unload_lora_adapter``)
answers it, so LoRA controllers built for vLLM work unchanged:

* loading a ``lora_name`` some adapter already answers to (name or alias) is a 400 "The lora
  adapter '<name>' has already been loaded.", whatever the path; nothing is read;
* loading content already registered (same sha256) under a new name adds that name as an
  **alias** of the same adapter id (`AdapterRegistry.register_server_path`): it is served as
  ``model: <name>`` at once and listed in ``/v1/models``;
* unloading drops the name unloaded, not more (`AdapterRegistry.unload_name`): an alias goes
  alone; the adapter's own name, while it has aliases, is replaced by its oldest alias; the
  adapter is unregistered (and dropped from every worker) when its last name goes, or when
  ``lora_name`` is an id (``adapter:<id>``, ASCII digits).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from control_plane.auth import BearerCheck, check_bearer
from control_plane.errors import AlreadyExistsError, ControlPlaneError, InvalidArgumentError
from control_plane.http.deps import HttpDeps
from control_plane.http.errors import OpenAIError, from_control_plane
from control_plane.http.models import resolve_model
from control_plane.http.schemas import LoadLoraRequest, UnloadLoraRequest, parse_body


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


def unload_target(name: str, deps: HttpDeps) -> str:
    """The adapter token ``lora_name`` names: ``<base>:<adapter>`` loses its base prefix.

    Raises:
        OpenAIError: 400 for the base model's name (alone or as ``<base>:<base>``).
    """
    target = name
    if target.startswith(deps.base_name + ":") and len(target) > len(deps.base_name) + 1:
        target = target[len(deps.base_name) + 1 :]
    if target == deps.base_name:
        raise OpenAIError(
            400, f"'{name}' is the base model; only adapters can be unloaded", param="lora_name", code="base_model"
        )
    return target


def already_loaded(name: str) -> OpenAIError:
    """vLLM's answer to loading a ``lora_name`` that is taken (``serving_models.py``)."""
    return OpenAIError(
        400, f"The lora adapter '{name}' has already been loaded.", param="lora_name", code="lora_already_loaded"
    )


def admin_router(deps: HttpDeps) -> APIRouter:
    """The LoRA load / unload routes over ``deps.registry`` and ``deps.announcer``."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        raw = await request.body()  # parsed, like the work, on a worker thread
        return await run_in_threadpool(load, raw, request.headers.get("authorization"))

    def load(raw: bytes, authorization: str | None) -> Response:
        require_admin(authorization, deps.admin_token)
        body = parse_body(raw, LoadLoraRequest)
        name = body.lora_name
        try:
            if not name:
                raise InvalidArgumentError("lora_name is empty: name the adapter")
            if deps.registry.names.owners(name):
                raise already_loaded(name)
            reg = deps.registry.register_server_path(body.lora_path, name=name)
        except AlreadyExistsError:  # the name was taken between the check above and now
            raise already_loaded(name) from None
        except ControlPlaneError as exc:
            raise from_control_plane(exc) from None
        if not reg.named:  # another caller took the name meanwhile (or loaded it first)
            raise already_loaded(name)
        how = f"alias of adapter {reg.record.id}" if reg.aliased else f"id {reg.record.id}"
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully ({how}).")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        raw = await request.body()
        return await run_in_threadpool(unload, raw, request.headers.get("authorization"))

    def unload(raw: bytes, authorization: str | None) -> Response:
        require_admin(authorization, deps.admin_token)
        body = parse_body(raw, UnloadLoraRequest)
        name = body.lora_name
        target = unload_target(name, deps)
        resolve_model(target, base_name=deps.base_name, registry=deps.registry)  # 404 / 400 as for `model`
        try:
            removal = deps.registry.unload_name(target)
            if removal.unregistered:
                deps.announcer.unload_adapter(removal.record.id)
        except ControlPlaneError as exc:
            raise from_control_plane(exc) from None
        rec = removal.record
        left = rec.names[0] if rec.names else f"adapter:{rec.id}"
        how = f"id {rec.id}" if removal.unregistered else f"adapter {rec.id} stays as '{left}'"
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully ({how}).")

    return router
