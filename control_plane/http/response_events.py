"""`ResponseEvents`: one generation as an OpenAI ``response`` object, whole or as its
server-sent events (the Responses API, `responses_api`).

A `streaming.CompletionStream` in chat mode (same event folding, same tool-call parsers, same
`streaming.RelayResponse` that watches the client) whose answer takes the Responses shapes:

* output items: a ``message`` (one ``output_text`` part), one ``function_call`` per call;
* ``status``: ``"completed"``, or ``"incomplete"`` with ``incomplete_details.reason``
  ``"max_output_tokens"`` when generation stopped at its token limit (``finish_reason``
  ``"length"``); ``usage``: ``input_tokens`` (with ``input_tokens_details.cached_tokens``),
  ``output_tokens``, ``total_tokens``;
* events (``event: <type>`` + ``data: <json>``, each with its ``sequence_number`` from 0):
  ``response.created``, ``response.in_progress``; per message ``response.output_item.added``,
  ``response.content_part.added``, ``response.output_text.delta`` (one per piece released),
  ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``;
  per call ``response.output_item.added``, ``response.function_call_arguments.delta`` (the whole
  arguments), ``response.function_call_arguments.done``, ``response.output_item.done``; last
  ``response.completed`` (or ``response.incomplete``) with the whole response. No ``[DONE]``
  (OpenAI sends none). A failure after the first event: ``error`` then ``response.failed``.
Event order and item rules: docs/http-api.md, "Responses API".
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import structlog

from control_plane.errors import ControlPlaneError
from control_plane.http import responses as R
from control_plane.http.errors import from_control_plane
from control_plane.http.generation import Outcome, TokenOut, now_s
from control_plane.http.streaming import CompletionStream
from control_plane.http.tools import ForcedCall, ToolDelta, split_tool_calls
from loraplane.v1 import common_pb2

log = structlog.get_logger("loraplane.control_plane.http.response_events")


def usage_of(out: Outcome) -> dict[str, Any]:
    """The Responses ``usage`` of ``out``: the chat usage's counts under Responses names
    (``reasoning_tokens`` always 0: no reasoning output)."""
    n_in, n_out = len(out.prompt_token_ids), len(out.tokens)
    return {
        "input_tokens": n_in,
        "input_tokens_details": {"cached_tokens": out.cached_tokens},
        "output_tokens": n_out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": n_in + n_out,
    }


def text_part(text: str) -> dict[str, Any]:
    """An ``output_text`` content part (no annotations, no log-probs)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant ``message`` output item; ``text`` None: no content part yet."""
    content = [] if text is None else [text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call: dict[str, Any], status: str, arguments: str | None = None) -> dict[str, Any]:
    """A ``function_call`` output item of a chat tool call (``call_id`` = the call's id);
    ``arguments`` None: the call's own."""
    fn = call["function"]
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"] if arguments is None else arguments,
    }


