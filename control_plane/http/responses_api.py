"""``POST /v1/responses``: OpenAI's Responses API over the chat completions pipeline.

(`responses` holds the bodies of the completions endpoints; this module is the Responses API.)

A request is translated into a `schemas.ChatCompletionRequest` (`chat_request_of`: ``input`` and
``instructions`` → ``messages``, function ``tools`` → chat tools, ``text.format`` →
``response_format``, ``max_output_tokens`` → ``max_completion_tokens``) and then runs exactly as
``/v1/chat/completions`` does (`run_responses`): the same chat template, input limits
(`completions.chat_prompt_ids`), tool checks and forced calls (`tools`), structured output
compiled by the tenant's grammar checker (`structured.response_format_of`), adapters by
``model`` (`completions.adapters_for`), the router and the API key. Only the answer differs: a
``response`` object or its server-sent events (`response_events.ResponseEvents`).

Nothing is stored (as vLLM without ``VLLM_ENABLE_RESPONSES_API_STORE``): ``store`` is accepted
and answered ``false``; ``previous_response_id``, ``conversation`` and ``item_reference`` items
are refused (400 naming them: send the whole conversation in ``input``).

Parameters, translation and events: docs/http-api.md, "Responses API".
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError
from starlette.concurrency import run_in_threadpool

from control_plane.http.completions import prepare_chat
from control_plane.http.deps import HttpDeps
from control_plane.http.errors import OpenAIError, unsupported
from control_plane.http.generation import HttpCallContext, now_s
from control_plane.http.response_events import ResponseEvents
from control_plane.http.responses import token_text_of
from control_plane.http.schemas import (
    UNSUPPORTED,
    ChatCompletionRequest,
    HttpBody,
    is_default,
    parse_body,
)
from control_plane.http.streaming import RelayResponse

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
"""Roles an ``input`` message may have; ``developer`` is rendered as ``system`` (OpenAI: the
developer's instructions take the system role's place)."""

TEXT_PARTS = ("input_text", "output_text")
"""Content parts an ``input`` message may hold (``output_text``: an assistant message sent back)."""

PASSED_TO_CHAT = (
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "lora",
)
"""Extension keys (vLLM's sampling fields and loraplane's ``lora``) a Responses request may carry;
they reach the chat request as they are, as do the keys chat refuses (`schemas.UNSUPPORTED`).
Any other key unknown to the Responses API is ignored, as on the chat endpoint."""

FUNCTION_KEYS = ("name", "description", "parameters", "strict")
"""The keys of a Responses function tool that a chat tool's ``function`` has."""

RESPONSES_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((False,), "background responses need stored responses, and none are stored"),
    "conversation": ((), "conversations are not stored; send the whole conversation in 'input'"),
    "prompt": ((), "stored prompt templates are not available; send the text in 'input' and 'instructions'"),
    "truncation": (("disabled",), "prompts are never truncated (a prompt too long is a 400)"),
    "top_logprobs": ((0,), "log-probs are not implemented on /v1/responses (use /v1/chat/completions)"),
}
"""Responses parameters refused when set to anything but their default (the `schemas.UNSUPPORTED`
rule): ``name → (default values, why)``."""

_CHAT_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.type": "text.format.type",
    "response_format.json_schema": "text.format",
    "response_format.json_schema.schema": "text.format.schema",
}
"""Chat parameter names → the Responses parameter they came from (`responses_params`)."""


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param)


