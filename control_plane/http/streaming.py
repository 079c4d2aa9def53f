"""`CompletionStream`: one generation's events as an OpenAI response, whole or streamed.

`CompletionStream` reads the ``GenerateEvent`` iterator of ``Router.generate`` through
`generation.fold` and writes either one JSON body (`CompletionStream.full_response`) or
server-sent chunks (`CompletionStream.sse_chunks`: the chat role chunk, one chunk per token, the
held-back tail with ``finish_reason``, the usage chunk when asked, ``[DONE]``); tool calls go
through `tools.ToolCallParser` or a forced call's parser. An error before the first token raises
`OpenAIError`; one after it becomes an error event before ``[DONE]``. `RelayResponse` is the
ASGI response that runs it while it watches the client: the router's blocking reads run on a
limiter of their own (`RELAY_THREADS`), and a client that disconnects or reads nothing for
``write_timeout_s`` (`delivery.DeliveryProgress`) has its worker call cancelled at once.

Chunk order, tool-call deltas, clients that leave: docs/http-api.md, "Responses and streaming",
"Tool calls" and the introduction's "Clients that leave".
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import structlog
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from control_plane.errors import ControlPlaneError
from control_plane.http import responses as R
from control_plane.http.delivery import DeliveryProgress
from control_plane.http.errors import OpenAIError, from_control_plane
from control_plane.http.generation import Outcome, TokenOut, fold
from control_plane.http.tools import ForcedCall, OutputParser, ToolCallParser, ToolDelta, split_tool_calls
from loraplane.v1 import common_pb2

log = structlog.get_logger("loraplane.control_plane.http.streaming")

RELAY_THREADS = 256
"""Threads the HTTP front may block at once reading generations (a thread waits for each next
token); their own limiter, so long generations never starve the routes' default limiter."""
_relay_limiter: anyio.CapacityLimiter | None = None

CHAT_CHUNK = "chat.completion.chunk"
COMPLETION_CHUNK = "text_completion"


