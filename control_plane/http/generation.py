"""One OpenAI request as the router sees it: the GenerateRequest, the call context, the events.

`build_request` makes the ``GenerateRequest``; `completions.respond` passes it to
``Router.generate`` — the same function the gRPC ``Generate`` calls — with an
`HttpCallContext` standing in for the gRPC servicer context (its ``cancel`` cancels the
worker call when the HTTP client goes away); `fold` records the events into an `Outcome`
for `streaming.CompletionStream`. Nothing here talks gRPC to the control plane.

Token accounting: ``usage.prompt_tokens`` is the worker's prompt length,
``completion_tokens`` the tokens generated, ``prompt_tokens_details.cached_tokens`` the
telemetry's ``cached_prompt_tokens`` (prompt KV taken from the prefix cache).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from loraplane.v1 import common_pb2


class HttpCallContext:
    """The three calls ``Router`` makes on a gRPC servicer context, for an HTTP request."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], Any]] = []
        self._active = True
        self._lock = threading.Lock()

    def add_callback(self, callback: Callable[[], Any]) -> bool:
        """Run ``callback`` at `cancel`; False (and never run) when already cancelled."""
        with self._lock:
            if self._active:
                self._callbacks.append(callback)
                return True
        return False

    def is_active(self) -> bool:
        """True until `cancel`."""
        return self._active

    def time_remaining(self) -> float | None:
        """None: an HTTP request has no deadline."""
        return None

    def cancel(self) -> None:
        """The HTTP client went away (or the response is done): cancel what is still running."""
        with self._lock:
            self._active = False
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb()


@dataclass
class TokenOut:
    """One generated token: id, detokenized piece (may be empty), log-prob (natural log) and
    its most likely alternatives as ``(token id, log-prob)``."""

    token_id: int
    text: str
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Outcome:
    """Everything a finished request produced."""

    prompt_token_ids: list[int] = field(default_factory=list)
    tokens: list[TokenOut] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    cached_tokens: int = 0
    # per prompt token, ``(token id, log-prob, rank or None)`` given its prefix (None for the
    # first token); None unless the request asked for prompt log-probs
    prompt_logprobs: list[tuple[int, float, int | None] | None] | None = None
    # per prompt token, its position's most likely ``(token id, log-prob)`` (None for the first
    # token); None unless the request asked for prompt alternatives (``prompt_logprobs_top``)
    prompt_top: list[list[tuple[int, float]] | None] | None = None

    def usage(self) -> dict[str, Any]:
        """OpenAI's ``usage`` object (token counts; see the module docstring)."""
        n_prompt, n_out = len(self.prompt_token_ids), len(self.tokens)
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def new_request_id(prefix: str) -> str:
    """A fresh response id, ``<prefix>-<32 hex digits>`` (``cmpl``, ``chatcmpl``)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def build_request(
    *,
    request_id: str,
    text: str | None,
    tokens: list[int] | None,
    adapters: dict[int, float] | None,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    logprobs: int,
    stop: list[str],
    ignore_eos: bool,
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    prompt_logprobs: bool = False,
    prompt_logprobs_top: int = 0,
    response_format: common_pb2.ResponseFormat | None = None,
) -> common_pb2.GenerateRequest:
    """The GenerateRequest: ``text`` is tokenized by the worker (BOS as the model says),
    ``tokens`` are taken verbatim; ``adapters`` None means the default set. The sampling
    fields map one to one onto ``SamplingParams`` (``repetition_penalty`` 1 = off);
    ``response_format``: structured output (`control_plane.http.structured`)."""
    req = common_pb2.GenerateRequest(request_id=request_id)
    if tokens is not None:
        req.tokens.ids.extend(tokens)
    else:
        req.text = text or ""
    if adapters is not None:
        req.adapters.SetInParent()
        req.adapters.entries.extend(common_pb2.AdapterScale(id=i, scale=s) for i, s in sorted(adapters.items()))
    s = req.sampling
    s.max_tokens, s.temperature, s.top_p, s.top_k = max_tokens, temperature, top_p, top_k
    if seed is not None:
        s.seed = seed
    s.logprobs = logprobs
    s.ignore_eos = ignore_eos
    s.stop.extend(stop)
    s.min_p, s.presence_penalty, s.frequency_penalty = min_p, presence_penalty, frequency_penalty
    s.repetition_penalty = repetition_penalty
    s.prompt_logprobs = prompt_logprobs
    s.prompt_logprobs_top = prompt_logprobs_top if prompt_logprobs else 0
    if response_format is not None:
        s.response_format.CopyFrom(response_format)
    return req


def fold(events: Iterator[common_pb2.GenerateEvent], out: Outcome) -> Iterator[TokenOut | None]:
    """Record every event into ``out``; yield each token (and None for the finish)."""
    for ev in events:
        kind = ev.WhichOneof("event")
        if kind == "started":
            out.prompt_token_ids = list(ev.started.prompt_token_ids)
            if len(ev.started.prompt_logprobs):
                out.prompt_logprobs = [
                    (e.token_id, e.logprob, e.rank or None) if e.has_logprob else None
                    for e in ev.started.prompt_logprobs
                ]
                if any(len(e.top) for e in ev.started.prompt_logprobs):
                    out.prompt_top = [
                        [(x.token_id, x.logprob) for x in e.top] if e.has_logprob else None
                        for e in ev.started.prompt_logprobs
                    ]
        elif kind == "token":
            t = ev.token
            tok = TokenOut(t.token_id, t.text, t.logprob, [(x.token_id, x.logprob) for x in t.top])
            out.tokens.append(tok)
            yield tok
        elif kind == "finished":
            out.text = ev.finished.text
            out.finish_reason = ev.finished.finish_reason
            out.cached_tokens = ev.finished.telemetry.cached_prompt_tokens
            yield None


def now_s() -> int:
    """The current time in whole Unix seconds (OpenAI's ``created``)."""
    return int(time.time())
