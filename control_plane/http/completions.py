"""``POST /v1/completions`` and ``POST /v1/chat/completions``: request body → GenerateRequest →
``Router.generate`` → `streaming.CompletionStream` → JSON body or server-sent events.

`completions_router` builds the two routes: they read the size-bounded body on the event loop
and hand it to a worker thread, where `schemas.parse_body` validates it, `adapters_for` picks
the adapters (``model`` or ``lora``), `chat_prompt_ids` renders and tokenizes a chat,
`check_prompt_bytes` / `check_prompt_ids` / `check_prompt_tokens` size the prompt before it
costs anything, and `respond` blocks on the router exactly like a gRPC handler. Tools go through
`tools` (parsed calls, or a forced call as structured output).

Parameters, tokenization and BOS, input limits: docs/http-api.md, "Request parameters" and
"Input limits".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from control_plane.grammar_check import InlineChecker, TenantChecker
from control_plane.http.chat_template import RENDER_MAX_CHARS, ChatTemplate, ChatTemplateError
from control_plane.http.deps import HttpDeps
from control_plane.http.errors import OpenAIError
from control_plane.http.generation import HttpCallContext, build_request, new_request_id, now_s
from control_plane.http.models import resolve_model
from control_plane.http.responses import token_text_of
from control_plane.http.schemas import (
    CHAT_MAX_TOKENS_DEFAULT,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    parse_body,
)
from control_plane.http.streaming import CompletionBatch, CompletionStream, RelayResponse
from control_plane.http.structured import response_format_of
from control_plane.http.tool_prompt import hermes_messages, role_diagnosis
from control_plane.http.tools import (
    ForcedCall,
    check_tools,
    forced_call_of,
    template_message,
    template_renders_tools,
)
from loraplane.v1 import common_pb2

COMPLETION_MAX_TOKENS_DEFAULT = 16
TOKEN_ID_LIMIT = 2**32
"""Token ids travel as protobuf ``uint32``: without a vocab size, ids must be below this."""


def adapters_for(body: SamplingFields, deps: HttpDeps) -> dict[int, float]:
    """``{adapter id: scale}`` for the request: its ``lora`` list, else what ``model`` names.

    Raises:
        OpenAIError: 404 unknown model, 400 ambiguous name (`models.resolve_model`).
    """
    lora = body.lora_map()
    if lora is not None:
        return lora
    if body.model is None:  # vLLM: an omitted model is the served (base) model
        return {}
    return resolve_model(body.model, base_name=deps.base_name, registry=deps.registry)


class SamplingArgs(TypedDict):
    """The `generation.build_request` keywords both endpoints fill the same way."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    ignore_eos: bool
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    prompt_logprobs: bool
    prompt_logprobs_top: int
    response_format: common_pb2.ResponseFormat | None


def sampling_of(body: SamplingFields, checker: TenantChecker | InlineChecker) -> SamplingArgs:
    """The sampling keywords of `generation.build_request` both endpoints share, with
    OpenAI's / vLLM's defaults for omitted fields (``temperature`` 1, ``top_p`` 1, ``top_k`` 0
    or -1 = off, ``min_p`` 0, penalties off: presence / frequency 0, repetition 1); the
    structured-output format compiled by ``checker`` (the router's)."""
    return SamplingArgs(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=body.top_p or 1.0,
        top_k=max(0, body.top_k or 0),
        seed=body.seed,
        stop=body.stop_list(),
        ignore_eos=body.ignore_eos,
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        prompt_logprobs=body.prompt_logprobs is not None,
        prompt_logprobs_top=body.prompt_logprobs or 0,
        response_format=response_format_of(body, checker),
    )


def check_prompt_ids(ids: list[int], *, n_vocab: int | None, n_ctx: int | None, where: str = "prompt") -> None:
    """Token-id prompts are checked before routing: every id in ``[0, n_vocab)`` (the base
    vocab; without a tokenizer, protobuf's ``uint32`` range) and fewer than ``n_ctx`` of them.
    ``where``: how messages name the prompt (``prompt``, or ``prompt[i]`` in a batch).

    Raises:
        OpenAIError: 400 ``param="prompt"`` naming the first bad index and id, or the length.
    """
    upper = n_vocab if n_vocab else TOKEN_ID_LIMIT
    for i, t in enumerate(ids):
        if not 0 <= t < upper:
            raise OpenAIError(
                400,
                f"{where}[{i}]: token id {t} is out of range [0, {upper})",
                param="prompt",
                code="invalid_token_id",
            )
    check_prompt_tokens(len(ids), n_ctx=n_ctx, param="prompt", what=where)