class CompletionStream:
    """The state machine from one request's ``GenerateEvent`` stream to OpenAI's response.

    Use one of `full_response` (non-streaming), `sse_chunks` / `sse_response` (streaming),
    once. Everything the request produced is recorded in `outcome` as it is read.

    Args:
        events: ``Router.generate``'s iterator for this request (not started yet).
        cancel: cancels the worker call (``HttpCallContext.cancel``); called exactly when the
            response is done, failed, or abandoned; must be idempotent.
        request_id: the response ``id`` (``cmpl-…`` / ``chatcmpl-…``).
        created: the response ``created`` time, Unix seconds.
        model: the response ``model`` (as the client named it).
        chat: True → ``chat.completion`` shapes; False → ``text_completion`` shapes.
        logprobs: None → no log-probs; ``n`` → each token's log-prob with its ``n`` most
            likely alternatives (0: none; completions then list the chosen token alone).
        token_text: token id → text shown in log-probs.
        tool_calls: chat only: parse ``<tool_call>`` blocks out of the text (module docstring).
        forced: chat only: the output is a forced tool call (`tools.ForcedCall`), read by its
            parser (takes precedence over ``tool_calls``).
        echo: completions only, non-streaming: the prompt's text, put before the generated
            text (OpenAI ``echo``); with ``logprobs``, the prompt tokens' log-probs lead the
            choice's (`responses.echo_logprobs`). None: no echo.
        generate_nothing: ``max_tokens: 0`` with ``echo``: the worker ran with one token to
            compute the prompt; that token is dropped from the answer and its usage.
    """

    def __init__(
        self,
        events: Iterable[common_pb2.GenerateEvent],
        *,
        cancel: Callable[[], None],
        request_id: str,
        created: int,
        model: str,
        chat: bool,
        logprobs: int | None,
        token_text: R.TokenText,
        tool_calls: bool = False,
        forced: ForcedCall | None = None,
        echo: str | None = None,
        generate_nothing: bool = False,
    ) -> None:
        self.outcome = Outcome()
        self.echo = echo
        self.generate_nothing = generate_nothing
        self.continuous_usage = False  # vLLM stream_options.continuous_usage_stats: usage on every chunk
        self._items = fold(iter(events), self.outcome)
        self._cancel = cancel
        self.request_id = request_id
        self.created = created
        self.model = model
        self.chat = chat
        self.logprobs = logprobs
        self._token_text = token_text
        self._streamed: list[str] = []  # token pieces sent so far
        self._streamed_chars = 0
        self._tools: OutputParser | None = None
        if chat and forced is not None:
            self._tools = forced.parser()
        elif chat and tool_calls:
            self._tools = ToolCallParser()

    def close(self) -> None:
        """Cancel the worker call and release its capacity (nothing happens when it already
        ended); safe from any thread, also while another thread blocks reading events; the
        ``cancel`` callback runs once."""
        cancel, self._cancel = self._cancel, _noop
        cancel()

    # ---- non-streaming ----------------------------------------------------------------------

    def _read_all(self) -> Outcome:
        """Read every event (the call is released at the end, or on failure); the outcome.

        Raises:
            OpenAIError: the router failed (status from `errors.from_control_plane`).
        """
        try:
            for _ in self._items:
                pass
        except ControlPlaneError as exc:
            raise from_control_plane(exc) from None
        finally:
            self.close()
        return self.outcome

    def full_response(self, *, return_token_ids: bool = False) -> dict[str, Any]:
        """Read every event, then the whole ``text_completion`` / ``chat.completion`` body.

        ``return_token_ids`` adds ``prompt_token_ids`` and the choice's ``token_ids``; prompt
        log-probs (when the request asked for them) are added in vLLM's place and shape
        (`responses.prompt_logprobs`).

        Raises:
            OpenAIError: the router failed (status from `errors.from_control_plane`).
        """
        out = self._read_all()
        if self.generate_nothing:
            out.tokens, out.text, out.finish_reason = [], "", "length"
        make = R.chat_body if self.chat else R.completion_body
        body = make(self.request_id, self.created, self.model, out, self._logprobs_of(out.tokens))
        if self.echo is not None:
            self._echo(body["choices"][0], out)
        if self._tools is not None:
            content, calls = split_tool_calls(out.text, self._tools)
            choice = body["choices"][0]
            if calls:
                choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
            choice["finish_reason"] = self._tools.finish_reason(out.finish_reason)
        if return_token_ids:
            body["prompt_token_ids"] = out.prompt_token_ids
            body["choices"][0]["token_ids"] = [t.token_id for t in out.tokens]
            if not self.chat:  # vLLM's completions carry it on the choice (a batch: each its own)
                body["choices"][0]["prompt_token_ids"] = out.prompt_token_ids
        if out.prompt_logprobs is not None:
            plp = R.prompt_logprobs(out.prompt_logprobs, self._token_text, out.prompt_top)
            if self.chat:  # vLLM: on the chat response, on the completion's choice
                body["prompt_logprobs"] = plp
            else:
                body["choices"][0]["prompt_logprobs"] = plp
        return body

    def _echo(self, choice: dict[str, Any], out: Outcome) -> None:
        """The prompt before the choice's text, and its tokens' log-probs before the choice's."""
        choice["text"] = (self.echo or "") + choice["text"]
        if self.logprobs is None:
            return
        lp = R.echo_logprobs(out, self._token_text, self.logprobs)
        gen = self._logprobs_of(out.tokens, sum(len(t) for t in lp["tokens"]))
        for key in lp:
            lp[key] += gen[key] if gen is not None else []
        choice["logprobs"] = lp

    # ---- streaming ----------------------------------------------------------------------------

    def sse_chunks(self, *, include_usage: bool = False) -> Iterator[str]:
        """The response's server-sent events (``data: …\\n\\n`` strings), in the order of the
        module docstring; ``include_usage`` adds the usage chunk before ``[DONE]``.

        The first event is read now, so an error before the first token raises here.

        Raises:
            OpenAIError: the router failed before the first token (the call is cancelled).
        """
        try:
            first = next(self._items, None)
        except ControlPlaneError as exc:
            self.close()
            raise from_control_plane(exc) from None
        except BaseException:
            self.close()
            raise
        return self._chunks(first, include_usage)

    def _chunks(self, first: TokenOut | None, include_usage: bool) -> Iterator[str]:
        if self.chat:
            yield R.sse(self._with_usage(self._role_chunk()))
        try:
            for item in itertools.chain([first], self._items):
                if item is None:
                    for last in self._finish_chunks():
                        yield R.sse(self._with_usage(last))
                    continue
                chunk = self._token_chunk(item)
                if chunk is not None:
                    yield R.sse(self._with_usage(chunk))
            if include_usage:
                yield R.sse(self._usage_chunk())
        except ControlPlaneError as exc:
            error = from_control_plane(exc)
            log.warning("http_stream_failed", request_id=self.request_id, status=error.status, error=error.message)
            yield R.sse(error.body())
        yield R.SSE_DONE

    # ---- chunk bodies (dicts; `responses.sse` frames them) -----------------------------------

    def _with_usage(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """``chunk`` with the usage so far when ``continuous_usage`` is on (vLLM's
        ``continuous_usage_stats``: prompt tokens, tokens generated up to this chunk)."""
        if self.continuous_usage:
            chunk["usage"] = self.outcome.usage()
        return chunk

    def _role_chunk(self) -> dict[str, Any]:
        """The first chat chunk: the role, and ``content`` ``""`` — ``null`` when the answer may
        be tool calls (OpenAI's first chunk of a call; a client that joins the deltas then ends
        with ``content`` null when no text follows)."""
        content = None if self._tools is not None else ""
        return R.chat_chunk(
            self.request_id, self.created, self.model, {"role": "assistant", "content": content}, None, None
        )

    def _token_chunk(self, token: TokenOut) -> dict[str, Any] | None:
        """One generated token: its piece and (when asked for) its log-probs; with tool calls,
        what the parser released (None: nothing to send)."""
        offset = self._streamed_chars
        self._streamed.append(token.text)
        self._streamed_chars += len(token.text)
        logprobs = self._logprobs_of([token], offset)
        if self._tools is not None:
            delta = self._tool_delta(self._tools.feed(token.text))
            if not delta and logprobs is None:
                return None
            return R.chat_chunk(self.request_id, self.created, self.model, delta, logprobs, None)
        if self.chat:
            return R.chat_chunk(self.request_id, self.created, self.model, {"content": token.text}, logprobs, None)
        return R.completion_chunk(self.request_id, self.created, self.model, token.text, logprobs, None)

    def _finish_chunks(self) -> list[dict[str, Any]]:
        """The finish (`_finish_chunk`); with tool calls, what the parser still held goes in a
        chunk of its own and ``finish_reason`` alone in the last one, as OpenAI streams calls
        (the ``openai`` package's stream helpers close a call's arguments before the finish)."""
        if self._tools is None:
            return [self._finish_chunk()]
        out = self.outcome
        streamed = "".join(self._streamed)
        rest = out.text[len(streamed) :] if out.text.startswith(streamed) else ""
        fed, tail = self._tools.feed(rest), self._tools.finish()
        delta = self._tool_delta(fed, tail)
        reason = self._tools.finish_reason(out.finish_reason)
        last = R.chat_chunk(self.request_id, self.created, self.model, {}, None, reason)
        if not delta:
            return [last]
        return [R.chat_chunk(self.request_id, self.created, self.model, delta, None, None), last]

    def _finish_chunk(self) -> dict[str, Any]:
        """The finish without tool calls: the finished text beyond what was streamed, and
        ``finish_reason``."""
        out = self.outcome
        streamed = "".join(self._streamed)
        rest = out.text[len(streamed) :] if out.text.startswith(streamed) else ""
        if self.chat:
            delta = {"content": rest} if rest else {}
            return R.chat_chunk(self.request_id, self.created, self.model, delta, None, out.finish_reason)
        return R.completion_chunk(self.request_id, self.created, self.model, rest, None, out.finish_reason)

    def _tool_delta(self, *steps: ToolDelta) -> dict[str, Any]:
        """A chat delta of what the tool parser released: ``content`` and/or ``tool_calls``
        (indexed in the order calls were made); ``{}`` when nothing."""
        made = self._tools.calls if self._tools is not None else []
        content = "".join(s.content for s in steps)
        calls = [c for s in steps for c in s.calls]
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            first = len(made) - len(calls)
            delta["tool_calls"] = [{"index": first + i, **c} for i, c in enumerate(calls)]
        return delta

    def _usage_chunk(self) -> dict[str, Any]:
        kind = CHAT_CHUNK if self.chat else COMPLETION_CHUNK
        return R.usage_chunk(self.request_id, self.created, self.model, kind, self.outcome)

    def _logprobs_of(self, tokens: list[TokenOut], offset: int = 0) -> dict[str, Any] | None:
        """The ``logprobs`` of a choice or chunk covering ``tokens`` (``offset``: characters
        before the first of them, completions only); None when not asked for."""
        if self.logprobs is None:
            return None
        if self.chat:
            return R.chat_logprobs(tokens, self._token_text, self.logprobs)
        return R.completion_logprobs(tokens, self._token_text, self.logprobs, offset)


def _noop() -> None:
    pass


BATCH_IN_FLIGHT = 16
"""Most prompts of one completions batch that run at once; the rest start as those finish, so a
batch of `schemas.MAX_PROMPTS` fits a worker's queue (``--slots`` + ``--queue-limit``) instead
of being a retry-later 429 that no retry could cure."""


class CompletionBatch:
    """Several prompts of one ``/v1/completions`` request (``prompt`` as a list), each its own
    `CompletionStream`, at most `BATCH_IN_FLIGHT` running at once, answered as one response:
    choice ``i`` is prompt ``i``, ``usage`` the sum over the prompts (OpenAI's and vLLM's batch).
    Same interface as `CompletionStream` for `RelayResponse`.

    Streaming interleaves the prompts' chunks as they come, each chunk carrying its choice's
    ``index``; the usage chunk (when asked) sums them all. An error before the first token of one
    of the first `BATCH_IN_FLIGHT` prompts fails the whole request (the others are cancelled);
    a later prompt's error, like an error after a first token, becomes an error event.
    Non-streamed, any prompt's error fails the request.

    Args:
        streams: one unstarted `CompletionStream` per prompt, in order (non-chat).
    """

    def __init__(self, streams: list[CompletionStream]) -> None:
        self.streams = streams
        self.request_id = streams[0].request_id
        self._closed = threading.Event()

    def close(self) -> None:
        """Cancel every prompt's worker call (`CompletionStream.close`); prompts not started yet
        never start."""
        self._closed.set()
        for s in self.streams:
            s.close()

    def full_response(self, *, return_token_ids: bool = False) -> dict[str, Any]:
        """Every prompt's `CompletionStream.full_response`, `BATCH_IN_FLIGHT` at a time, as one
        body (``return_token_ids``: each choice carries its ``prompt_token_ids`` and
        ``token_ids``).

        Raises:
            OpenAIError: a prompt failed (the first to fail in prompt order; the rest cancelled).
        """
        workers = min(len(self.streams), BATCH_IN_FLIGHT)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="http-batch") as pool:
            futures = [pool.submit(s.full_response, return_token_ids=return_token_ids) for s in self.streams]
            bodies: list[dict[str, Any]] = []
            try:
                for f in futures:
                    bodies.append(f.result())
            except BaseException:
                for f in futures:
                    f.cancel()
                self.close()
                raise
        choices = []
        for i, b in enumerate(bodies):
            choice = b["choices"][0]
            choice["index"] = i
            choices.append(choice)
        body = {**bodies[0], "choices": choices, "usage": _sum_usage([b["usage"] for b in bodies])}
        body.pop("prompt_token_ids", None)  # one per prompt, on its choice
        return body

    def sse_chunks(self, *, include_usage: bool = False) -> Iterator[str]:
        """The prompts' chunks interleaved (class docstring), then the summed usage chunk when
        asked, then ``[DONE]``. Returns once each of the first `BATCH_IN_FLIGHT` prompts has its
        first token.

        Raises:
            OpenAIError: one of those prompts failed before its first token (every call is
                cancelled).
        """
        events: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()
        n_first = min(len(self.streams), BATCH_IN_FLIGHT)
        slots = threading.Semaphore(0)  # one per finished prompt: a waiting prompt may start
        with ThreadPoolExecutor(max_workers=n_first, thread_name_prefix="http-batch") as pool:
            futures = [pool.submit(_first_item, s) for s in self.streams[:n_first]]
            try:
                firsts = [f.result() for f in futures]
            except BaseException:
                self.close()
                raise
        threads = [
            threading.Thread(
                target=self._pump,
                args=(i, self.streams[i], firsts[i], events, slots),
                name=f"http-batch-{i}",
                daemon=True,
            )
            for i in range(n_first)
        ]
        threads += [
            threading.Thread(
                target=self._pump_later, args=(i, self.streams[i], events, slots), name=f"http-batch-{i}", daemon=True
            )
            for i in range(n_first, len(self.streams))
        ]
        for t in threads:
            t.start()
        return self._merge(events, include_usage)

    def _pump_later(
        self,
        i: int,
        stream: CompletionStream,
        events: queue.Queue[tuple[int, dict[str, Any] | None]],
        slots: threading.Semaphore,
    ) -> None:
        """Prompt ``i`` past the first `BATCH_IN_FLIGHT`: waits for a finished prompt's slot,
        then runs as `_pump`; an error before its first token is its error event."""
        slots.acquire()
        if self._closed.is_set():
            stream.close()
            slots.release()
            events.put((i, None))
            return
        try:
            first = _first_item(stream)
        except BaseException as exc:  # noqa: BLE001 - the merge must end: an error event, logged
            if not isinstance(exc, OpenAIError):
                log.exception("http_batch_prompt_failed", request_id=stream.request_id, error=str(exc))
                exc = OpenAIError(500, "internal server error (logged on the control plane)", type="internal_error")
            events.put((i, exc.body()))
            stream.close()
            slots.release()
            events.put((i, None))
            return
        self._pump(i, stream, first, events, slots)

    @staticmethod
    def _pump(
        i: int,
        stream: CompletionStream,
        first: TokenOut | None,
        events: queue.Queue[tuple[int, dict[str, Any] | None]],
        slots: threading.Semaphore,
    ) -> None:
        """Prompt ``i``'s chunks into ``events`` (its index set), then ``(i, None)``, and its
        slot to a waiting prompt; an error after its first token becomes an error chunk."""
        try:
            for item in itertools.chain([first], stream._items):
                chunk = stream._finish_chunk() if item is None else stream._token_chunk(item)
                if chunk is not None:
                    chunk["choices"][0]["index"] = i
                    events.put((i, stream._with_usage(chunk)))
        except ControlPlaneError as exc:
            error = from_control_plane(exc)
            log.warning("http_stream_failed", request_id=stream.request_id, status=error.status, error=error.message)
            events.put((i, error.body()))
        except BaseException as exc:  # noqa: BLE001 - the merge must end; logged
            log.exception("http_batch_prompt_failed", request_id=stream.request_id, error=str(exc))
        finally:
            stream.close()
            slots.release()
            events.put((i, None))

    def _merge(self, events: queue.Queue[tuple[int, dict[str, Any] | None]], include_usage: bool) -> Iterator[str]:
        left = len(self.streams)
        try:
            while left:
                _, chunk = events.get()
                if chunk is None:
                    left -= 1
                else:
                    yield R.sse(chunk)
            if include_usage:
                usage = self.streams[0]._usage_chunk()
                usage["usage"] = _sum_usage([s.outcome.usage() for s in self.streams])
                yield R.sse(usage)
        finally:
            self.close()
        yield R.SSE_DONE


