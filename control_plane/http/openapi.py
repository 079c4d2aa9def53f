"""``GET /openapi.json``: the HTTP API's schema with its request bodies and answers.

The generation and admin routes read their bodies themselves (size-bounded, parsed on a worker
thread: `schemas.parse_body`), so FastAPI cannot see their request models, and they answer with
plain dicts. `install_openapi` fills both in: each route's request body is the pydantic model it
parses (`REQUEST_MODELS`), each answer the model of its JSON body (`RESPONSE_MODELS`, written
here for the schema only: the routes build the bodies in `responses` / `response_events`), and
every 4xx/5xx OpenAI's error shape (`ErrorResponse`). Streamed answers (``stream: true``) are
server-sent events of the chunk shapes in docs/http-api.md; the schema lists
``text/event-stream`` for them.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from control_plane.http.responses_api import ResponsesRequest
from control_plane.http.schemas import ChatCompletionRequest, CompletionRequest, LoadLoraRequest, UnloadLoraRequest
from control_plane.http.tenant_routes import AddTenantBody
from control_plane.http.tokenize import DetokenizeRequest, TokenizeRequest


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorBody(_Open):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Open):
    """Every error answer: ``{"error": {...}}`` (`errors.OpenAIError`)."""

    error: ErrorBody


class Usage(_Open):
    """Token counts of a request (prompt, generated, cached prompt tokens)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(_Open):
    """Legacy completions log-probs (``echo`` puts the prompt's first: null for its first token)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Open):
    """One prompt's answer (``index``: its place in a batch)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionResponse(_Open):
    """``POST /v1/completions``, not streamed."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class FunctionCall(_Open):
    """A call's function: its name and arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(_Open):
    """One tool call of an answer."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Open):
    """The answer's message: text (null when only calls) and tool calls."""

    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Open):
    """The chat answer."""

    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Open):
    """``POST /v1/chat/completions``, not streamed."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ResponseObject(_Open):
    """``POST /v1/responses``, not streamed: OpenAI's ``response`` object."""

    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ModelCard(_Open):
    """A served model: the base, or an adapter (``parent`` the base)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int | None = None
    adapter_id: int | None = None
    source_format: str | None = None
    aliases: list[str] | None = None


class ModelList(_Open):
    """``GET /v1/models``."""

    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Open):
    """``POST /tokenize`` (vLLM's)."""

    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Open):
    """``POST /detokenize`` (vLLM's)."""

    prompt: str


class Version(_Open):
    """``GET /version``."""

    version: str


REQUEST_MODELS: dict[tuple[str, str], type[BaseModel]] = {
    ("/v1/completions", "post"): CompletionRequest,
    ("/v1/chat/completions", "post"): ChatCompletionRequest,
    ("/v1/responses", "post"): ResponsesRequest,
    ("/tokenize", "post"): TokenizeRequest,
    ("/detokenize", "post"): DetokenizeRequest,
    ("/v1/load_lora_adapter", "post"): LoadLoraRequest,
    ("/v1/unload_lora_adapter", "post"): UnloadLoraRequest,
    ("/v1/tenants", "post"): AddTenantBody,
}
"""The body each route parses."""

RESPONSE_MODELS: dict[tuple[str, str], type[BaseModel]] = {
    ("/v1/completions", "post"): CompletionResponse,
    ("/v1/chat/completions", "post"): ChatCompletionResponse,
    ("/v1/responses", "post"): ResponseObject,
    ("/v1/models", "get"): ModelList,
    ("/v1/models/{model}", "get"): ModelCard,
    ("/tokenize", "post"): TokenizeResponse,
    ("/detokenize", "post"): DetokenizeResponse,
    ("/version", "get"): Version,
}
"""The JSON body of each route's 200 answer."""

STREAMED = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
"""Routes that answer ``stream: true`` with server-sent events."""


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document of ``app``'s routes with `REQUEST_MODELS`, `RESPONSE_MODELS` and
    `ErrorResponse` filled in (module docstring)."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    models: set[type[BaseModel]] = {*REQUEST_MODELS.values(), *RESPONSE_MODELS.values(), ErrorResponse}
    _, defs = models_json_schema(
        [(m, "validation") for m in sorted(models, key=lambda m: m.__name__)],
        ref_template="#/components/schemas/{model}",
    )
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(defs.get("$defs", {}))
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            model = REQUEST_MODELS.get((path, method))
            if model is not None:
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": _ref(model.__name__)}},
                }
            op.get("responses", {}).pop("422", None)  # FastAPI's own validation answer: never sent here
            answer = RESPONSE_MODELS.get((path, method))
            ok = op.setdefault("responses", {}).setdefault("200", {"description": "Successful Response"})
            if answer is not None:
                ok["content"] = {"application/json": {"schema": _ref(answer.__name__)}}
                if path in STREAMED:
                    ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
            if path == "/metrics":  # Prometheus' text exposition, not JSON
                ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
            if path not in ("/health", "/ping", "/metrics"):
                op["responses"]["default"] = {
                    "description": "An error, in OpenAI's shape",
                    "content": {"application/json": {"schema": _ref(ErrorResponse.__name__)}},
                }
    return doc


def install_openapi(app: FastAPI) -> None:
    """Serve `openapi_schema` (built once, on the first ``GET /openapi.json``) for ``app``."""

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_schema(app)
        return app.openapi_schema

    app.openapi = schema  # type: ignore[method-assign]


__all__ = ["REQUEST_MODELS", "RESPONSE_MODELS", "install_openapi", "openapi_schema"]