def check_prompt_tokens(n_tokens: int, *, n_ctx: int | None, param: str, what: str | None = None) -> None:
    """A prompt of ``n_ctx`` tokens or more can never run (the worker needs one position to
    generate): 400, never a retry-later 429 from a full worker. ``what`` names the prompt in
    the message (default ``param``).

    Raises:
        OpenAIError: 400 ``context_length_exceeded`` naming ``param``.
    """
    if n_ctx is not None and n_tokens >= n_ctx:
        raise OpenAIError(
            400,
            f"'{what or param}' has {n_tokens} tokens; this model's context is {n_ctx} tokens",
            param=param,
            code="context_length_exceeded",
        )


def check_prompt_bytes(n_bytes: int, *, limit: int | None, param: str, what: str) -> None:
    """The byte rule of the gRPC path (`deps.prompt_byte_limit`), applied before any template
    or tokenizer runs.

    Raises:
        OpenAIError: 400 ``context_length_exceeded`` naming ``param`` and the limit.
    """
    if limit is not None and n_bytes > limit:
        raise OpenAIError(
            400,
            f"{what} has {n_bytes} UTF-8 bytes; at most {limit} bytes can fit this model's context "
            "(refused before tokenizing)",
            param=param,
            code="context_length_exceeded",
        )


def text_bytes(text: str, limit: int | None) -> int:
    """UTF-8 length of ``text``, skipping the encode when its length in characters already
    passes ``limit`` (a character is at least one byte)."""
    if limit is not None and len(text) > limit:
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def flatten_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose ``content`` is a list of parts becomes one string of its text parts;
    a missing ``content`` becomes ``""``.

    Raises:
        OpenAIError: 400 for a non-text part (images, audio: a text model cannot take them).
    """
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


def tokenizer_of(deps: HttpDeps) -> Any:
    """The base tokenizer (workers of one base model share its vocabulary).

    Raises:
        OpenAIError: 400 when the base model has none.
    """
    if deps.tokenizer is None:
        raise OpenAIError(400, "this model has no tokenizer (the GGUF holds no vocabulary)", code="no_tokenizer")
    return deps.tokenizer


def chat_template_of(deps: HttpDeps) -> ChatTemplate:
    """The model's chat template.

    Raises:
        OpenAIError: 400 when the model has no chat template or no tokenizer.
    """
    if deps.chat_template is None or deps.tokenizer is None:
        raise OpenAIError(
            400,
            "this model has no chat template (no tokenizer.chat_template in the GGUF and "
            "no built-in one for its architecture); start with --chat-template FILE",
            param="messages",
        )
    return deps.chat_template


def chat_prompt_ids(
    body: ChatCompletionRequest,
    template: ChatTemplate,
    tokenizer: Any,
    *,
    max_prompt_bytes: int | None = None,
    n_ctx: int | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The chat prompt's token ids: messages (assistant ``tool_calls`` arguments as objects,
    `tools.template_message`) and ``tools`` (None: not passed) rendered with ``template``, then
    tokenized.

    Sizes first: the messages' content (all text parts, UTF-8 bytes) must fit
    ``max_prompt_bytes`` before the template runs; the template renders under its time and
    output bounds (`ChatTemplate.render`, output at most ``max_prompt_bytes`` characters); the
    rendered text must fit ``max_prompt_bytes`` bytes before it is tokenized; the token count
    must stay under ``n_ctx``.

    Raises:
        OpenAIError: 400 when a message part is not text, the conversation is too long, or the
            template refuses it (its ``raise_exception``), fails, recurses too deep or passes its
            time or output bound.
    """
    messages = [template_message(flatten_message(m.model_dump(exclude_none=True))) for m in body.messages]
    request_messages = messages
    if not template_renders_tools(template):  # told in the hermes format, as plain turns
        messages = hermes_messages(messages, tools, template)
        tools = None
    total = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            total += text_bytes(content, max_prompt_bytes)
    check_prompt_bytes(total, limit=max_prompt_bytes, param="messages", what="the conversation's content")
    try:
        prompt = template.render(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            tools=tools,
            max_chars=max_prompt_bytes if max_prompt_bytes is not None else RENDER_MAX_CHARS,
        )
    except ChatTemplateError as exc:
        message = str(exc)
        why = role_diagnosis(request_messages) if exc.code == "chat_template_refused" else ""
        raise OpenAIError(400, f"{message} ({why})" if why else message, param="messages", code=exc.code) from None
    check_prompt_bytes(
        text_bytes(prompt, max_prompt_bytes), limit=max_prompt_bytes, param="messages", what="the rendered chat prompt"
    )
    ids: list[int] = tokenizer.encode(prompt, add_special=body.add_special_tokens, parse_special=True)
    check_prompt_tokens(len(ids), n_ctx=n_ctx, param="messages")
    return ids


