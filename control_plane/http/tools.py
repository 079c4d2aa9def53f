"""Tool calls on ``/v1/chat/completions``: ``tools`` / ``tool_choice`` checks, and the model's
output parsed into OpenAI ``tool_calls`` the way vLLM's ``hermes`` tool parser does for Qwen 2.5,
Qwen 3 and Hermes models (``vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py``).

Which requests get tools:

* The chat template must render them: it references the variable ``tools`` and writes the
  hermes format (``<tool_call>``) — `template_renders_tools`. A request with ``tools`` for any
  other template is a 400 naming ``tools`` (the model cannot be told about them, or we could not
  read its answer; vLLM likewise refuses ``tools`` unless a tool parser is configured).
* ``tool_choice``: omitted or ``"auto"`` → ``tools`` go into the template (as transformers'
  ``apply_chat_template(tools=…)``) and the output is parsed; ``"none"`` → ``tools`` are
  neither rendered nor parsed (the model answers in text); ``"required"`` or a named function
  → 400 naming ``tool_choice`` (forcing a call needs constrained decoding).

The output format (one block per call; Qwen writes a newline inside the tags)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`ToolCallParser` reads it incrementally (streaming) or all at once (the same code): text outside
the blocks is ``content``; each block whose body is a JSON object with a string ``name`` (and an
object ``arguments``, ``{}`` when absent) becomes ``{"id": "call_…", "type": "function",
"function": {"name", "arguments": <JSON text>}}``; a block that is not (malformed JSON, no name)
stays in ``content`` verbatim, tags included. A block still open when the generation ends is
parsed up to the end (vLLM's rule; a truncated call stays content). Whitespace between a call
and its neighbours is dropped, so ``content`` is None for an answer that is only calls. Unlike
vLLM (which then keeps only the text before the first call, and drops every call when one is
malformed), text after a call is kept and good calls survive a bad neighbour.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from control_plane.http.chat_template import ChatTemplate
from control_plane.http.errors import OpenAIError, unsupported

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


def new_call_id() -> str:
    """A fresh tool-call id: ``call_`` and 24 hex digits (OpenAI's prefix)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def template_renders_tools(template: ChatTemplate) -> bool:
    """Whether ``template`` tells the model about tools in the hermes format: it references the
    variable ``tools`` (transformers' test for tool support) and writes ``<tool_call>``."""
    return template.references("tools") and CALL_OPEN in template.text


def check_tools(tools: list[Any] | None, tool_choice: Any, template: ChatTemplate) -> list[dict[str, Any]] | None:
    """The ``tools`` to render and parse for, or None (no tools, or ``tool_choice`` ``"none"``).

    Raises:
        OpenAIError: 400 naming ``tools`` (not a list of ``{"type": "function", "function":
            {"name": …}}`` objects, or a template that does not render tools) or ``tool_choice``
            (``"required"`` / a named function: not implemented; anything else: invalid).
    """
    if tool_choice is not None and tool_choice not in ("none", "auto"):
        if tool_choice == "required" or isinstance(tool_choice, dict):
            raise unsupported(
                "tool_choice",
                "forcing a tool call ('required' or a named function) needs constrained decoding, "
                "not available yet; use 'auto' (the default) or 'none'",
            )
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
    if not template_renders_tools(template):
        raise OpenAIError(
            400,
            f"this model's chat template ({template.source}) does not render tools in the <tool_call> "
            "format, so the model cannot be told about them; send no 'tools', or start with a "
            "--chat-template that renders them",
            param="tools",
            code="tools_not_supported",
        )
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
            except ValueError:
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
        except ValueError:
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


def split_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The whole output → ``(content or None, tool calls)`` (`ToolCallParser` in one go)."""
    parser = ToolCallParser()
    first, last = parser.feed(text), parser.finish()
    content = first.content + last.content
    return (content if content.strip() else None), first.calls + last.calls
