"""Output handling: what a sequence's logits become for the client, after each decode.

``OutputStage`` turns a request's logits rows into events: prompt log-probs while the prompt
is computed, then per generated token two halves (llama-server ``process_token`` /
``populate_token_probs``; vLLM's engine core and output processor with its incremental
detokenizer and stop checker). ``sample`` runs on the scheduler thread: sample, append the
id, decide what ids alone decide (end of generation, ``max_tokens``, context full).
``render`` runs on the output thread (``EmitWorker``): token times, incremental detokenizing,
stop strings, the ``TokenEvent``. Nothing here touches sequences or the KV cache: the
scheduler keeps that bookkeeping and ends the request when a finish reason is known.
"""

from __future__ import annotations

import codecs
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import structlog
import torch

from loraplane.formats.tokenizer import Tokenizer
from worker.errors import DecodeFailedError
from worker.runtime.sampling import RowLogprobs, SampledToken, Sampler
from worker.serving.request import ErrorEvent, FinishedEvent, GenRequest, StartedEvent, StepInfo, TokenEvent

log = structlog.get_logger("loraplane.worker.serving.output")


class IncrementalDetokenizer:
    """Text of a growing token sequence, one token at a time, in O(1) per token.

    Appends each token's bytes (``Tokenizer.token_bytes``) to an incremental UTF-8 decoder, so
    a multi-byte character split over byte tokens is emitted once it is complete. The
    concatenation of every ``push`` plus ``flush`` equals ``Tokenizer.decode`` of all tokens
    (same first-token space rule and BOS handling; tested).
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._n = 0

    def push(self, token_id: int) -> str:
        """Feed one token; returns the text it completes ("" while a character is partial)."""
        tok = self._tok
        first = self._n == 0
        self._n += 1
        if first and tok.add_bos and token_id == tok.bos_id:
            return ""  # decode drops a leading BOS, and then removes no space
        piece = tok.token_bytes(token_id)
        if first and tok.add_space_prefix and piece.startswith(b" "):
            piece = piece[1:]
        return self._dec.decode(piece)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end becomes U+FFFD)."""
        return self._dec.decode(b"", final=True)