@dataclass(frozen=True)
class ChatCall:
    """A chat request made ready for the router (`prepare_chat`).

    Attributes:
        request: the GenerateRequest (the rendered prompt's token ids, adapters, sampling).
        tools: the tools the model was told about (None: none; the answer is then not parsed
            for calls).
        forced: the forced call of ``tool_choice`` (its schema is the request's format).
    """

    request: common_pb2.GenerateRequest
    tools: list[dict[str, Any]] | None
    forced: ForcedCall | None


def prepare_chat(
    deps: HttpDeps, body: ChatCompletionRequest, principal: str | None, *, request_id: str, logprobs: int
) -> ChatCall:
    """A checked chat request's way to the router, in this order: the template, the tools
    (`check_tools`), sampling and structured output (compiled by ``principal``'s grammar
    checker), the forced call, the adapters (``model`` / ``lora``), the prompt
    (`chat_prompt_ids`, sized first); ``logprobs``: top-N per generated token. Shared by
    ``/v1/chat/completions`` and ``/v1/responses``.

    Raises:
        OpenAIError: 400 / 404 naming the field at fault (each step's own errors).
    """
    template = chat_template_of(deps)
    grammar = deps.router.grammar.for_tenant(principal)
    tools = check_tools(body.tools, body.tool_choice, max_tools=grammar.limits.max_tools)
    sampling = sampling_of(body, grammar)
    forced = forced_call_of(
        body.tools, body.tool_choice, grammar, response_format=sampling["response_format"] is not None
    )
    if forced is not None:
        sampling["response_format"] = forced.response_format()
    adapters = adapters_for(body, deps)
    ids = chat_prompt_ids(
        body,
        template,
        deps.tokenizer,
        max_prompt_bytes=deps.prompt_max_bytes(),
        n_ctx=deps.prompt_n_ctx(),
        tools=tools,
    )
    request = build_request(
        request_id=request_id,
        text=None,
        tokens=ids,
        adapters=adapters,
        max_tokens=body.max_completion_tokens or body.max_tokens or CHAT_MAX_TOKENS_DEFAULT,
        logprobs=logprobs,
        **sampling,
    )
    return ChatCall(request, tools, forced)


def respond(
    deps: HttpDeps,
    request: common_pb2.GenerateRequest | list[common_pb2.GenerateRequest],
    body: SamplingFields,
    *,
    chat: bool,
    logprobs: int | None,
    tool_calls: bool = False,
    forced: ForcedCall | None = None,
    principal: str | None = None,
    echo: list[str] | None = None,
    generate_nothing: bool = False,
    response_id: str | None = None,
) -> Response:
    """Run ``request`` through the router and answer: the full JSON body, or (``stream``) a
    server-sent-event stream. ``logprobs``, ``tool_calls``, ``forced``, ``echo`` (one text per
    request) and ``generate_nothing`` as `CompletionStream`'s; ``principal``: the tenant the
    request's API key names (`HttpDeps.principal`). A list of requests (a completions batch)
    answers as one response, choice ``i`` from request ``i`` (`CompletionBatch`), under
    ``response_id`` (default: the first request's id).

    Raises:
        OpenAIError: the router failed (before the first token, when streaming).
    """
    requests = request if isinstance(request, list) else [request]
    created = now_s()
    streams = []
    for i, req in enumerate(requests):
        call = HttpCallContext()
        streams.append(
            CompletionStream(
                deps.router.generate(req, call, principal=principal),
                cancel=call.cancel,
                request_id=response_id or requests[0].request_id,
                created=created,
                model=body.model or deps.base_name,
                chat=chat,
                logprobs=logprobs,
                token_text=token_text_of(deps.tokenizer),
                tool_calls=tool_calls,
                forced=forced,
                echo=echo[i] if echo is not None else None,
                generate_nothing=generate_nothing,
            )
        )
    stream: CompletionStream | CompletionBatch = CompletionBatch(streams) if isinstance(request, list) else streams[0]
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    if include_usage and body.stream_options is not None and body.stream_options.continuous_usage_stats:
        for s in streams:
            s.continuous_usage = True
    return RelayResponse(
        stream,
        sse=bool(body.stream),
        include_usage=bool(include_usage),
        return_token_ids=body.return_token_ids,
        write_timeout_s=deps.write_timeout_s,
    )


