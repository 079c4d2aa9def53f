"""Requests and slots (llama-server ``server_slot`` / ``server_task``).

A ``GenRequest`` is admitted with a fully resolved adapter vector, turned into an
``AdapterSet``; aLoRA activation is decided once, at admission (``resolve_alora``). A
``Slot`` owns one KV sequence (seq_id = slot id) and remembers which adapter set computed
each cached position, so KV computed under one set never serves another.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from worker.errors import InvalidRequestError, WorkerError
from worker.lora.plan import EMPTY_SET, AdapterSet
from worker.runtime.sampling import Sampler, SamplingParams


# --- events the scheduler emits (converted to protos by the servicer) ---------------------
@dataclass(frozen=True)
class StepInfo:
    """What the ubatch that produced a token looked like (per-step telemetry)."""

    batch_size: int
    batch_tokens: int
    n_adapter_sets: int
    graph_reused: bool
    n_nodes: int
    node_budget: int
    batching: str


@dataclass(frozen=True)
class StartedEvent:
    prompt_tokens: list[int]
    prompt_logprobs: list[tuple[int, float] | None] | None


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str
    logprob: float
    top: tuple[tuple[int, float], ...]
    step: StepInfo


@dataclass(frozen=True)
class FinishedEvent:
    finish_reason: str
    text: str
    telemetry: dict


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed; ``error`` names the outcome (its class maps to a gRPC status)."""

    error: WorkerError


Event = StartedEvent | TokenEvent | FinishedEvent | ErrorEvent


@dataclass(frozen=True)
class AloraActivation:
    """Result of the aLoRA rule for one request.

    ``start`` = index of the first token computed with the adapter (-1: no aLoRA active);
    ``pre_set`` = the set used for tokens before ``start`` (the full set without the aLoRA).
    """

    adapter_set: AdapterSet
    pre_set: AdapterSet
    start: int


def find_last(tokens: list[int], needle: tuple[int, ...]) -> int:
    """Index of the last occurrence of ``needle`` in ``tokens`` (reverse scan), or -1."""
    n = len(needle)
    for s in range(len(tokens) - n, -1, -1):
        if tuple(tokens[s:s + n]) == needle:
            return s
    return -1


def resolve_alora(adapter_set: AdapterSet, prompt: list[int]) -> AloraActivation:
    """Apply the aLoRA rule (SPEC §4; PEFT's activation point, which the adapters are trained on).

    For each enabled aLoRA, reverse-scan the prompt for its invocation sequence. Not found →
    that adapter is dropped (scale 0) for this request. Found at ``s`` → tokens ``0..s-1`` are
    computed without it and ``s..`` with it (llama-server starts at ``s-1``).

    Raises:
        InvalidRequestError: more than one enabled aLoRA in the request.
    """
    aloras = [(i, a) for i, a, _ in adapter_set.entries if a.alora_invocation_tokens]
    if not aloras:
        return AloraActivation(adapter_set, adapter_set, -1)
    if len(aloras) > 1:
        names = ", ".join(f"{i} ('{a.name}')" for i, a in aloras)
        raise InvalidRequestError(f"more than one activated LoRA (aLoRA) enabled in one request: adapters {names}; "
                           "enable at most one")
    aid, adapter = aloras[0]
    s = find_last(prompt, tuple(adapter.alora_invocation_tokens))
    without = adapter_set.without([aid])
    if s < 0:
        return AloraActivation(without, without, -1)
    return AloraActivation(adapter_set, without, s)


@dataclass
class GenRequest:
    """One admitted generation request and its running state.

    ``emit`` receives the request's events in order; ``cancelled`` is set by the servicer.
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams
    activation: AloraActivation
    emit: Callable[[Event], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    admitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    generated: list[int] = field(default_factory=list)
    text_sent: int = 0
    prompt_logprobs: list[tuple[int, float] | None] = field(default_factory=list)
    telemetry: dict = field(default_factory=dict)
    held_ids: tuple[int, ...] = ()  # adapter ids this request pins (unload waits for them)

    @property
    def adapter_set(self) -> AdapterSet:
        return self.activation.adapter_set

    def set_at(self, pos: int) -> AdapterSet:
        """The adapter set that computes position ``pos`` of this request."""
        a = self.activation
        return a.pre_set if 0 <= pos < a.start else a.adapter_set

    @property
    def adapter_ids(self) -> tuple[int, ...]:
        return self.activation.adapter_set.ids


class SlotState(Enum):
    IDLE = "idle"
    PROMPT = "prompt"          # prompt tokens still to compute
    GENERATING = "generating"  # one token per step


@dataclass
class Slot:
    """A parallel sequence: owns KV sequence ``id`` and what is cached in it.

    ``cache_tokens[p]`` is the token whose KV sits at position p and ``cache_sets[p]`` the
    adapter set that computed it.
    """

    id: int
    state: SlotState = SlotState.IDLE
    req: GenRequest | None = None
    sampler: Sampler | None = None
    n_past: int = 0
    cache_tokens: list[int] = field(default_factory=list)
    cache_sets: list[AdapterSet] = field(default_factory=list)
    last_step: int = -1
    last_used: float = 0.0
    last_set: AdapterSet | None = None  # llama-server ``slot.lora``: the previous request's set
    task: str = "completion"

    @property
    def busy(self) -> bool:
        return self.req is not None

    def next_set(self) -> AdapterSet:
        """The adapter set of the rows this slot feeds next."""
        assert self.req is not None
        return self.req.set_at(self.n_past)

    def can_batch_with(self, other: "Slot") -> bool:
        """llama-server's compatibility rule: same task type and the same adapter set for
        the rows both feed next (whole adapter vector equal)."""
        return self.task == other.task and self.next_set() == other.next_set()

    def assign(self, req: GenRequest) -> None:
        self.req = req
        self.sampler = Sampler(req.params)
        self.state = SlotState.PROMPT

    def release(self) -> None:
        if self.req is not None:
            self.last_set = self.req.adapter_set
        self.req = None
        self.sampler = None
        self.state = SlotState.IDLE
        self.last_used = time.monotonic()

    def cached_prefix_for(self, req: GenRequest) -> int:
        """Positions of this slot's cache that ``req`` may reuse: same tokens *and* the same
        adapter set at every position (capped so the last prompt token is recomputed)."""
        n = 0
        limit = min(len(self.cache_tokens), len(req.prompt) - 1)
        while n < limit and self.cache_tokens[n] == req.prompt[n] and self.cache_sets[n] == req.set_at(n):
            n += 1
        return n


def lora_should_clear_cache(current: AdapterSet, nxt: AdapterSet) -> bool:
    """llama-server's rule when a slot's adapter set changes: keep the cache only when the
    current set is empty or all-aLoRA **and** the next set is all-aLoRA (an empty set is not
    all-aLoRA). Source: tools/server ``lora_should_clear_cache``."""
    if current == nxt:
        return False
    keep = (current.is_empty() or current.all_alora()) and nxt.all_alora()
    return not keep


__all__ = ["EMPTY_SET", "GenRequest", "Slot", "SlotState", "resolve_alora",
           "lora_should_clear_cache", "StepInfo", "StartedEvent", "TokenEvent", "FinishedEvent",
           "ErrorEvent", "Event", "AloraActivation", "find_last"]
