"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions`` (pydantic).

Omitted parameters take OpenAI's defaults, as vLLM does: ``temperature`` 1, ``top_p`` 1,
``max_tokens`` 16 for completions and "until the context is full" for chat. Parameters
loraplane does not implement are refused with a 400 naming them (`SamplingFields.check`):
``n`` > 1, ``best_of`` > 1, non-zero ``presence_penalty`` / ``frequency_penalty``,
``repetition_penalty`` ≠ 1, ``logit_bias``, ``echo``, ``suffix``, tools and structured output.
Unknown fields are ignored (clients send vendor extras freely). Every string of a body, keys
included, must be valid Unicode: a lone surrogate is a 400 ``invalid_unicode`` naming the field
(`HttpBody`).

Extensions (vLLM / llama-server names): ``top_k``, ``ignore_eos``, ``return_token_ids``
(vLLM: non-streaming responses carry ``prompt_token_ids`` and each choice's ``token_ids``), and
``lora``: a list of ``{"id": int, "scale": float}`` (llama-server's per-request shape) that
picks the adapters explicitly and wins over ``model``.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from control_plane.http.errors import INVALID_UNICODE, OpenAIError, unsupported

MAX_STOP_STRINGS = 16
# "until the context is full": the worker stops at its slot context (finish_reason "length")
CHAT_MAX_TOKENS_DEFAULT = 2**31 - 1


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(data: Any) -> tuple[str, int, int] | None:
    """The first string in parsed JSON ``data`` (keys included) holding a lone UTF-16 surrogate:
    ``(dotted field path, character index, code point)``; None when every string is valid
    Unicode. JSON may spell one (``"\\ud800"``) and Python's decoder keeps it, but it has no
    UTF-8 form: protobuf, the tokenizer and the response encoder would all fail on it later.
    Walks with an explicit stack (no recursion limit); ASCII strings cost one ``isascii``."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and (m := _SURROGATE.search(value)):
                return path or "body", m.start(), ord(m.group())
        elif isinstance(value, dict):
            items = list(value.items())
            for key, item in reversed(items):
                name = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and not key.isascii() and (m := _SURROGATE.search(key)):
                    return (path or "body"), m.start(), ord(m.group())
                stack.append((name, item))
        elif isinstance(value, list):
            for i in range(len(value) - 1, -1, -1):
                stack.append((f"{path}.{i}" if path else str(i), value[i]))
    return None


class HttpBody(BaseModel):
    """Base of every request body: strings must be valid Unicode (`lone_surrogate`), else a
    400 ``invalid_unicode`` naming the field (`errors.validation_error`)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
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
    """``stream_options``: ``include_usage`` adds a usage chunk before ``[DONE]``."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SamplingFields(HttpBody):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, lt=2**32)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, lt=2**32)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    n: int | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    lora: list[LoraEntry] | None = None
    return_token_ids: bool = False
    user: str | None = None

    def check(self) -> None:
        """Raise a 400 `OpenAIError` naming the first unsupported parameter."""
        if self.n not in (None, 1):
            raise unsupported("n", f"one choice per request (got n={self.n})")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", f"one candidate per request (got best_of={self.best_of})")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise unsupported(name, f"penalties are not implemented (got {value})")
        if self.repetition_penalty not in (None, 1, 1.0):
            raise unsupported("repetition_penalty", f"penalties are not implemented (got {self.repetition_penalty})")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit biases are not implemented")
        stops = self.stop_list()
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise OpenAIError(400, f"'stop' takes at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
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
    """``POST /v1/completions``: ``prompt`` is a string, a one-string list, or token ids."""

    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    def check(self) -> None:
        """`SamplingFields.check`, plus ``echo``, ``suffix`` and batched or empty prompts."""
        super().check()
        if self.echo:
            raise unsupported("echo", "the prompt is not echoed back")
        if self.suffix:
            raise unsupported("suffix", "insertion (fill-in-the-middle) is not implemented")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise unsupported("prompt", "one prompt per request (a list of prompts is a batch)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise OpenAIError(400, "'prompt' is empty", param="prompt")


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
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        """`SamplingFields.check`, plus tools, structured output and ``top_logprobs``
        without ``logprobs``."""
        super().check()
        if self.tools:
            raise unsupported("tools", "tool calling is not implemented")
        if self.tool_choice not in (None, "none"):
            raise unsupported("tool_choice", "tool calling is not implemented")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise unsupported("response_format", "structured output is not implemented")
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
