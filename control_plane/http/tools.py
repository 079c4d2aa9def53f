"""Tool calls on ``/v1/chat/completions``: ``tools`` / ``tool_choice`` checks, and the model's
output parsed into OpenAI ``tool_calls`` the way vLLM's ``hermes`` tool parser does for Qwen 2.5,
Qwen 3 and Hermes models.

`check_tools` checks a request's tools (a template that renders them, `template_renders_tools`,
reads ``tools`` and writes ``<tool_call>``; any other template is told about them by
`tool_prompt.hermes_messages`); `ToolCallParser` reads the hermes
blocks incrementally or all at once (`split_tool_calls`); a forced call (``tool_choice``
``"required"`` or a named function, `is_forced`, `forced_call_of`) becomes a `ForcedCall`: a
JSON Schema for structured output (`tool_parameters`, `required_calls_schema`) and its parser
(`NamedCallParser`, `RequiredCallsParser`).

Which requests get tools, the output format, what is content and what is a call, forced calls
and their ``finish_reason``: docs/http-api.md, "Tool calls".
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from control_plane.grammar_check import InlineChecker, TenantChecker
from control_plane.http.chat_template import ChatTemplate
from control_plane.http.errors import OpenAIError
from control_plane.http.structured import to_proto
from loraplane.grammar_limits import GrammarError
from loraplane.response_format import ResponseFormat, close_objects
from loraplane.v1 import common_pb2

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


def new_call_id() -> str:
    """A fresh tool-call id: ``call_`` and 24 hex digits (OpenAI's prefix)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def template_renders_tools(template: ChatTemplate) -> bool:
    """Whether ``template`` tells the model about tools in the hermes format: it references the
    variable ``tools`` (transformers' test for tool support) and writes ``<tool_call>``."""
    return template.references("tools") and CALL_OPEN in template.text


def is_forced(tool_choice: Any) -> bool:
    """Whether ``tool_choice`` forces a call: ``"required"`` or a named function (an object)."""
    return tool_choice == "required" or isinstance(tool_choice, dict)


def check_tools(tools: list[Any] | None, tool_choice: Any, *, max_tools: int) -> list[dict[str, Any]] | None:
    """The ``tools`` to tell the model about, or None (no tools, or ``tool_choice`` ``"none"``).
    A template that renders tools gets them as its ``tools`` variable; any other template gets
    them through the hermes tool prompt (`tool_prompt.hermes_messages`).

    Args:
        max_tools: most entries ``tools`` may have (``--max-tools``, `GrammarLimits.max_tools`).

    Raises:
        OpenAIError: 400 naming ``tools`` (more than ``max_tools``, not a list of ``{"type":
            "function", "function": {"name": …}}`` objects) or ``tool_choice`` (not ``"none"``,
            ``"auto"``, ``"required"`` or an object).
    """
    if isinstance(tools, list) and len(tools) > max_tools:
        raise OpenAIError(
            400,
            f"'tools' has {len(tools)} entries, over the limit of {max_tools} (--max-tools)",
            param="tools",
            code="too_many_tools",
        )
    if tool_choice is not None and tool_choice not in ("none", "auto") and not is_forced(tool_choice):
        raise OpenAIError(
            400,
            f"'tool_choice' must be 'none', 'auto', 'required' or a named function (got {tool_choice!r})",
            param="tool_choice",
        )
    if not tools or tool_choice == "none":
        return None
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise OpenAIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise OpenAIError(400, f"tools[{i}].function.name must be a non-empty string", param="tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise OpenAIError(400, f"tools[{i}].function.parameters must be a JSON Schema object", param="tools")
    return tools


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A request message as templates expect it (vLLM's ``_postprocess_messages``): an assistant
    message's ``tool_calls[].function.arguments`` given as JSON text (OpenAI's shape) becomes the
    object it spells, since templates print it with ``tojson``; anything else is unchanged."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if isinstance(fn, dict) and isinstance(args, str):
            try:
                parsed = json.loads(args)
            except (ValueError, RecursionError):  # not JSON, or nested past the recursion limit
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**fn, "arguments": parsed}}
        out.append(call)
    return {**message, "tool_calls": out}