def completions_router(deps: HttpDeps) -> APIRouter:
    """The two generation routes over ``deps.router``."""
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        raw = await request.body()  # at most --http-max-body-bytes (app.BodySizeLimit)
        return await run_in_threadpool(run_completion, raw, request.headers.get("authorization"))

    def completion_prompt(
        prompt: str | list[int], add_special_tokens: bool, where: str = "prompt"
    ) -> tuple[str | None, list[int] | None]:
        """``(text, token ids)`` of one prompt, sized and checked before it costs anything: text
        for the worker to tokenize (counted here with the base tokenizer, BOS as the model says,
        which is what the worker computes: `tokenize`), or token ids taken verbatim; tokenized
        here when ``add_special_tokens`` is false. ``where`` names the prompt in messages
        (``prompt[i]`` in a batch).

        Raises:
            OpenAIError: 400 naming ``prompt``: over the byte or context bound, an id out of
                range, empty once tokenized.
        """
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, [int(t) for t in prompt])
        limit = deps.prompt_max_bytes()
        if text is not None:
            check_prompt_bytes(text_bytes(text, limit), limit=limit, param="prompt", what=f"'{where}'")
        if ids is None and not add_special_tokens:
            ids = tokenizer_of(deps).encode(text or "", add_special=False, parse_special=True)
            if not ids:
                raise OpenAIError(400, f"'{where}' is empty once tokenized", param="prompt")
        if ids is not None:
            check_prompt_ids(
                ids, n_vocab=getattr(deps.tokenizer, "n_vocab", None), n_ctx=deps.prompt_n_ctx(), where=where
            )
        elif deps.tokenizer is not None:  # the worker tokenizes; a prompt that cannot fit is a 400 here already
            n = len(deps.tokenizer.encode(text or "", add_special=True, parse_special=True))
            check_prompt_tokens(n, n_ctx=deps.prompt_n_ctx(), param="prompt", what=where)
        return text, ids

    def run_completion(raw: bytes, authorization: str | None = None) -> Response:
        body = parse_body(raw, CompletionRequest)
        body.check()
        listed = isinstance(body.prompt, list) and bool(body.prompt) and type(body.prompt[0]) in (str, list)
        prompts = [
            completion_prompt(p, body.add_special_tokens, f"prompt[{i}]" if listed else "prompt")
            for i, p in enumerate(body.prompts())
        ]
        adapters = adapters_for(body, deps)
        sampling = sampling_of(body, deps.router.grammar.for_tenant(deps.principal(authorization)))
        echo_logprobs = body.echo and body.logprobs is not None
        if echo_logprobs:  # the prompt tokens' log-probs (and alternatives) lead the choice's
            sampling["prompt_logprobs"], sampling["prompt_logprobs_top"] = True, body.logprobs or 0
        rid = new_request_id("cmpl")
        requests = [
            build_request(
                request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                text=text,
                tokens=ids,
                adapters=adapters,
                # max_tokens 0 (echo only): one token computes the prompt, and is dropped
                max_tokens=max(1, COMPLETION_MAX_TOKENS_DEFAULT if body.max_tokens is None else body.max_tokens),
                logprobs=body.logprobs or 0,
                **sampling,
            )
            for i, (text, ids) in enumerate(prompts)
        ]
        echo = None
        if body.echo:
            tok = deps.tokenizer
            echo = [
                text if text is not None else (tok.decode(ids or [], skip_special=False) if tok else "")
                for text, ids in prompts
            ]
        return respond(
            deps,
            requests if len(requests) > 1 else requests[0],
            body,
            response_id=rid,
            chat=False,
            logprobs=body.logprobs,
            principal=deps.principal(authorization),
            echo=echo,
            generate_nothing=body.max_tokens == 0,
        )

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        raw = await request.body()
        return await run_in_threadpool(run_chat, raw, request.headers.get("authorization"))

    def run_chat(raw: bytes, authorization: str | None = None) -> Response:
        body = parse_body(raw, ChatCompletionRequest)
        body.check()
        principal = deps.principal(authorization)
        n_top = body.top_logprobs or 0
        chat = prepare_chat(deps, body, principal, request_id=new_request_id("chatcmpl"), logprobs=n_top)
        return respond(
            deps,
            chat.request,
            body,
            chat=True,
            logprobs=n_top if body.logprobs else None,
            tool_calls=chat.tools is not None,
            forced=chat.forced,
            principal=principal,
        )

    return router
