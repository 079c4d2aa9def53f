"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions`` (pydantic).

`parse_body` parses a raw body (after `check_sizes` bounds its lists and JSON values) into a
model; `HttpBody` refuses lone surrogates anywhere (400 ``invalid_unicode``, `lone_surrogate`);
`SamplingFields.check` applies the parameter rule (a known parameter that loraplane does not
implement is a 400 when set, `UNSUPPORTED`; unknown keys are ignored); `LoraEntry` is one entry
of the ``lora`` list. Omitted parameters take OpenAI's defaults, as vLLM does.

Every parameter, its default and the refused ones: docs/http-api.md, "Request parameters"
(the parameter rule) and "Input limits".
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from control_plane.http.errors import INVALID_UNICODE, OpenAIError, unsupported

MAX_STOP_STRINGS = 16
# "until the context is full": the worker stops at its slot context (finish_reason "length")
CHAT_MAX_TOKENS_DEFAULT = 2**31 - 1


_SURROGATE = re.compile("[\ud800-\udfff]")
# a JSON escape that decodes to a surrogate code point: the only way one gets into a body
# decoded as strict UTF-8 (a false hit, such as an escaped backslash before "ud800", only
# costs the walk)
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")

MAX_PROMPT_ITEMS = 1 << 20
"""Most items a completions ``prompt`` list may hold (token ids: no context is longer), and most
token ids a list of token-id lists may hold in all."""
MAX_PROMPTS = 128
"""Most prompts one completions request may batch (``prompt`` as a list of strings or of
token-id lists): each runs as a request of its own on the workers, so the bound keeps one HTTP
request from taking a worker's whole queue."""
MAX_CHAT_ITEMS = 1 << 16
"""Most messages plus content parts a chat request may hold."""
MAX_LORA_ENTRIES = 4096
"""Most entries of the ``lora`` extension."""


def _surrogate_in(text: str) -> int:
    """Index of the first lone surrogate in ``text``, or -1 (ASCII text: one C call)."""
    if text.isascii():
        return -1
    m = _SURROGATE.search(text)
    return -1 if m is None else m.start()