def new_item_id(prefix: str) -> str:
    """A fresh output item id: ``msg_`` / ``fc_`` and 32 hex digits (OpenAI's prefixes)."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseEvents(CompletionStream):
    """The Responses answer of one request (module docstring).

    Args:
        events: ``Router.generate``'s iterator for this request (not started yet).
        cancel: cancels the worker call (as `CompletionStream`'s).
        head: the request-derived fields of the response (`responses_api.response_head`);
            its ``id``, ``model`` and ``created_at`` are the response's.
        token_text: token id → text (`CompletionStream`'s; no log-probs are returned).
        tool_calls: parse ``<tool_call>`` blocks out of the text (``tool_choice`` ``"auto"``).
        forced: the output is a forced tool call (`tools.ForcedCall`).
    """

    def __init__(
        self,
        events: Iterable[common_pb2.GenerateEvent],
        *,
        cancel: Callable[[], None],
        head: dict[str, Any],
        token_text: R.TokenText,
        tool_calls: bool = False,
        forced: ForcedCall | None = None,
    ) -> None:
        super().__init__(
            events,
            cancel=cancel,
            request_id=head["id"],
            created=head["created_at"],
            model=head["model"],
            chat=True,
            logprobs=None,
            token_text=token_text,
            tool_calls=tool_calls,
            forced=forced,
        )
        self.head = head
        self._seq = 0
        self._output: list[dict[str, Any]] = []  # finished output items
        self._message: dict[str, Any] | None = None  # the open message item
        self._message_text: list[str] = []
        self._held_space = ""  # whitespace-only content before any message, with tools

    def response(self, status: str, output: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        """The ``response`` object: `head` with ``status``, ``output`` and ``fields``."""
        return {**self.head, "status": status, "output": output, **fields}

    def _final(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished response: status from the finish reason, usage, completion time."""
        out = self.outcome
        if out.finish_reason == "length":
            status, details = "incomplete", {"reason": "max_output_tokens"}
        else:
            status, details = "completed", None
        return self.response(status, output, incomplete_details=details, usage=usage_of(out), completed_at=now_s())

    def _item_status(self) -> str:
        return "incomplete" if self.outcome.finish_reason == "length" else "completed"

    # ---- non-streaming ----------------------------------------------------------------------

    def full_response(self, *, return_token_ids: bool = False) -> dict[str, Any]:
        """Read every event, then the whole ``response`` object: a message when there is text
        (or no call at all), then one ``function_call`` item per call. ``return_token_ids`` is
        not used (the Responses API has no such field).

        Raises:
            OpenAIError: the router failed (status from `errors.from_control_plane`).
        """
        out = self._read_all()
        if self._tools is not None:
            content, calls = split_tool_calls(out.text, self._tools)
        else:
            content, calls = out.text, []
        output = []
        if content is not None or not calls:
            output.append(message_item(new_item_id("msg"), content or "", self._item_status()))
        output += [call_item(new_item_id("fc"), c, "completed") for c in calls]
        return self._final(output)

    # ---- streaming ----------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> str:
        """One server-sent event: ``event: <kind>`` and its data, numbered."""
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\n" + R.sse(data)

    def _chunks(self, first: TokenOut | None, include_usage: bool) -> Iterator[str]:
        """The events (module docstring); ``include_usage`` does not apply (usage is always in
        the last event's response)."""
        yield self._event("response.created", response=self.response("in_progress", []))
        yield self._event("response.in_progress", response=self.response("in_progress", []))
        if self._tools is None:  # plain text: the message opens at once, as OpenAI's does
            yield from self._open_message()
        try:
            for item in itertools.chain([first], self._items):
                yield from self._step(item)
            if self._message is None and not self._output:  # no text and no call: an empty message
                yield from self._open_message()
            yield from self._close_message()
            final = self._final(self._output)
            yield self._event(f"response.{final['status']}", response=final)
        except ControlPlaneError as exc:
            error = from_control_plane(exc)
            log.warning("http_stream_failed", request_id=self.request_id, status=error.status, error=error.message)
            yield self._event("error", code=error.code, message=error.message, param=error.param)
            failed = self.response("failed", self._output, error={"code": "server_error", "message": error.message})
            yield self._event("response.failed", response=failed)

    def _step(self, item: TokenOut | None) -> Iterator[str]:
        """The events of one token (None: the finish, with the text held back until then)."""
        if item is not None:
            self._streamed.append(item.text)
            piece = item.text
        else:
            out = self.outcome
            streamed = "".join(self._streamed)
            piece = out.text[len(streamed) :] if out.text.startswith(streamed) else ""
        if self._tools is None:
            steps = [ToolDelta(content=piece)]
        elif item is None:
            steps = [self._tools.feed(piece), self._tools.finish()]
        else:
            steps = [self._tools.feed(piece)]
        for step in steps:
            yield from self._text(step.content)
            for call in step.calls:
                yield from self._close_message()
                yield from self._call(call)

    def _text(self, text: str) -> Iterator[str]:
        if not text:
            return
        if self._message is None:
            if not text.strip():  # with tools: whitespace before a call is dropped, as non-streaming
                self._held_space += text
                return
            text, self._held_space = self._held_space + text, ""
            yield from self._open_message()
        assert self._message is not None
        self._message_text.append(text)
        index = len(self._output)
        yield self._event(
            "response.output_text.delta",
            item_id=self._message["id"],
            output_index=index,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _open_message(self) -> Iterator[str]:
        self._message = message_item(new_item_id("msg"), None, "in_progress")
        self._message_text = []
        index, item_id = len(self._output), self._message["id"]
        yield self._event("response.output_item.added", output_index=index, item=self._message)
        yield self._event(
            "response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=text_part("")
        )

    def _close_message(self) -> Iterator[str]:
        if self._message is None:
            return
        text = "".join(self._message_text)
        index, item_id = len(self._output), self._message["id"]
        # closed by a call: complete; closed by the finish: as the generation ended
        status = self._item_status() if self.outcome.finish_reason is not None else "completed"
        yield self._event(
            "response.output_text.done", item_id=item_id, output_index=index, content_index=0, text=text, logprobs=[]
        )
        yield self._event(
            "response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=text_part(text)
        )
        done = message_item(item_id, text, status)
        yield self._event("response.output_item.done", output_index=index, item=done)
        self._output.append(done)
        self._message = None

    def _call(self, call: dict[str, Any]) -> Iterator[str]:
        index, item_id = len(self._output), new_item_id("fc")
        arguments = call["function"]["arguments"]
        yield self._event(
            "response.output_item.added", output_index=index, item=call_item(item_id, call, "in_progress", "")
        )
        yield self._event(
            "response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=arguments
        )
        yield self._event(
            "response.function_call_arguments.done", item_id=item_id, output_index=index, arguments=arguments
        )
        done = call_item(item_id, call, "completed")
        yield self._event("response.output_item.done", output_index=index, item=done)
        self._output.append(done)


__all__ = ["ResponseEvents", "usage_of"]