class StopMatcher:
    """Stop strings over streamed text (OpenAI / vLLM ``stop``).

    ``push(text)`` takes each newly detokenized piece and returns ``(text safe to emit, hit)``.
    On a hit the emitted text ends just before the earliest stop string and the request
    finishes with "stop" (the stop string itself is never returned, as in vLLM with
    ``include_stop_str_in_output=False``). Without a hit, a tail that could still grow into a
    stop string is held back, so streamed pieces never show text that a later token turns into
    a stop; ``flush()`` releases it when generation ends for another reason. The pieces
    returned, concatenated, are exactly the final text.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._tail = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Feed newly detokenized ``text``; returns ``(text safe to emit, stop string hit)``."""
        buf = self._tail + text
        found = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if found:
            self._tail = ""
            return buf[: min(found)], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._tail = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back tail (generation ended without a stop string)."""
        out, self._tail = self._tail, ""
        return out


def prompt_token_logprobs(logits: torch.Tensor, next_tokens: Sequence[int]) -> list[tuple[int, float, int]]:
    """Log-prob and rank of each next prompt token given its prefix (vLLM ``prompt_logprobs``;
    rank as vLLM's ``Logprob.rank``: 1 + the number of tokens with a larger log-prob).

    Args:
        logits: f32 ``(m, V)`` logits of ``m`` consecutive prompt rows.
        next_tokens: the ``m`` tokens that follow those rows.

    Returns:
        ``[(token id, log-prob, rank)]`` of length ``m``.
    """
    if len(next_tokens) == 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.tensor(list(next_tokens), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, idx.unsqueeze(1))
    ranks = ((lp > chosen).sum(dim=1) + 1).tolist()
    vals = chosen.squeeze(1).tolist()
    return [(int(t), float(v), int(r)) for t, v, r in zip(next_tokens, vals, ranks, strict=False)]


def prompt_top_logprobs(logits: torch.Tensor, n_top: int) -> list[tuple[tuple[int, float], ...]]:
    """The ``n_top`` most likely tokens of each row, most likely first (vLLM ``prompt_logprobs``
    = N: the alternatives beside the prompt token).

    Args:
        logits: f32 ``(m, V)`` logits of ``m`` prompt rows.
        n_top: alternatives per row (≥ 1).

    Returns:
        ``m`` tuples of ``(token id, log-prob)``.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = torch.topk(lp, min(n_top, lp.shape[-1]), dim=-1)
    return [
        tuple((int(t), float(v)) for t, v in zip(ri, rv, strict=True))
        for ri, rv in zip(ids.tolist(), vals.tolist(), strict=True)
    ]


def finish_reason(
    token_id: int,
    *,
    eog_ids: frozenset[int],
    ignore_eos: bool,
    n_generated: int,
    max_tokens: int,
    n_past: int,
    n_ctx: int,
) -> str | None:
    """Why generation stops after ``token_id``, or None to continue.

    "stop": an end-of-generation token (unless ``ignore_eos``); "length": ``max_tokens``
    generated or the sequence's context (``n_ctx`` positions) full — llama-server's
    ``has_budget`` / ``n_ctx`` checks.
    """
    if token_id in eog_ids and not ignore_eos:
        return "stop"
    if n_generated >= max_tokens or n_past + 1 >= n_ctx:
        return "length"
    return None


class OutputStage:
    """Turns one request's logits rows into its events (module docstring).

    Args:
        tokenizer: the model's tokenizer (end-of-generation ids, final text).
        n_ctx_seq: KV positions of a sequence; generation stops ("length") before it is full.
    """

    def __init__(self, tokenizer: Tokenizer, n_ctx_seq: int):
        self.tokenizer = tokenizer
        self.n_ctx_seq = n_ctx_seq

    def prompt_rows(self, req: GenRequest, rows: Sequence[int], logits: torch.Tensor, out_idx: Sequence[int]) -> None:
        """Record the prompt log-probs of computed prompt positions ``rows`` (only when the
        request asked for them; vLLM ``prompt_logprobs``).

        Args:
            req: the request; its ``prompt_logprobs`` grows by one entry per row whose next
                token is a prompt token.
            rows: the positions computed, consecutive.
            logits: f32 ``(n_out, n_vocab)`` of the ubatch's output rows.
            out_idx: per position of ``rows``, its row in ``logits``.
        """
        if not req.params.prompt_logprobs:
            return
        n_prompt = len(req.prompt)
        m = sum(1 for p in rows if p + 1 < n_prompt)
        if m:
            rows_logits = logits[list(out_idx[:m])]
            req.prompt_logprobs += prompt_token_logprobs(rows_logits, [req.prompt[p + 1] for p in rows[:m]])
            if req.params.prompt_logprobs_top:
                req.prompt_top += prompt_top_logprobs(rows_logits, req.params.prompt_logprobs_top)

    def started(self, req: GenRequest) -> StartedEvent:
        """The event of a request whose prompt is computed (prompt log-probs: None for token 0,
        then one per token; the list is None unless asked for)."""
        plp = [None, *req.prompt_logprobs] if req.params.prompt_logprobs else None
        top = [None, *req.prompt_top] if req.params.prompt_logprobs and req.params.prompt_logprobs_top else None
        return StartedEvent(list(req.prompt), plp, top)

    def sample(
        self,
        req: GenRequest,
        sampler: Sampler,
        logits_row: torch.Tensor,
        *,
        n_past: int,
        pre: tuple[RowLogprobs, int] | None = None,
        penalized: torch.Tensor | None = None,
    ) -> tuple[SampledToken, str | None]:
        """The scheduler's half of a generated token: sample it, append its id to
        ``req.generated`` and decide what the ids alone decide (``finish_reason``: end of
        generation, ``max_tokens``, the sequence's context full). No text work.

        Samples from ``logits_row`` (f32 ``(n_vocab,)``; ``pre``: this row's batched
        ``(log-probs, argmax)`` for a greedy sampler, ``greedy_rows``; ``penalized``: the row
        after the request's penalties, which the token is chosen from, ``Sampler.sample``).

        Args:
            n_past: positions in the KV sequence after this step.

        Returns:
            ``(sampled token, reason)``; reason None: generation continues as far as the ids
            tell (a stop string is the text half's business, ``render``).
        """
        if pre is not None:
            sampled = sampler.sample(logits_row, logp=pre[0], argmax=pre[1], penalized=penalized)
        else:
            sampled = sampler.sample(logits_row, penalized=penalized)
        req.generated.append(sampled.token_id)
        reason = finish_reason(
            sampled.token_id,
            eog_ids=self.tokenizer.eog_ids,
            ignore_eos=req.params.ignore_eos,
            n_generated=len(req.generated),
            max_tokens=req.params.max_tokens,
            n_past=n_past,
            n_ctx=self.n_ctx_seq,
        )
        return sampled, reason

    def render(
        self,
        req: GenRequest,
        sampled: SampledToken,
        *,
        step: StepInfo,
        now: float,
        reason: str | None,
        on_token: Callable[[GenRequest, float], None] | None = None,
    ) -> tuple[TokenEvent, str | None]:
        """The text half of a generated token (the output thread's work, ``EmitWorker``):
        record its time and step telemetry, detokenize it incrementally, cut the text at a
        stop string (``StopMatcher``: held-back text is flushed when ``reason`` from ``sample``
        ends generation) and build its event. ``on_token(req, now)`` is called before the
        token's time ``now`` (monotonic s, taken when it was sampled) is recorded
        (``req.last_token_at`` still holds the previous token's).

        A stop string that completes here sets ``req.n_kept`` (the generated tokens the
        response keeps, this one included): the scheduler finishes the sequence at its next
        turn and every later token of the request is dropped (``EmitWorker``).

        Returns:
            ``(TokenEvent, reason)``: ``reason`` from ``sample``, or "stop" on a stop string.
        """
        if req.first_token_at is None:
            req.first_token_at = now
        if on_token is not None:
            on_token(req, now)
        req.last_token_at = now
        req.n_rendered += 1
        req.telemetry.count_step(step)
        piece = req.detok.push(sampled.token_id)
        if req.stop is not None:
            piece, hit = req.stop.push(piece)
            if hit:
                reason = "stop"
                req.n_kept = req.n_rendered
            elif reason is not None:
                piece += req.stop.push(req.detok.flush())[0] + req.stop.flush()
            req.text_out.append(piece)
        return TokenEvent(sampled.token_id, piece, sampled.logprob, sampled.top, step), reason

    def token(
        self,
        req: GenRequest,
        sampler: Sampler,
        logits_row: torch.Tensor,
        *,
        n_past: int,
        step: StepInfo,
        pre: tuple[RowLogprobs, int] | None = None,
        on_token: Callable[[GenRequest, float], None] | None = None,
    ) -> tuple[TokenEvent, str | None]:
        """``sample`` then ``render`` on the calling thread: one token's event and finish
        reason (llama-server ``process_token`` does both in one place; the scheduler splits
        them over two threads).

        Returns:
            ``(TokenEvent, reason)``; reason None: generation continues.
        """
        sampled, reason = self.sample(req, sampler, logits_row, n_past=n_past, pre=pre)
        return self.render(req, sampled, step=step, now=time.monotonic(), reason=reason, on_token=on_token)

    def final_text(self, req: GenRequest) -> str:
        """The whole generated text of a finished request: the pieces emitted (cut at a stop
        string) when it has stop strings, else the tokenizer's decode of every token."""
        return "".join(req.text_out) if req.stop is not None else self.tokenizer.decode(req.generated)


class RequestObserver(Protocol):
    """What the output side reports about requests (``worker.serving.metrics.WorkerMetrics``).

    Called on the output thread (``EmitWorker``): ``on_token`` before each token the response
    keeps is recorded (the request's ``last_token_at`` still holds the previous token's time),
    ``on_finish`` once per request with its outcome ("stop", "length", "cancelled" or "error"),
    after its last token.
    """

    def on_token(self, req: GenRequest, now: float) -> None:
        """A token of ``req`` was sampled at monotonic time ``now`` (seconds)."""

    def on_finish(self, req: GenRequest, outcome: str) -> None:
        """``req`` ended with ``outcome`` (called once per request)."""


TokenRecord = tuple[GenRequest, SampledToken, StepInfo, float, str | None]
"""One sampled token handed to the output thread: request, token, step, sampled at (monotonic
s), the finish reason ``OutputStage.sample`` decided from ids (None: none)."""

FINISH = object()
"""``EmitWorker.put_end``'s event for a request that finished ("stop"/"length"): the worker builds
its ``FinishedEvent`` once every token before it is rendered (the text is final only then)."""

_CLOSE = object()


class EmitWorker:
    """The output thread: detokenizing, stop strings and events, off the decode loop.

    The scheduler thread decides the batch, runs the step and the sampling, appends the ids
    to the requests and hands each step's tokens here in one non-blocking put
    (``put_tokens``); this thread renders them (``OutputStage.render``) and emits the events,
    in order per request (one FIFO queue: started → tokens → end). vLLM splits its engine core
    and output processor the same way; llama-server does both on its one thread.

    Stop rules: a stop string is found here, up to one step after the token that completes
    it was sampled. The stage then sets ``req.n_kept``; tokens the scheduler sampled after it
    are dropped here (never emitted), ``req.generated`` is cut to ``n_kept`` when the request
    ends (so usage counts and metrics see only kept tokens), and the finish reason becomes
    "stop". The scheduler finishes the sequence at its next turn; ``wait_rendered`` lets it
    bound the delay to one step. Stop tokens, end of generation and ``max_tokens`` are decided
    on ids by the scheduler (``OutputStage.sample``), with no delay.

    Args:
        stage: the output stage (tokenizer, context size).
        observer: returns the current observer or None (``Scheduler.observer`` may be set after
            the worker starts).
        threaded: False renders each item on the caller's thread as it is put (the text work
            back on the decode loop: the "before" of ``bench/step_interval.py``).
        after_step: the scheduler's step count when this worker takes over (steps up to it
            count as rendered for ``wait_rendered``).
    """

    def __init__(
        self,
        stage: OutputStage,
        observer: Callable[[], RequestObserver | None],
        *,
        threaded: bool = True,
        after_step: int = -1,
    ):
        self.stage = stage
        self._observer = observer
        self.threaded = threaded
        self.dropped = 0  # tokens sampled past a stop string, cut from their responses
        self.render_s = 0.0  # seconds spent rendering and emitting steps' tokens (``put_tokens`` items)
        self.rendered_steps = 0
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._rendered_step = after_step  # last step whose tokens were rendered
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="loraplane-output", daemon=True)
            self._thread.start()

    # --- scheduler side (cheap, non-blocking) ----------------------------------------------
    def put_started(self, req: GenRequest) -> None:
        """``req``'s prompt is computed (its ``prompt_logprobs`` are complete)."""
        self._put(("started", req))

    def put_tokens(self, step_no: int, records: list[TokenRecord]) -> None:
        """The tokens sampled at step ``step_no``: ``(request, token, step, sampled at
        (monotonic s), reason from OutputStage.sample)`` each, in batch order."""
        self._put(("tokens", step_no, records))

    def put_end(self, req: GenRequest, outcome: str, event: object, at: float) -> None:
        """``req`` ended with ``outcome`` at monotonic time ``at``; ``event``: an ``Event`` to
        emit, ``FINISH`` (build its ``FinishedEvent`` here) or None (nothing: the client left).
        The scheduler no longer touches ``req`` after this."""
        self._put(("end", req, outcome, event, at))

    def wait_rendered(self, step_no: int, timeout: float = 10.0) -> bool:
        """Block until the tokens of step ``step_no`` (and all before) are rendered; False on
        timeout (the caller goes on: a stop is then found later, never leaked)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._rendered_step >= step_no, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Render what is queued, then stop the thread."""
        if self._thread is not None and self._thread.is_alive():
            self._q.put(_CLOSE)
            self._thread.join(timeout)

    # --- output side -----------------------------------------------------------------------
    def _put(self, item: tuple) -> None:
        if self.threaded:
            self._q.put(item)
        else:
            self._handle(item)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _CLOSE:
                return
            self._handle(item)

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "tokens":
            t0 = time.perf_counter()
            _, step_no, records = item
            observer = self._observer()
            on_token = observer.on_token if observer is not None else None
            for req, sampled, step, now, reason in records:
                self._guarded(req, self._token, req, sampled, step, now, reason, on_token)
            self.render_s += time.perf_counter() - t0
            self.rendered_steps += 1
            with self._cv:
                self._rendered_step = step_no
                self._cv.notify_all()
        elif kind == "started":
            req = item[1]
            self._guarded(req, lambda: req.emit(self.stage.started(req)))
        else:
            _, req, outcome, event, at = item
            self._guarded(req, self._end, req, outcome, event, at)

    def _guarded(self, req: GenRequest, fn: Callable, *args) -> None:
        """Run ``fn``; an exception fails this request (error event, cancelled so the scheduler
        frees its sequence), never the thread."""
        try:
            fn(*args)
        except Exception as exc:
            log.error("output_failed", request_id=req.request_id, error=repr(exc))
            if not req.output_failed:
                req.output_failed = True
                req.cancelled.set()
                req.emit(ErrorEvent(DecodeFailedError(f"output handling failed: {exc!r}")))

    def _token(self, req, sampled, step, now, reason, on_token) -> None:
        if req.n_kept is not None or req.output_failed:
            return  # past a stop string: cut (counted in ``_end``)
        ev, _ = self.stage.render(req, sampled, step=step, now=now, reason=reason, on_token=on_token)
        req.emit(ev)

    def _end(self, req: GenRequest, outcome: str, event: object, at: float) -> None:
        if req.n_kept is not None:
            self.dropped += len(req.generated) - req.n_kept
            del req.generated[req.n_kept :]
            if outcome == "length":
                outcome = "stop"
        if req.output_failed:
            outcome, event = "error", None
        if event is FINISH:
            t = req.telemetry
            t.ttft_ms = ((req.first_token_at or at) - req.admitted_at) * 1000
            t.total_ms = (at - req.admitted_at) * 1000
            event = FinishedEvent(outcome, self.stage.final_text(req), t)
        if isinstance(event, StartedEvent | TokenEvent | FinishedEvent | ErrorEvent):
            req.emit(event)
        observer = self._observer()
        if observer is not None:
            observer.on_finish(req, outcome)


__all__ = [
    "FINISH",
    "EmitWorker",
    "IncrementalDetokenizer",
    "OutputStage",
    "RequestObserver",
    "StopMatcher",
    "TokenRecord",
    "finish_reason",
    "prompt_token_logprobs",
    "prompt_top_logprobs",
]