def parse_call(body: str) -> dict[str, Any] | None:
    """One block's body → an OpenAI tool call, or None when it is not ``{"name": str,
    "arguments": object}`` JSON (``arguments`` absent → ``{}``; given as JSON text of an object
    → kept as that text)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    args = data.get("arguments", {})
    if isinstance(args, str):
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except (ValueError, RecursionError):
            return None
        text = args
    elif isinstance(args, dict):
        text = json.dumps(args, ensure_ascii=False)
    else:
        return None
    return {"id": new_call_id(), "type": "function", "function": {"name": data["name"], "arguments": text}}


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (what may
    still become the tag once more text arrives)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass
class ToolDelta:
    """What one `ToolCallParser.feed` / `finish` step releases: ``content`` text and completed
    ``calls`` (OpenAI tool-call objects, in order)."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallParser:
    """Splits generated text into content and hermes ``<tool_call>`` blocks as it arrives.

    ``feed(text)`` takes the next piece (any split: a tag may straddle pieces) and returns what
    is certain: content outside blocks, and each call when its closing tag arrives; a block is
    buffered while open, as is text that may begin a tag or is whitespace that a following call
    would drop. ``finish()`` releases the rest (an open block parsed to the end, else left as
    content). Feeding the whole text and finishing gives the non-streaming answer; any split
    gives the same content and calls.
    """

    def __init__(self) -> None:
        self._pending = ""  # text not released yet
        self._in_call = False  # inside <tool_call> … (pending is the block's body so far)
        self._scanned = 0  # inside a block: pending[:scanned] holds no closing tag (linear scans)
        self._held_ws = ""  # whitespace before a possible call, dropped if the call parses
        self._after_call = False  # the last thing released was a call: drop leading whitespace
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> ToolDelta:
        """Take the next piece of generated text; return what it releases."""
        self._pending += text
        out = ToolDelta()
        while True:
            if self._in_call:
                end = self._pending.find(CALL_CLOSE, self._scanned)
                if end < 0:
                    self._scanned = max(0, len(self._pending) - len(CALL_CLOSE) + 1)
                    return out
                body, self._pending = self._pending[:end], self._pending[end + len(CALL_CLOSE) :]
                self._in_call = False
                self._close_block(body, CALL_CLOSE, out)
                continue
            start = self._pending.find(CALL_OPEN)
            if start >= 0:
                self._content(self._pending[:start], out)
                self._pending = self._pending[start + len(CALL_OPEN) :]
                self._in_call, self._scanned = True, 0
                continue
            keep = _held_prefix(self._pending, CALL_OPEN)
            cut = len(self._pending) - keep
            self._content(self._pending[:cut], out)
            self._pending = self._pending[cut:]
            return out

    def finish(self) -> ToolDelta:
        """The end of the generation: release everything still held."""
        out = ToolDelta()
        if self._in_call:
            body, self._pending, self._in_call = self._pending, "", False
            self._close_block(body, "", out)
        else:
            text, self._pending = self._pending, ""
            self._content(text, out)
        if self._held_ws and not self._after_call:
            out.content += self._held_ws
        self._held_ws = ""
        return out

    def finish_reason(self, engine: str | None) -> str | None:
        """``"tool_calls"`` when the answer holds a call (vLLM's rule for ``"auto"``), else
        the engine's ``finish_reason``."""
        return "tool_calls" if self.calls else engine

    def _close_block(self, body: str, close: str, out: ToolDelta) -> None:
        call = parse_call(body)
        if call is None:  # not a call: the block is ordinary content, tags and all
            self._content(CALL_OPEN + body + close, out, literal=True)
            return
        self._held_ws = ""
        self._after_call = True
        self.calls.append(call)
        out.calls.append(call)

    def _content(self, text: str, out: ToolDelta, *, literal: bool = False) -> None:
        """Release ``text`` as content, keeping back its trailing whitespace (dropped if a call
        follows, released with the next content otherwise) and dropping whitespace right after
        a call; ``literal`` (a block that is not a call) is released whole."""
        if not text:
            return
        if self._after_call and not literal:
            text = text.lstrip()
            if not text:
                return
        text = self._held_ws + text
        self._held_ws = ""
        body = text.rstrip() if not literal else text
        if body:
            self._after_call = False
        out.content += body
        self._held_ws = text[len(body) :]


class OutputParser(Protocol):
    """What `streaming.CompletionStream` reads tool calls with: `ToolCallParser` (``"auto"``),
    `NamedCallParser` and `RequiredCallsParser` (forced calls)."""

    calls: list[dict[str, Any]]

    def feed(self, text: str) -> ToolDelta:
        """Take the next piece of generated text; return what it releases."""
        ...

    def finish(self) -> ToolDelta:
        """The end of the generation: release everything still held."""
        ...

    def finish_reason(self, engine: str | None) -> str | None:
        """The answer's ``finish_reason`` given the engine's."""
        ...