def lone_surrogate(data: Any) -> tuple[str, int, int] | None:
    """The first string in parsed JSON ``data`` (keys included) holding a lone UTF-16 surrogate:
    ``(dotted field path, character index, code point)``; None when every string is valid
    Unicode. JSON may spell one (``"\\ud800"``) and Python's decoder keeps it, but it has no
    UTF-8 form: protobuf, the tokenizer and the response encoder would all fail on it later.

    Walks with an explicit stack (no recursion limit); a scalar item costs one type check and
    paths are only spelled out for the hit, so a million-item list takes tens of milliseconds.
    """
    stack: list[tuple[tuple[Any, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        kind = type(value)
        if kind is str:
            if (i := _surrogate_in(value)) >= 0:
                return _spell(path), i, ord(value[i])
            continue
        if kind is dict:
            items: Any = value.items()
        elif kind is list:
            items = enumerate(value)
        else:
            continue
        nested = []
        for key, item in items:
            if type(key) is str and (i := _surrogate_in(key)) >= 0:
                return _spell(path), i, ord(key[i])
            t = type(item)
            if t is str:
                if (i := _surrogate_in(item)) >= 0:
                    return _spell((*path, key)), i, ord(item[i])
            elif t is dict or t is list:
                nested.append(((*path, key), item))
        stack.extend(reversed(nested))
    return None


def _spell(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path) or "body"


def _too_many(what: str, n: int, limit: int, param: str) -> OpenAIError:
    return OpenAIError(400, f"{what} has {n} items; at most {limit} are accepted", param=param, code="too_many_items")


def check_sizes(data: dict[str, Any]) -> None:
    """Bound the lists of a completions / chat body before pydantic validates them item by item
    (a 16 MiB body of one-character items would otherwise cost seconds per field):
    ``prompt`` ≤ `MAX_PROMPT_ITEMS`, messages (or a Responses ``input``'s items) plus content parts
    ≤ `MAX_CHAT_ITEMS`, ``stop``
    ≤ `MAX_STOP_STRINGS`, ``lora`` ≤ `MAX_LORA_ENTRIES`; a non-empty ``logit_bias`` is refused
    here already (unsupported).

    Raises:
        OpenAIError: 400 naming the field.
    """
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) > MAX_PROMPT_ITEMS:
        raise _too_many("'prompt'", len(prompt), MAX_PROMPT_ITEMS, "prompt")
    if isinstance(prompt, list) and prompt and type(prompt[0]) in (str, list):
        if len(prompt) > MAX_PROMPTS:
            raise _too_many("'prompt' (a batch of prompts)", len(prompt), MAX_PROMPTS, "prompt")
        n_ids = sum(len(x) for x in prompt if isinstance(x, list))
        if n_ids > MAX_PROMPT_ITEMS:
            raise _too_many("'prompt' (token ids of all its prompts)", n_ids, MAX_PROMPT_ITEMS, "prompt")
    for key, what in (("messages", "messages and content parts"), ("input", "items and content parts")):
        items = data.get(key)
        if not isinstance(items, list):
            continue
        n = len(items)
        for m in items:
            if n > MAX_CHAT_ITEMS:
                break
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                n += len(content)
        if n > MAX_CHAT_ITEMS:
            raise _too_many(f"'{key}' ({what})", n, MAX_CHAT_ITEMS, key)
    stop = data.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise OpenAIError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings (got {len(stop)})", param="stop")
    lora = data.get("lora")
    if isinstance(lora, list) and len(lora) > MAX_LORA_ENTRIES:
        raise _too_many("'lora'", len(lora), MAX_LORA_ENTRIES, "lora")
    if data.get("logit_bias"):
        raise unsupported("logit_bias", "logit biases are not implemented")


B = TypeVar("B", bound=BaseModel)


MAX_JSON_VALUES = 2 * 1024 * 1024
"""The most ``,`` ``[`` ``{`` bytes a body may hold (an upper bound on its JSON values, string
contents included). Decoding holds the interpreter lock and builds one Python object per value
(16 MiB of ``[],`` is 5.6 M lists: 400 MB and seconds of stalled responses); no request needs
this many: a ``prompt`` is at most 1 048 576 token ids, a chat 65 536 messages and parts."""


def parse_body(raw: bytes, model: type[B]) -> B:
    """A request body → ``model``, for routes that parse on a worker thread (never the event
    loop): strict UTF-8 (RFC 8259), JSON, an object, `check_sizes`, valid Unicode
    (`lone_surrogate`, walked only when the text holds a surrogate escape), then pydantic.

    Raises:
        OpenAIError: 400 ``invalid_json`` (not UTF-8, not JSON, too deep, an integer of more
            than 4300 digits, empty, not an object), ``too_many_items`` (more than
            `MAX_JSON_VALUES` values, counted on the bytes before parsing), ``invalid_unicode``
            or a size rule, naming the field where there is one.
        RequestValidationError: pydantic refused a field (`errors.validation_error` answers
            it: 400 naming the field).
    """
    if not raw.strip():
        raise OpenAIError(400, "request body is empty: expected a JSON object", code="invalid_json")
    values = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    if values > MAX_JSON_VALUES:
        raise OpenAIError(
            400,
            f"request body holds about {values} JSON values (',' '[' '{{' counted), more than any request "
            f"can use ({MAX_JSON_VALUES}); refused before parsing",
            code="too_many_items",
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OpenAIError(
            400, f"request body is not valid UTF-8 (byte {exc.start}: {exc.reason})", code="invalid_json"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        raise OpenAIError(400, f"request body is not valid JSON: {exc.msg} ({where})", code="invalid_json") from None
    except RecursionError:
        raise OpenAIError(400, "request body is not valid JSON: nested too deeply", code="invalid_json") from None
    except ValueError as exc:  # an integer literal past Python's int-str digit limit (4300 digits)
        raise OpenAIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "request body must be a JSON object", code="invalid_json")
    check_sizes(data)
    walk = _ESCAPED_SURROGATE.search(text) is not None
    try:
        return model.model_validate(data, context={SKIP_UNICODE_WALK: not walk})
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


SKIP_UNICODE_WALK = "skip_unicode_walk"
"""Validation-context key: the raw text held no surrogate escape, so `HttpBody` need not walk."""


class HttpBody(BaseModel):
    """Base of every request body: strings must be valid Unicode (`lone_surrogate`), else a
    400 ``invalid_unicode`` naming the field (`errors.validation_error`)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(info.context, dict) and info.context.get(SKIP_UNICODE_WALK):
            return data
        found = lone_surrogate(data)
        if found is not None:
            field, index, code_point = found
            raise PydanticCustomError(
                INVALID_UNICODE,
                "invalid unicode in '{field}': lone UTF-16 surrogate U+{code_point} at character {index} "
                "(strings must be valid UTF-8 text)",
                {"field": field, "index": index, "code_point": f"{code_point:04X}"},
            )
        return data


class LoraEntry(BaseModel):
    """One adapter of the ``lora`` extension: registered id and scale."""

    id: int = Field(ge=0, lt=2**32)
    scale: float = 1.0


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a usage chunk before ``[DONE]``;
    ``continuous_usage_stats`` (vLLM's, with ``include_usage``) puts the usage so far on every
    chunk too."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False


UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    # vLLM extensions
    "use_beam_search": ((False,), "beam search is not implemented"),
    "length_penalty": ((1.0,), "length_penalty applies to beam search, which is not implemented"),
    "min_tokens": ((0,), "a minimum output length is not implemented"),
    "stop_token_ids": ((), "stop token ids are not implemented (use 'stop' strings)"),
    "include_stop_str_in_output": ((False,), "the stop string is always cut from the output"),
    "skip_special_tokens": ((True,), "special tokens are always left out of the output text"),
    "spaces_between_special_tokens": ((True,), "special tokens are always left out of the output text"),
    "truncate_prompt_tokens": ((), "prompts are never truncated (a prompt too long is a 400)"),
    "allowed_token_ids": ((), "allowed token ids are not implemented"),
    "bad_words": ((), "bad words are not implemented"),
    "logits_processors": ((), "custom logits processors are not implemented"),
    "prompt_embeds": ((), "prompt embeddings are not accepted"),
    "return_tokens_as_token_ids": ((False,), "log-prob tokens are always text"),
    "continue_final_message": ((False,), "continuing the final message is not implemented"),
    "chat_template": ((), "the chat template is the server's (--chat-template)"),
    "chat_template_kwargs": ((), "chat template arguments are not implemented"),
    "documents": ((), "documents for the chat template are not implemented"),
    "priority": ((0,), "request priorities are not implemented"),
    "guided_whitespace_pattern": ((), "JSON is always generated compact (no whitespace between tokens)"),
    # OpenAI's legacy function calling (before tools)
    "functions": ((), "legacy function calling is not implemented; use 'tools'"),
    "function_call": (("none", "auto"), "legacy function calling is not implemented; use 'tool_choice'"),
    # OpenAI chat parameters for features a text model server does not have
    "modalities": ((["text"],), "only text output"),
    "audio": ((), "audio output is not implemented"),
    "prediction": ((), "predicted outputs are not implemented"),
    "reasoning_effort": ((), "reasoning effort is not implemented"),
    "web_search_options": ((), "web search is not implemented"),
    # llama-server samplers
    "typical_p": ((1.0,), "locally typical sampling is not implemented"),
    "tfs_z": ((1.0,), "tail-free sampling is not implemented"),
    "mirostat": ((0,), "mirostat sampling is not implemented"),
    "dynatemp_range": ((0.0,), "dynamic temperature is not implemented"),
    "xtc_probability": ((0.0,), "XTC sampling is not implemented"),
    "dry_multiplier": ((0.0,), "DRY sampling is not implemented"),
    "repeat_penalty": ((1.0,), "llama-server's windowed penalty is not implemented; use 'repetition_penalty'"),
    "n_probs": ((0,), "llama-server's n_probs is not read here; use 'logprobs' (completions) or 'top_logprobs' (chat)"),
}
"""Known parameters loraplane does not implement: ``name → (default values, why)``. A value
that is None, empty or one of the defaults is ignored; anything else is a 400 naming it
(``code: "unsupported_parameter"``). ``n``, ``best_of``, ``logit_bias``, ``echo`` and
``suffix`` are checked with their fields. Structured output and tool keys are not listed here."""


def is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
    """Whether ``value`` is a parameter's default: None, an empty list / dict / string, or equal
    to one of ``defaults`` (``True`` is not ``1`` here: a bool must match a bool)."""
    if value is None or (isinstance(value, list | dict | str) and not value):
        return True
    return any(
        (type(value) is type(d) and value == d) or (type(d) is float and type(value) is int and value == d)
        for d in defaults
    )


class SamplingFields(HttpBody):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, lt=2**32)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, lt=2**32)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    n: int | None = None
    best_of: int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2**31)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    lora: list[LoraEntry] | None = None
    return_token_ids: bool = False
    user: str | None = None
    # structured output (control_plane.http.structured)
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_grammar: Any = None
    guided_choice: Any = None
    structured_outputs: Any = None

    def check(self) -> None:
        """Raise a 400 `OpenAIError` naming the first unsupported parameter (`UNSUPPORTED`)."""
        if self.n not in (None, 1):
            raise unsupported("n", f"one choice per request (got n={self.n})")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", f"one candidate per request (got best_of={self.best_of})")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit biases are not implemented")
        extra = self.model_extra or {}
        for name, (defaults, why) in UNSUPPORTED.items():
            value = extra.get(name)
            if not is_default(value, defaults):
                raise unsupported(name, f"{why} (got {json.dumps(value)[:100]})")
        if self.prompt_logprobs is not None and self.stream:
            raise unsupported("prompt_logprobs", "prompt log-probs are returned in non-streaming responses only")
        stops = self.stop_list()
        if len(stops) > MAX_STOP_STRINGS:
            raise OpenAIError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings (got {len(stops)})", param="stop")
        if any(not s for s in stops):
            raise OpenAIError(400, "'stop' strings must not be empty (an empty one would stop at once)", param="stop")
        if self.lora is not None and len({e.id for e in self.lora}) != len(self.lora):
            raise OpenAIError(400, "'lora' lists an adapter id more than once", param="lora")

    def stop_list(self) -> list[str]:
        """``stop`` as a list (empty when omitted)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def lora_map(self) -> dict[int, float] | None:
        """``lora`` as ``{id: scale}``; None when omitted (``model`` decides)."""
        return None if self.lora is None else {e.id: e.scale for e in self.lora}


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, token ids, or a batch of either (a list
    of strings or of token-id lists: one choice per prompt, OpenAI's and vLLM's batch)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tokens: int | None = Field(default=None, ge=0, lt=2**32)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="plain", json_schema_input_type=str | list[str] | list[int] | list[list[int]])
    @classmethod
    def _prompt_shape(cls, value: Any) -> str | list[str] | list[int] | list[list[int]]:
        """A string, a list of strings, a list of integers (JSON ``true`` is not an id) or a list
        of integer lists, checked with one type test per item: pydantic's union would validate a
        long list once per member (16 M ids: over 20 s)."""
        if isinstance(value, str):
            return value
        if isinstance(value, list) and len(value) <= MAX_PROMPT_ITEMS:
            if all(type(x) is str for x in value):
                return value
            if all(type(x) is int for x in value):
                return value
            if all(type(x) is list and all(type(t) is int for t in x) for x in value):
                return value
        raise PydanticCustomError(
            "prompt_type",
            "'prompt' must be a string, a list of token ids (integers), or a batch: a list of strings "
            "or a list of token-id lists",
        )

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts in order: one for a string or a token-id list, one per item of a
        batch."""
        p = self.prompt
        if isinstance(p, str) or (p and type(p[0]) is int):
            return [p]
        return list(p)  # type: ignore[arg-type]

    def check(self) -> None:
        """`SamplingFields.check`, plus ``suffix``, empty prompts, and ``max_tokens: 0``, which
        only ``echo`` takes (the prompt's log-probs with nothing generated, vLLM's rule).

        Raises:
            OpenAIError: 400 naming the field.
        """
        super().check()
        if self.suffix:
            raise unsupported("suffix", "insertion (fill-in-the-middle) is not implemented")
        if isinstance(self.prompt, list) and not self.prompt:
            raise OpenAIError(400, "'prompt' is empty", param="prompt")
        batch = self.prompts()
        for i, p in enumerate(batch):
            if not p:
                raise OpenAIError(
                    400, f"'prompt[{i}]' is empty" if len(batch) > 1 else "'prompt' is empty", param="prompt"
                )
        if self.max_tokens == 0 and not self.echo:
            raise OpenAIError(
                400, "'max_tokens' 0 generates nothing: it needs 'echo' (the prompt back)", param="max_tokens"
            )
        if self.echo and self.stream:
            raise unsupported("echo", "the prompt is echoed in non-streaming responses only")


class ChatMessage(BaseModel):
    """One chat message: ``role`` and ``content`` (text, a list of parts, or null)."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1, lt=2**32)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    echo: bool = False
    tools: list[Any] | None = None
    tool_choice: Any = None

    def check(self) -> None:
        """`SamplingFields.check`, plus ``echo`` and ``top_logprobs`` without ``logprobs``
        (``tools`` need the template: `tools.check_tools`; structured output:
        `structured.response_format_of`)."""
        super().check()
        if self.echo:
            raise unsupported("echo", "the last message is not echoed back")
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")


class LoadLoraRequest(HttpBody):
    """vLLM's ``/v1/load_lora_adapter`` body: a server-side path (GGUF file or PEFT folder)."""

    lora_name: str
    lora_path: str


class UnloadLoraRequest(HttpBody):
    """vLLM's ``/v1/unload_lora_adapter`` body (``lora_name`` may also be ``adapter:<id>``)."""

    model_config = ConfigDict(extra="allow")
    lora_name: str
