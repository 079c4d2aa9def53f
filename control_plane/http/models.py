"""``model`` → adapter map, and the ``GET /v1/models`` listing (`models_router`).

Rules (vLLM: ``model`` = an adapter's name; SGLang: ``base:adapter``; ours: ``adapter:<id>``):
  * the served base-model name → no adapters (an explicit empty map, not the default set);
  * ``<base name>:<adapter>`` → the adapter part resolved by these rules;
  * otherwise `resolution.find_adapter`, the rule the CLI and gRPC share: ASCII digits or
    ``adapter:<id>`` → that id at scale 1 (404 when not registered; ``adapter:٣`` names
    nothing); anything else an adapter's name or one of its aliases → that adapter at scale 1.
    Names are metadata, not keys (files may embed the same ``general.name``), so a name
    several adapters answer to is a 400 that lists their ids (use ``adapter:<id>``); an
    unknown name is a 404 listing what is served.
An adapter may not be named like the base model, ``adapter:…`` or all digits
(`control_plane.names.name_clash`); a row that predates those rules is listed as ``adapter:<id>``, so
``/v1/models`` never shows an id twice. Each alias is listed as a model of its own (what a
vLLM LoRA controller looks for after ``load_lora_adapter``), with the same ``adapter_id``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from control_plane.errors import MAX_LISTED, AmbiguousNameError, NotFoundError, echo, listing
from control_plane.http.deps import HttpDeps
from control_plane.http.errors import OpenAIError
from control_plane.http.generation import now_s
from control_plane.registry import AdapterRegistry
from control_plane.resolution import ID_PREFIX, find_adapter, is_id_token
from control_plane.store import AdapterRecord

__all__ = ["ID_PREFIX", "model_list", "models_router", "resolve_model", "served_name"]


def _servable(name: str, records: list[AdapterRecord], base_name: str | None) -> bool:
    """``name`` can be listed as a model id: non-empty, not the base model's name, not an id
    form, and exactly one adapter answers to it."""
    return (
        bool(name)
        and name != base_name
        and not name.startswith(ID_PREFIX)
        and not is_id_token(name)
        and sum(1 for r in records if name in r.names) == 1
    )


def served_name(rec: AdapterRecord, records: list[AdapterRecord], base_name: str | None = None) -> str:
    """The id ``/v1/models`` shows: the name when unique (over names and aliases), non-empty
    and not the base model's (``base_name``; rows registered before names were checked
    against it), else ``adapter:<id>``. So no id is ever listed twice."""
    if _servable(rec.name, records, base_name):
        return rec.name
    return f"{ID_PREFIX}{rec.id}"


def served_aliases(rec: AdapterRecord, records: list[AdapterRecord], base_name: str | None = None) -> list[str]:
    """The aliases of ``rec`` listed as models of their own (the unique ones)."""
    return [a for a in rec.aliases if _servable(a, records, base_name)]


_ALL_MODELS = "; GET /v1/models lists them all"
"""What a 404 adds when its list of served models is cut (`MAX_LISTED`)."""


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
    try:
        return {find_adapter(model, records): 1.0}
    except AmbiguousNameError:
        matches = [r.id for r in records if model in r.names]
        raise OpenAIError(
            400,
            f"The model name '{echo(model)}' is ambiguous: adapters {matches} share it; name one as 'adapter:<id>'",
            param="model",
            code="ambiguous_model",
        ) from None
    except NotFoundError:
        pass
    if model.startswith(ID_PREFIX) or is_id_token(model):
        text = model.removeprefix(ID_PREFIX)
        ids = [r.id for r in records]
        message = (
            f"The model '{echo(model)}' does not exist: no adapter with id '{echo(text)}' is "
            f"registered (ids: {listing(ids)}{_ALL_MODELS if len(ids) > MAX_LISTED else ''})"
        )
    else:
        available = [base_name]
        for r in records:  # each name costs a pass over the records: only those the message shows
            available += [served_name(r, records, base_name), *served_aliases(r, records, base_name)]
            if len(available) > MAX_LISTED:
                break
        if len(available) <= MAX_LISTED:
            served = repr(available)
        else:
            served = "[" + ", ".join(repr(n) for n in available[:MAX_LISTED]) + f", …]{_ALL_MODELS}"
        message = f"The model '{echo(model)}' does not exist (served: {served})"
    raise OpenAIError(404, message, param="model", code="model_not_found", type="not_found_error")


def model_list(
    base_name: str, base_root: str, created: int, registry: AdapterRegistry, max_model_len: int | None = None
) -> dict[str, Any]:
    """``GET /v1/models``: the base model, then every adapter with ``parent`` = the base (its
    name or ``adapter:<id>``, then one entry per alias; each carries ``adapter_id`` and the
    adapter's ``aliases``). ``root`` is where the model came from, as vLLM's cards say it: the
    base model's file, an adapter's source (the path it was registered from, or its stored copy;
    `AdapterRecord.path`). ``max_model_len``: the context a prompt is sized for (tokens; the
    workers' ``n_ctx``), on every entry (adapters share the base's); null while unknown."""
    records = registry.list()
    data = [
        {
            "id": base_name,
            "object": "model",
            "created": created,
            "owned_by": "loraplane",
            "root": base_root,
            "parent": None,
            "max_model_len": max_model_len,
        }
    ]
    for r in records:
        for model_id in (served_name(r, records, base_name), *served_aliases(r, records, base_name)):
            data.append(
                {
                    "id": model_id,
                    "object": "model",
                    "created": int(r.created_at),
                    "owned_by": "loraplane",
                    "root": r.path or f"{ID_PREFIX}{r.id}",
                    "parent": base_name,
                    "max_model_len": max_model_len,
                    "adapter_id": r.id,
                    "source_format": r.source_format,
                    "aliases": list(r.aliases),
                }
            )
    return {"object": "list", "data": data}


def model_card(
    model: str,
    base_name: str,
    base_root: str,
    created: int,
    registry: AdapterRegistry,
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """``GET /v1/models/{model}``: the `model_list` entry whose ``id`` is ``model``, else the
    entry of what ``model`` resolves to by the request rules (``adapter:<id>``,
    ``<base>:<adapter>``), so every name a request accepts can be retrieved.

    Raises:
        OpenAIError: 404 ``model_not_found`` (OpenAI's shape), 400 ambiguous name.
    """
    data = model_list(base_name, base_root, created, registry, max_model_len)["data"]
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
        return model_list(deps.base_name, deps.base_root, created, deps.registry, deps.prompt_n_ctx())

    @router.get("/v1/models/{model:path}")
    def model(model: str) -> dict[str, Any]:
        return model_card(model, deps.base_name, deps.base_root, created, deps.registry, deps.prompt_n_ctx())

    return router
