"""The FastAPI application: OpenAI-compatible routes over the control plane's own objects.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (vLLM's shapes; admin: bearer
token when one is configured, as on gRPC), ``GET /metrics`` (the control plane's Prometheus
registry), ``GET /health``. Generation endpoints are plain ``def`` routes: FastAPI runs them on
its worker threads, where they block on ``Router.generate`` exactly like a gRPC handler.
Every error is OpenAI's JSON shape (``errors.OpenAIError``).
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from control_plane.errors import ControlPlaneError
from control_plane.http import responses as R
from control_plane.http.chat_template import ChatTemplate, ChatTemplateError
from control_plane.http.errors import OpenAIError, from_control_plane
from control_plane.http.generation import HttpCallContext, Outcome, TokenOut, build_request, fold, new_request_id, now_s
from control_plane.http.models import ID_PREFIX, model_list, resolve_model
from control_plane.http.schemas import (
    CHAT_MAX_TOKENS_DEFAULT,
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraRequest,
    SamplingFields,
    UnloadLoraRequest,
)
from control_plane.registry import AdapterRegistry
from control_plane.router import Router
from control_plane.workers import WorkerPool


@dataclass
class HttpDeps:
    """What the routes use; the same objects the gRPC servicer holds.

    Attributes:
        base_name: the served base-model name (``model`` = it → no adapters).
        base_root: shown as the base model's ``root`` in ``/v1/models`` (its file path).
        tokenizer: the base tokenizer (chat prompts, log-prob token texts); None when the
            base model has none.
        chat_template: None → chat requests get a 400.
        admin_token: None → admin routes are open.
        metrics_text: the control plane's ``/metrics`` exposition (bytes, content type).
    """

    registry: AdapterRegistry
    router: Router
    pool: WorkerPool
    base_name: str
    base_root: str
    tokenizer: Any
    chat_template: ChatTemplate | None
    admin_token: str | None
    metrics_text: Callable[[], tuple[bytes, str]] | None = None


def create_app(deps: HttpDeps) -> FastAPI:
    app = FastAPI(title="loraplane", docs_url=None, redoc_url=None, openapi_url=None)
    created = now_s()

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        err = OpenAIError(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param=param)
        return JSONResponse(err.body(), status_code=400)

    def token_text(token_id: int) -> str:
        tok = deps.tokenizer
        if tok is None:
            return ""
        raw = tok.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace") if raw else tok.token_to_piece(token_id)

    def adapters_for(body: SamplingFields) -> dict[int, float]:
        lora = body.lora_map()
        if lora is not None:
            return lora
        return resolve_model(body.model, base_name=deps.base_name, registry=deps.registry)

    def check_admin(request: Request) -> None:
        if deps.admin_token is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise OpenAIError(
                401,
                "admin endpoint: send 'Authorization: Bearer <token>' (admin token configured)",
                type="authentication_error",
                code="invalid_api_key",
            )
        if not hmac.compare_digest(token.strip().encode(), deps.admin_token.encode()):
            raise OpenAIError(
                401, "admin endpoint: token rejected", type="authentication_error", code="invalid_api_key"
            )

    def run(req, body: SamplingFields, *, chat: bool, n_top: int, want_logprobs: bool, rid: str) -> Response:
        call = HttpCallContext()
        out = Outcome()
        model = body.model
        created_at = now_s()
        tokens = fold(deps.router.generate(req, call), out)

        def logprobs_of(toks, offset: int = 0):
            if not want_logprobs:
                return None
            return (
                R.chat_logprobs(toks, token_text, n_top)
                if chat
                else R.completion_logprobs(toks, token_text, n_top, offset)
            )

        if not body.stream:
            try:
                for _ in tokens:
                    pass
            except ControlPlaneError as exc:
                raise from_control_plane(exc) from None
            finally:
                call.cancel()
            make = R.chat_body if chat else R.completion_body
            result = make(rid, created_at, model, out, logprobs_of(out.tokens))
            if body.return_token_ids:
                result["prompt_token_ids"] = out.prompt_token_ids
                result["choices"][0]["token_ids"] = [t.token_id for t in out.tokens]
            return JSONResponse(result)

        try:
            first = next(tokens, None)  # errors before the first token keep their HTTP status
        except ControlPlaneError as exc:
            call.cancel()
            raise from_control_plane(exc) from None

        def chunks() -> Iterator[str]:
            streamed: list[str] = []
            if chat:
                yield R.sse(R.chat_chunk(rid, created_at, model, {"role": "assistant", "content": ""}, None, None))
            pending: list[TokenOut | None] = [first]
            try:
                while True:
                    if pending:
                        item = pending.pop()
                    else:
                        try:
                            item = next(tokens)
                        except StopIteration:
                            break
                    if item is None:  # finished: the rest of the text (a held-back tail), then the reason
                        full = "".join(streamed)
                        rest = out.text[len(full) :] if out.text.startswith(full) else ""
                        yield R.sse(
                            R.chat_chunk(
                                rid, created_at, model, {"content": rest} if rest else {}, None, out.finish_reason
                            )
                            if chat
                            else R.completion_chunk(rid, created_at, model, rest, None, out.finish_reason)
                        )
                        continue
                    offset = len("".join(streamed))
                    streamed.append(item.text)
                    lp = logprobs_of([item], offset)
                    yield R.sse(
                        R.chat_chunk(rid, created_at, model, {"content": item.text}, lp, None)
                        if chat
                        else R.completion_chunk(rid, created_at, model, item.text, lp, None)
                    )
                if body.stream_options is not None and body.stream_options.include_usage:
                    yield R.sse(
                        R.usage_chunk(
                            rid, created_at, model, "chat.completion.chunk" if chat else "text_completion", out
                        )
                    )
            except ControlPlaneError as exc:
                yield R.sse(from_control_plane(exc).body())
            yield R.SSE_DONE

        gen = chunks()

        async def body_iter() -> AsyncIterator[str]:
            try:
                while True:
                    chunk = await anyio.to_thread.run_sync(next, gen, None)
                    if chunk is None:
                        return
                    yield chunk
            finally:
                call.cancel()  # the client went away or the stream ended: free the worker's slot

        return StreamingResponse(body_iter(), media_type="text/event-stream")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return model_list(deps.base_name, deps.base_root, created, deps.registry)

    @app.post("/v1/completions")
    def completions(body: CompletionRequest) -> Response:
        body.check()
        adapters = adapters_for(body)
        prompt = body.prompt
        text, ids = None, None
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt[0], str):
            text = str(prompt[0])
        else:
            ids = [int(t) for t in prompt]
        rid = new_request_id("cmpl")
        req = build_request(
            request_id=rid,
            text=text,
            tokens=ids,
            adapters=adapters,
            max_tokens=body.max_tokens or 16,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=body.top_p or 1.0,
            top_k=body.top_k or 0,
            seed=body.seed,
            logprobs=body.logprobs or 0,
            stop=body.stop_list(),
            ignore_eos=body.ignore_eos,
        )
        return run(req, body, chat=False, n_top=body.logprobs or 0, want_logprobs=body.logprobs is not None, rid=rid)

    @app.post("/v1/chat/completions")
    def chat_completions(body: ChatCompletionRequest) -> Response:
        body.check()
        if deps.chat_template is None or deps.tokenizer is None:
            raise OpenAIError(
                400,
                "this model has no chat template (no tokenizer.chat_template in the GGUF and "
                "no built-in one for its architecture); start with --chat-template FILE",
                param="messages",
            )
        adapters = adapters_for(body)
        messages = [flatten_message(m.model_dump(exclude_none=True)) for m in body.messages]
        try:
            prompt = deps.chat_template.render(messages, add_generation_prompt=body.add_generation_prompt)
        except ChatTemplateError as exc:
            raise OpenAIError(400, str(exc), param="messages") from None
        ids = deps.tokenizer.encode(prompt, add_special=False, parse_special=True)  # BOS: the template's
        rid = new_request_id("chatcmpl")
        n_top = body.top_logprobs or 0
        req = build_request(
            request_id=rid,
            text=None,
            tokens=ids,
            adapters=adapters,
            max_tokens=body.max_completion_tokens or body.max_tokens or CHAT_MAX_TOKENS_DEFAULT,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=body.top_p or 1.0,
            top_k=body.top_k or 0,
            seed=body.seed,
            logprobs=n_top,
            stop=body.stop_list(),
            ignore_eos=body.ignore_eos,
        )
        return run(req, body, chat=True, n_top=n_top, want_logprobs=body.logprobs, rid=rid)

    @app.post("/v1/load_lora_adapter")
    def load_lora_adapter(body: LoadLoraRequest, request: Request) -> Response:
        check_admin(request)
        try:
            # nothing is pushed: workers fetch an adapter's bytes the first time a request needs it
            reg = deps.registry.register_server_path(body.lora_path, name=body.lora_name)
        except ControlPlaneError as exc:
            raise from_control_plane(exc) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully (id {reg.record.id}).")

    @app.post("/v1/unload_lora_adapter")
    def unload_lora_adapter(body: UnloadLoraRequest, request: Request) -> Response:
        check_admin(request)
        name = body.lora_name
        try:
            if name == deps.base_name:
                raise OpenAIError(
                    400,
                    f"'{name}' is the base model; only adapters can be unloaded",
                    param="lora_name",
                    code="base_model",
                )
            if name.startswith(ID_PREFIX) and name[len(ID_PREFIX) :].isdigit():
                adapter_id = int(name[len(ID_PREFIX) :])
            else:
                ids = resolve_model(name, base_name=deps.base_name, registry=deps.registry)
                (adapter_id,) = ids
            deps.registry.unregister(adapter_id)
            deps.pool.unload_adapter(adapter_id)
        except ControlPlaneError as exc:
            raise from_control_plane(exc) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully (id {adapter_id}).")

    @app.get("/metrics")
    def metrics() -> Response:
        if deps.metrics_text is None:
            raise OpenAIError(404, "metrics are not enabled", type="not_found_error")
        data, content_type = deps.metrics_text()
        return Response(data, media_type=content_type)

    return app


def flatten_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose ``content`` is a list of parts becomes one string of its text parts
    (the multimodal parts a text model cannot take are refused)."""
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text":
                raise OpenAIError(
                    400, f"content part of type '{part.get('type')}' is not supported (text only)", param="messages"
                )
            texts.append(str(part.get("text", "")))
        message = {**message, "content": "".join(texts)}
    elif content is None:
        message = {**message, "content": ""}
    return message