def split_tool_calls(text: str, parser: OutputParser | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """The whole output → ``(content or None, tool calls)``, read by ``parser`` (a fresh
    `ToolCallParser` when None) in one go."""
    parser = ToolCallParser() if parser is None else parser
    first, last = parser.feed(text), parser.finish()
    content = first.content + last.content
    return (content if content.strip() else None), first.calls + last.calls


# ------------------------------------------------------------------------------ forced calls


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


class NamedCallParser:
    """A named ``tool_choice``: the whole output (JSON constrained to the function's
    parameters) is the ``arguments`` of one call, released at the end; ``finish_reason`` is the
    engine's (vLLM ``serving_chat.py``: named calls keep ``"stop"``, as OpenAI does). A
    truncated output (``"length"``) is still the call's ``arguments``, as vLLM answers."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._text: list[str] = []
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> ToolDelta:
        """Buffer ``text``; nothing is released before the end."""
        self._text.append(text)
        return ToolDelta()

    def finish(self) -> ToolDelta:
        """The call, its ``arguments`` the whole output."""
        call = _call(self.name, "".join(self._text).strip())
        self.calls.append(call)
        return ToolDelta(calls=[call])

    def finish_reason(self, engine: str | None) -> str | None:
        """The engine's ``finish_reason``."""
        return engine


class RequiredCallsParser:
    """``tool_choice: "required"``: the output is a JSON array of ``{"name", "parameters"}``
    objects (constrained by `required_calls_schema`); each item becomes a call (``arguments`` =
    ``parameters`` as JSON text, ``json.dumps`` with ``ensure_ascii=False`` as vLLM writes
    them), released when its closing brace arrives (any split of the text gives the same calls).

    At the end, text that did not become a call (an item cut off by ``max_tokens``, or output
    that is not such an array) is released as ``content``. ``finish_reason``: ``"tool_calls"``
    when there are calls and the engine stopped by itself (``"stop"``), else the engine's.
    """

    def __init__(self) -> None:
        self._buf = ""  # text after the last consumed item / bracket / comma
        self._opened = False  # "[" consumed
        self._closed = False  # "]" consumed
        self._bad = False  # not the expected shape: the rest is content
        self._held = ""  # text since the last call (content if no further call completes)
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> ToolDelta:
        """Take the next piece; return the calls whose items it closed."""
        self._held += text
        self._buf += text
        out = ToolDelta()
        if not self._opened or "}" in text or "]" in text:  # an item closes with "}", the array with "]"
            self._scan(out)
        return out

    def _scan(self, out: ToolDelta) -> None:
        """Consume what is complete in the buffer: ``[``, items (each a call added to ``out``),
        commas, ``]``."""
        if self._bad or self._closed:
            return
        decoder = json.JSONDecoder()
        while True:
            buf = self._buf.lstrip()
            if not self._opened:
                if not buf:
                    return
                if buf[0] != "[":
                    self._bad = True
                    return
                self._opened, buf = True, buf[1:].lstrip()
            if buf.startswith(","):
                buf = buf[1:].lstrip()
            if buf.startswith("]"):
                self._closed, self._buf = True, buf[1:]
                return
            if not buf:
                self._buf = buf
                return
            try:
                item, end = decoder.raw_decode(buf)
            except (ValueError, RecursionError):
                self._buf = buf  # incomplete so far
                return
            call = self._item_call(item)
            if call is None:
                self._bad = True
                return
            self._buf = self._held = buf[end:]
            self.calls.append(call)
            out.calls.append(call)

    def finish(self) -> ToolDelta:
        """Release what did not become a call as ``content``."""
        self._scan(ToolDelta())  # feed scans every piece that can close something: a no-op guard
        rest = self._held if (self._bad or not self._closed) else self._buf
        self._held = self._buf = ""
        return ToolDelta(content=rest if rest.strip() else "")

    def finish_reason(self, engine: str | None) -> str | None:
        """``"tool_calls"`` when calls were made and the engine stopped by itself."""
        return "tool_calls" if self.calls and engine == "stop" else engine

    @staticmethod
    def _item_call(item: Any) -> dict[str, Any] | None:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            return None
        params = item.get("parameters", {})
        if not isinstance(params, dict):
            return None
        return _call(item["name"], json.dumps(params, ensure_ascii=False))


def tool_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's ``parameters`` schema (``{"type": "object", "properties": {}}`` when absent,
    vLLM's default) as a forced call follows it: its objects that list ``properties`` closed
    (``"additionalProperties": false`` unless the schema says otherwise, as every ``json_schema``
    format here: `close_objects`), every object closed when the tool's ``function.strict`` is
    true (OpenAI ``strict``)."""
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return close_objects(params, listed_only=not fn.get("strict"))


def required_calls_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON Schema of ``tool_choice: "required"``: an array of at least one ``{"name":
    <a tool's name>, "parameters": <its parameters>}`` (vLLM's ``_get_json_schema_from_tool``:
    ``anyOf`` one object per tool, each tool's ``$defs`` moved to the root so their ``$ref`` links
    resolve).

    Raises:
        OpenAIError: 400 naming ``tools`` when two tools define one ``$defs`` name differently.
    """
    defs: dict[str, Any] = {}
    options = []
    for i, tool in enumerate(tools):
        params = dict(tool_parameters(tool))
        own = params.pop("$defs", None) or {}
        if not isinstance(own, dict):
            raise OpenAIError(400, f"tools[{i}].function.parameters: '$defs' must be an object", param="tools")
        for name, definition in own.items():
            if name in defs and defs[name] != definition:
                raise OpenAIError(
                    400,
                    f"tools[{i}].function.parameters: '$defs' entry {name!r} differs from another tool's "
                    "(tool_choice 'required' joins every tool's $defs into one schema)",
                    param="tools",
                )
            defs[name] = definition
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool["function"]["name"]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass(frozen=True)
class ForcedCall:
    """A ``tool_choice`` that forces a call: ``name`` (a named function) or None
    (``"required"``), and the JSON Schema the output is constrained to (module docstring)."""

    name: str | None
    schema: dict[str, Any]

    def response_format(self) -> common_pb2.ResponseFormat:
        """The request's ``ResponseFormat``: ``TYPE_JSON_SCHEMA`` over `schema` (strictness is
        already in the schema, per tool)."""
        return to_proto(ResponseFormat("json_schema", schema=json.dumps(self.schema)))

    def parser(self) -> OutputParser:
        """A fresh parser of the output: `NamedCallParser` or `RequiredCallsParser`."""
        return NamedCallParser(self.name) if self.name is not None else RequiredCallsParser()


def forced_call_of(
    tools: list[Any] | None,
    tool_choice: Any,
    checker: TenantChecker | InlineChecker,
    *,
    response_format: bool = False,
) -> ForcedCall | None:
    """The forced call of ``tool_choice`` (None: ``"auto"``, ``"none"`` or omitted), its
    schema compiled once by ``checker`` (the router's: limits, then the engine, in a child
    process) to refuse a bad one early. ``tools`` were checked by `check_tools`;
    ``response_format``: the request also asks for structured output.

    Raises:
        OpenAIError: 400 naming ``tool_choice`` (no ``tools``, a malformed object, a name no
            tool has, or combined with ``response_format`` / ``guided_*``, which would be a
            second constraint on the same output) or ``tools`` (a ``parameters`` schema that
            does not compile).
    """
    if not is_forced(tool_choice):
        return None
    what = "'required'" if tool_choice == "required" else "a named function"
    if not tools:
        raise OpenAIError(400, f"'tool_choice' {what} needs 'tools'", param="tool_choice")
    if response_format:
        raise OpenAIError(
            400,
            f"'tool_choice' {what} constrains the output to the tool's arguments; it cannot be "
            "combined with 'response_format' (or guided_* / structured_outputs): send one of them",
            param="tool_choice",
            code="conflicting_parameters",
        )
    if tool_choice == "required":
        forced = ForcedCall(None, required_calls_schema(tools))
        param_at = "tools"
    else:
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str) or not name:
            raise OpenAIError(
                400,
                "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
                param="tool_choice",
            )
        index = next((i for i, t in enumerate(tools) if t["function"]["name"] == name), None)
        if index is None:
            known = ", ".join(repr(t["function"]["name"]) for t in tools)
            raise OpenAIError(
                400, f"'tool_choice' names function {name!r}, which is not in 'tools' ({known})", param="tool_choice"
            )
        forced = ForcedCall(name, tool_parameters(tools[index]))
        param_at = f"tools[{index}].function.parameters"
    try:
        checker.check(ResponseFormat("json_schema", schema=json.dumps(forced.schema)))
    except GrammarError as exc:
        raise OpenAIError(
            400, f"invalid '{param_at}' (the schema a forced tool call follows): {exc}", param="tools"
        ) from exc
    return forced