class ResponsesRequest(HttpBody):
    """``POST /v1/responses`` (OpenAI's ``ResponseCreateParams``; the fields used, the rest
    checked by `check` or ignored)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, lt=2**32)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None

    @field_validator("input", mode="plain", json_schema_input_type=str | list[dict[str, Any]])
    @classmethod
    def _input_shape(cls, value: Any) -> str | list[Any]:
        """A string, or a list of items (their count plus their messages' content parts was
        bounded by `schemas.check_sizes` before any item is validated, as chat's ``messages``)."""
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise PydanticCustomError("input_type", "'input' must be a string or a list of input items")
        return value

    def check(self) -> None:
        """Refuse what this server cannot do (400 naming the parameter): a
        ``previous_response_id`` (nothing is stored), `RESPONSES_UNSUPPORTED` values, a
        ``reasoning`` effort or summary, ``include`` of output log-probs."""
        if self.previous_response_id:
            raise unsupported(
                "previous_response_id",
                "this server does not store responses; send the whole conversation in 'input' "
                "(earlier output items included: messages, and function_call items before their "
                "function_call_output)",
            )
        extra = self.model_extra or {}
        for name, (defaults, why) in RESPONSES_UNSUPPORTED.items():
            value = extra.get(name)
            if not is_default(value, defaults):
                raise unsupported(name, f"{why} (got {json.dumps(value)[:100]})")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise unsupported("reasoning", f"reasoning is not implemented (got {json.dumps(self.reasoning)[:100]})")
        if self.include and "message.output_text.logprobs" in self.include:
            raise unsupported("include", "log-probs are not implemented on /v1/responses (use /v1/chat/completions)")


def _content_text(content: Any, where: str) -> str:
    """A message's ``content`` (a string, or a list of ``input_text`` / ``output_text`` parts)
    as one string, parts joined as chat joins text parts.

    Raises:
        OpenAIError: 400 naming ``<where>.content`` (neither) or the part (not text: images,
            files and audio cannot go to a text model).
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content", f"'{where}.content' must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _bad(
                f"{where}.content[{j}]",
                f"'{where}.content[{j}]' of type {kind!r} is not supported: text only "
                f"({', '.join(TEXT_PARTS)} with a string 'text')",
            )
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str, *, empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and not empty):
        raise _bad(f"{where}.{key}", f"'{where}.{key}' must be a {'' if empty else 'non-empty '}string")
    return value


def chat_messages(input: str | list[Any], instructions: str | None) -> list[dict[str, Any]]:
    """Chat messages of a Responses ``input`` and ``instructions``.

    ``instructions`` → a first ``system`` message; a string ``input`` → one ``user`` message;
    list items in order:

    * a message (``type`` ``"message"`` or absent): ``role`` user / system / developer
      (→ ``system``) / assistant, ``content`` text or text parts (`_content_text`);
    * ``function_call`` (``call_id``, ``name``, ``arguments``) → a ``tool_calls`` entry of the
      assistant message right before it, or of a new assistant message;
    * ``function_call_output`` (``call_id``, ``output``) → a ``tool`` message; its ``call_id``
      must belong to a ``function_call`` earlier in ``input`` (nothing is stored to find it in).

    The leading ``system`` messages (``instructions`` included) are joined into one, with a blank
    line between (chat templates read a single first system message).

    Raises:
        OpenAIError: 400 naming ``input`` (an empty list) or the item and field at fault
            (``input[3].role``, ...), an ``item_reference`` (nothing stored) or an item type other than the three above.
    """
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(input, str):
        return [*messages, {"role": "user", "content": input}]
    if not input:
        raise _bad("input", "'input' is empty: give a string or at least one input item")
    calls: set[str] = set()
    for i, item in enumerate(input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(where, f"'{where}' must be an object (a message or a function call item)")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise _bad(f"{where}.role", f"'{where}.role' must be one of {', '.join(MESSAGE_ROLES)} (got {role!r})")
            text = _content_text(item.get("content"), where)
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call_id = _string(item, "call_id", where)
            call = {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where, empty=True),
                },
            }
            calls.add(call_id)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            if call_id not in calls:
                raise _bad(
                    f"{where}.call_id",
                    f"'{where}.call_id' {call_id!r} answers no function_call earlier in 'input'; this server "
                    "stores no responses, so send the function_call item too",
                )
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "item_reference":
            raise unsupported(f"{where}.type", "item references need stored items, and none are stored; send the item")
        else:
            raise unsupported(
                f"{where}.type",
                f"input items of type {kind!r} are not supported (message, function_call, function_call_output)",
            )
    return _join_leading_system(messages)


def _join_leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    if n < 2:
        return messages
    joined = "\n\n".join(m["content"] for m in messages[:n] if m["content"])
    return [{"role": "system", "content": joined}, *messages[n:]]


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (``{"type": "function", "name", "description", "parameters",
    "strict"}``) as chat tools (``{"type": "function", "function": {...}}``, the `FUNCTION_KEYS`
    in the tool's order). ``strict`` absent or null is true, OpenAI's default for Responses
    function tools (objects closed, `tools.tool_parameters`).

    Raises:
        OpenAIError: 400 naming ``tools[i]`` or its field: not an object, a tool type other
            than ``function`` (hosted tools: web search, file search, MCP, ...), no name,
            ``parameters`` not an object.
    """
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(where, f"'{where}' must be a function tool object")
        if tool.get("type") != "function":
            raise unsupported(
                f"{where}.type",
                f"only function tools are available (got {tool.get('type')!r}; hosted tools are not)",
            )
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"{where}.parameters", f"'{where}.parameters' must be a JSON Schema object")
        _string(tool, "name", where)
        # the tool's own key order: templates print the function with ``tojson``
        fn = {k: v for k, v in tool.items() if k in FUNCTION_KEYS}
        fn["strict"] = tool.get("strict") is not False
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """A Responses ``tool_choice`` in chat's form: ``"none"`` / ``"auto"`` / ``"required"`` as
    they are; ``{"type": "function", "name"}`` → ``{"type": "function", "function": {"name"}}``.

    Raises:
        OpenAIError: 400 naming ``tool_choice``: another object (allowed tools, hosted tools).
    """
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise unsupported(
        "tool_choice",
        "'tool_choice' takes 'none', 'auto', 'required' or {'type': 'function', 'name': ...} "
        f"(got {json.dumps(choice)[:100]})",
    )


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``: ``text`` (or none) → None, ``json_object``
    as it is, ``json_schema`` (``name``, ``schema``, ``strict``, flat) → ``{"type":
    "json_schema", "json_schema": {...}}``.

    Raises:
        OpenAIError: 400 naming ``text.format`` (not an object, no ``schema``) or
            ``text.format.type`` (another type).
    """
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format", "'text.format' must be an object with a 'type'")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if "schema" not in fmt:
            raise _bad("text.format.schema", "'text.format' of type 'json_schema' needs a 'schema'")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise _bad("text.format.type", f"'text.format.type' {kind!r} is not supported (text, json_object, json_schema)")


def chat_request_of(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request runs as (module docstring): messages, tools, the
    format and the sampling fields, plus the `PASSED_TO_CHAT` extensions and any key chat
    refuses (`schemas.UNSUPPORTED`), so that chat's checks apply; checked (`check`).

    Raises:
        OpenAIError: 400 naming the Responses parameter at fault.
        RequestValidationError: an extension key chat's model refuses (400 naming it).
    """
    extra = body.model_extra or {}
    passed = {k: v for k, v in extra.items() if k in PASSED_TO_CHAT or k in UNSUPPORTED}
    data = {
        **passed,
        "model": body.model,
        "messages": chat_messages(body.input, body.instructions),
        "stream": body.stream,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "response_format": chat_response_format(body.text),
        "user": body.user,
    }
    try:
        chat = ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    with responses_params():
        chat.check()
    return chat


