"""``model`` → adapter map, and the ``GET /v1/models`` listing (`models_router`).

Rules (vLLM: ``model`` = an adapter's name; SGLang: ``base:adapter``; ours: ``adapter:<id>``):
  * the served base-model name → no adapters (an explicit empty map, not the default set);
  * ``adapter:<id>`` → that adapter at scale 1 (404 when the id is not registered; ``<id>`` is
    ASCII digits within uint32, `resolution.parse_adapter_id`: ``adapter:٣`` names nothing);
  * ``<base name>:<adapter>`` → the adapter part resolved by these rules;
  * an adapter name → that adapter at scale 1. Names are metadata, not keys, so a name shared
    by several adapters is a 400 that lists their ids (use ``adapter:<id>``); an unknown name
    is a 404 listing what is served.
An adapter may not be named like the base model (`registry.check_adapter_name`); a row that
predates that rule is listed as ``adapter:<id>``, so ``/v1/models`` never shows an id twice.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from control_plane.http.deps import HttpDeps
from control_plane.http.errors import OpenAIError
from control_plane.http.generation import now_s
from control_plane.registry import AdapterRegistry
from control_plane.resolution import parse_adapter_id
from control_plane.store import AdapterRecord

ID_PREFIX = "adapter:"


def served_name(rec: AdapterRecord, records: list[AdapterRecord], base_name: str | None = None) -> str:
    """The id ``/v1/models`` shows: the name when unique, non-empty and not the base model's
    (``base_name``; rows registered before names were checked against it), else
    ``adapter:<id>``. So no id is ever listed twice."""
    if (
        rec.name
        and rec.name != base_name
        and sum(1 for r in records if r.name == rec.name) == 1
        and not rec.name.startswith(ID_PREFIX)
    ):
        return rec.name
    return f"{ID_PREFIX}{rec.id}"


def resolve_model(model: str, *, base_name: str, registry: AdapterRegistry) -> dict[int, float]:
    """The ``{id: scale}`` map ``model`` names (see the module docstring).

    Raises:
        OpenAIError: 404 unknown model / adapter id, 400 ambiguous name.
    """
    if model == base_name:
        return {}
    if model.startswith(base_name + ":") and len(model) > len(base_name) + 1:
        return resolve_model(model[len(base_name) + 1 :], base_name=base_name, registry=registry)
    records = registry.list()
    if model.startswith(ID_PREFIX):
        text = model[len(ID_PREFIX) :]
        adapter_id = parse_adapter_id(text)
        if adapter_id is not None and any(r.id == adapter_id for r in records):
            return {adapter_id: 1.0}
        raise OpenAIError(
            404,
            f"The model '{model}' does not exist: no adapter with id '{text}' is "
            f"registered (ids: {[r.id for r in records]})",
            param="model",
            code="model_not_found",
            type="not_found_error",
        )
    matches = [r.id for r in records if r.name == model]
    if len(matches) == 1:
        return {matches[0]: 1.0}
    if len(matches) > 1:
        raise OpenAIError(
            400,
            f"The model name '{model}' is ambiguous: adapters {matches} share it; name one as 'adapter:<id>'",
            param="model",
            code="ambiguous_model",
        )
    available = [base_name] + [served_name(r, records, base_name) for r in records]
    raise OpenAIError(
        404,
        f"The model '{model}' does not exist (served: {available})",
        param="model",
        code="model_not_found",
        type="not_found_error",
    )


def model_list(base_name: str, base_root: str, created: int, registry: AdapterRegistry) -> dict[str, Any]:
    """``GET /v1/models``: the base model, then every adapter with ``parent`` = the base."""
    records = registry.list()
    data = [
        {
            "id": base_name,
            "object": "model",
            "created": created,
            "owned_by": "loraplane",
            "root": base_root,
            "parent": None,
        }
    ]
    for r in records:
        data.append(
            {
                "id": served_name(r, records, base_name),
                "object": "model",
                "created": int(r.created_at),
                "owned_by": "loraplane",
                "root": f"{ID_PREFIX}{r.id}",
                "parent": base_name,
                "adapter_id": r.id,
                "source_format": r.source_format,
            }
        )
    return {"object": "list", "data": data}


def model_card(model: str, base_name: str, base_root: str, created: int, registry: AdapterRegistry) -> dict[str, Any]:
    """``GET /v1/models/{model}``: the `model_list` entry whose ``id`` is ``model``, else the
    entry of what ``model`` resolves to by the request rules (``adapter:<id>``,
    ``<base>:<adapter>``), so every name a request accepts can be retrieved.

    Raises:
        OpenAIError: 404 ``model_not_found`` (OpenAI's shape), 400 ambiguous name.
    """
    data = model_list(base_name, base_root, created, registry)["data"]
    for entry in data:
        if entry["id"] == model:
            return entry
    adapters = resolve_model(model, base_name=base_name, registry=registry)
    if not adapters:
        return data[0]
    (adapter_id,) = adapters
    return next(e for e in data[1:] if e["adapter_id"] == adapter_id)


def models_router(deps: HttpDeps) -> APIRouter:
    """``GET /v1/models`` (`model_list`) and ``GET /v1/models/{model}`` (`model_card`; the id
    may hold ``:`` and ``/``); the base model's ``created`` is this call's time."""
    router = APIRouter()
    created = now_s()

    @router.get("/v1/models")
    def models() -> dict[str, Any]:
        return model_list(deps.base_name, deps.base_root, created, deps.registry)

    @router.get("/v1/models/{model:path}")
    def model(model: str) -> dict[str, Any]:
        return model_card(model, deps.base_name, deps.base_root, created, deps.registry)

    return router