def _first_item(stream: CompletionStream) -> TokenOut | None:
    """The stream's first item (its first token, or None: finished), read now so that an error
    before it raises here (`OpenAIError`)."""
    try:
        return next(stream._items, None)
    except ControlPlaneError as exc:
        stream.close()
        raise from_control_plane(exc) from None


def _sum_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI ``usage`` objects added up, key by key (nested ``*_details`` too)."""
    total: dict[str, Any] = {}
    for u in usages:
        for key, value in u.items():
            if isinstance(value, dict):
                total[key] = _sum_usage([total.get(key, {}), value])
            else:
                total[key] = total.get(key, 0) + value
    return total


def relay_limiter() -> anyio.CapacityLimiter:
    """The limiter of the threads that read generations (`RELAY_THREADS`), made on first use."""
    global _relay_limiter
    if _relay_limiter is None:
        _relay_limiter = anyio.CapacityLimiter(RELAY_THREADS)
    return _relay_limiter


class ClientGone(Exception):
    """The HTTP client disconnected or stopped reading; the worker call was cancelled."""


class RelayResponse(Response):
    """One `CompletionStream` as an ASGI response: a JSON body (``sse`` False) or server-sent
    events (``sse`` True), produced while the client is watched (module docstring).

    Args:
        stream: the request's `CompletionStream` (not started), or its `CompletionBatch`.
        sse: stream server-sent events rather than one JSON body.
        include_usage: SSE only: add the usage chunk.
        return_token_ids: JSON only: add prompt and choice token ids.
        write_timeout_s: seconds one write may wait on a client that reads nothing.

    Raises (from the ASGI call, before anything is sent, so FastAPI's handlers answer them):
        OpenAIError: the router failed before the first token (or, JSON, at all).
    """

    def __init__(
        self,
        stream: CompletionStream | CompletionBatch,
        *,
        sse: bool,
        include_usage: bool = False,
        return_token_ids: bool = False,
        write_timeout_s: float = 30.0,
    ) -> None:
        self.stream = stream
        self.sse = sse
        self.include_usage = include_usage
        self.return_token_ids = return_token_ids
        self.write_timeout_s = write_timeout_s
        self.status_code = 200
        self.background = None
        self.media_type = "text/event-stream" if sse else "application/json"
        self.init_headers(None)
        self._gone = False
        self._complete = False  # the last message is being sent: a disconnect now is the normal end

    def _client_gone(self, why: str) -> None:
        if not self._gone:
            self._gone = True
            log.info("http_client_gone", request_id=self.stream.request_id, reason=why)
        self.stream.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        failure: Exception | None = None
        delivery = DeliveryProgress.of(scope) if self.sse else None
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        if self._complete:  # uvicorn says so once the response is sent: not gone
                            return
                        self._client_gone("disconnected")
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch)
            if delivery is not None:
                tg.start_soon(self._watch_delivery, delivery, tg.cancel_scope)
            try:
                if self.sse:
                    await self._send_events(send)
                else:
                    await self._send_body(scope, receive, send)
            except ClientGone:
                pass
            except Exception as exc:  # noqa: BLE001 - re-raised below, outside the task group
                failure = exc
            finally:
                self.stream.close()
                tg.cancel_scope.cancel()
        if failure is not None:
            raise failure

    async def _watch_delivery(self, progress: DeliveryProgress, cancel_scope: anyio.CancelScope) -> None:
        """Cut a client that acknowledges nothing for ``write_timeout_s`` while it owes bytes,
        though every write completed (the kernel buffers took them; `delivery`): its call is
        cancelled and the connection reset (`DeliveryProgress.reset`)."""
        interval = min(1.0, self.write_timeout_s / 4)
        while True:
            await anyio.sleep(interval)
            if progress.stalled_for() >= self.write_timeout_s:
                self._client_gone(
                    f"nothing acknowledged for {self.write_timeout_s:g} s with bytes owed (the client stopped reading)"
                )
                progress.reset()
                cancel_scope.cancel()
                return

    async def _read(self, fn, *args):
        """``fn(*args)`` on a relay thread; `ClientGone` if the client left meanwhile."""
        result = await anyio.to_thread.run_sync(fn, *args, limiter=relay_limiter())
        if self._gone:
            raise ClientGone
        return result

    async def _write(self, send: Send, message: dict) -> None:
        """One ASGI send, bounded by ``write_timeout_s``; `ClientGone` past it."""
        if self._gone:
            raise ClientGone
        try:
            with anyio.fail_after(self.write_timeout_s):
                await send(message)
        except TimeoutError:
            self._client_gone(f"no write completed for {self.write_timeout_s:g} s (the client stopped reading)")
            raise ClientGone from None
        except OSError:
            self._client_gone("write failed")
            raise ClientGone from None

    async def _send_body(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._read(lambda: self.stream.full_response(return_token_ids=self.return_token_ids))
        response = JSONResponse(body)
        await self._write(
            send, {"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers}
        )
        self._complete = True
        await self._write(send, {"type": "http.response.body", "body": response.body, "more_body": False})

    async def _send_events(self, send: Send) -> None:
        chunks = await self._read(lambda: self.stream.sse_chunks(include_usage=self.include_usage))
        await self._write(send, {"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        while True:
            chunk = await self._read(next, chunks, None)
            if chunk is None:
                break
            await self._write(send, {"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        self._complete = True
        await self._write(send, {"type": "http.response.body", "body": b"", "more_body": False})