@contextmanager
def responses_params() -> Iterator[None]:
    """Errors of the chat pipeline named in Responses terms: an `OpenAIError` whose ``param`` is
    a chat parameter with a Responses counterpart (`_CHAT_PARAMS`: ``messages`` → ``input``, ...)
    is re-raised with that name, in ``param`` and in the message."""
    try:
        yield
    except OpenAIError as exc:
        name = _CHAT_PARAMS.get(exc.param or "")
        if name is not None:
            exc.message = exc.message.replace(f"'{exc.param}'", f"'{name}'")
            exc.args = (exc.message,)
            exc.param = name
        raise


def response_head(body: ResponsesRequest, response_id: str, created: int, model: str) -> dict[str, Any]:
    """The request-derived fields of the ``response`` object (OpenAI's ``Response``), in its
    order: everything but ``status``, ``output``, ``usage`` and the outcome's details."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "model": model,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": {"type": "text"}, **(body.text or {})},
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": body.tools or [],
        "top_p": body.top_p or 1.0,
        "truncation": "disabled",
        "user": body.user,
    }


def new_response_id() -> str:
    """A fresh response id: ``resp_`` and 32 hex digits (OpenAI's prefix)."""
    return f"resp_{uuid.uuid4().hex}"


def run_responses(deps: HttpDeps, raw: bytes, authorization: str | None = None) -> Response:
    """One ``POST /v1/responses`` on a worker thread: parse and check the body, translate it
    (`chat_request_of`), then the chat route's steps in the chat route's order (template,
    tools, sampling and format, forced call, adapters, prompt), and answer with
    `ResponseEvents` (JSON, or server-sent events with ``stream``).

    Raises:
        OpenAIError: 400 / 404 / 429 / 503 as the chat route (module docstring), named in
            Responses terms (`responses_params`).
    """
    body = parse_body(raw, ResponsesRequest)
    body.check()
    chat = chat_request_of(body)
    principal = deps.principal(authorization)
    response_id = new_response_id()
    with responses_params():
        prepared = prepare_chat(deps, chat, principal, request_id=response_id, logprobs=0)
    call = HttpCallContext()
    events = ResponseEvents(
        deps.router.generate(prepared.request, call, principal=principal),
        cancel=call.cancel,
        head=response_head(body, response_id, now_s(), body.model or deps.base_name),
        token_text=token_text_of(deps.tokenizer),
        tool_calls=prepared.tools is not None,
        forced=prepared.forced,
    )
    return RelayResponse(events, sse=body.stream, write_timeout_s=deps.write_timeout_s)


def responses_router(deps: HttpDeps) -> APIRouter:
    """The ``POST /v1/responses`` route over ``deps.router``."""
    router = APIRouter()

    @router.post("/v1/responses")
    async def responses(request: Request) -> Response:
        raw = await request.body()  # at most --http-max-body-bytes (app.BodySizeLimit)
        return await run_in_threadpool(run_responses, deps, raw, request.headers.get("authorization"))

    return router
