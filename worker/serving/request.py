"""A generation request, the events it emits, and its typed telemetry (llama-server
``server_task`` / ``server_task_result``).

A ``GenRequest`` is admitted with its resolved ``AdapterScales`` (from the control plane)
turned into an ``AdapterSet``; the aLoRA activation is decided once, at admission
(``worker.lora.alora.resolve_alora``). The scheduler emits ``StartedEvent`` once the prompt is
computed, one ``TokenEvent`` per sampled token, then ``FinishedEvent`` or ``ErrorEvent``; the
gRPC edge converts them to protos in one place (``worker.rpc.servicer.event_to_proto``).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loraplane.adapter_scales import NO_ADAPTERS, AdapterScales
from worker.errors import WorkerError
from worker.lora.adapter_set import AdapterSet
from worker.lora.alora import AloraActivation
from worker.runtime.grammar import Constraint
from worker.runtime.sampling import SamplingParams

if TYPE_CHECKING:  # output builds on this module's events
    from worker.serving.output import IncrementalDetokenizer, StopMatcher


@dataclass(frozen=True)
class StepInfo:
    """What the ubatch that produced a token looked like (proto ``StepTelemetry``)."""

    batch_size: int
    batch_tokens: int
    n_adapter_sets: int
    graph_reused: bool
    n_nodes: int
    node_budget: int
    batching: str


@dataclass(frozen=True)
class RequestTenant:
    """Who a request is accounted to, for fair admission (proto ``RequestTenant``, set by the
    control plane; ``worker.serving.fairness``). ``weight``: its share (> 0, finite;
    the wire's 0 reads 1); ``priority``: its class, lower values served first."""

    name: str = "anonymous"
    weight: float = 1.0
    priority: int = 0

    def __post_init__(self) -> None:
        """Raises ValueError for a weight that is not a finite number > 0 (the wire's
        conversion, ``worker.rpc.servicer.tenant_from_proto``, refuses it first)."""
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"tenant {self.name!r}: weight {self.weight} must be a finite number > 0")


ANONYMOUS = RequestTenant()
"""The tenant of a request that names none."""


@dataclass(frozen=True)
class AdapterResidency:
    """Where one adapter of a request came from (proto ``AdapterResidency``).

    ``source``: "resident" (already in a device slot), "host" (paged in from the host cache),
    "loaded" (read from the worker's local file, then paged in), "fetched" (bytes fetched from
    the control plane, then paged in). ``wait_ms``: time the request waited for it (fetch or
    load at submit, plus queueing for a slot, plus the page-in copy).
    """

    id: int
    source: str
    wait_ms: float


@dataclass
class RequestTelemetry:
    """Per-request summary (proto ``RequestTelemetry``, field for field; times in ms).

    The proto mapping lives in ``worker.rpc.servicer.telemetry_to_proto``; a test checks that
    every field here exists in the proto, so a misspelling cannot vanish silently.
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    cache_cleared: bool = False
    cache_clear_reason: str = ""
    prefix_cache: str = ""
    alora_activation_pos: int = -1
    adapter_set_fingerprint: str = ""
    slot_id: int = 0  # the KV sequence it ran on (``Seq.id``; the proto's name)
    worker_id: str = ""
    graph_reuses: int = 0
    graph_rebuilds: int = 0
    max_batch_size: int = 0
    max_adapter_sets_in_batch: int = 0
    adapters: AdapterScales = NO_ADAPTERS
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    adapter_residency: list[AdapterResidency] = field(default_factory=list)

    def count_step(self, step: StepInfo) -> None:
        """Fold one decode step this request took part in into the summary."""
        if step.graph_reused:
            self.graph_reuses += 1
        else:
            self.graph_rebuilds += 1
        self.max_batch_size = max(self.max_batch_size, step.batch_size)
        self.max_adapter_sets_in_batch = max(self.max_adapter_sets_in_batch, step.n_adapter_sets)


@dataclass(frozen=True)
class StartedEvent:
    """The prompt is computed. ``prompt_logprobs[i]`` = (token id, log-prob, rank) of prompt
    token ``i`` given its prefix (None for token 0); the list is None unless asked for."""

    prompt_tokens: list[int]
    prompt_logprobs: list[tuple[int, float, int] | None] | None
    prompt_top: list[tuple[tuple[int, float], ...] | None] | None = None
    """Per prompt token, the ``prompt_logprobs_top`` most likely ``(token id, log-prob)`` at its
    position (None for token 0); None unless asked for."""


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token: its id, the new text it completes, its log-prob and top-N."""

    token_id: int
    text: str
    logprob: float
    top: tuple[tuple[int, float], ...]
    step: StepInfo


@dataclass(frozen=True)
class FinishedEvent:
    """The request ended: ``finish_reason`` "stop" (end of generation) or "length"."""

    finish_reason: str
    text: str
    telemetry: RequestTelemetry


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed; ``error`` names the outcome (its class maps to a gRPC status)."""

    error: WorkerError


Event = StartedEvent | TokenEvent | FinishedEvent | ErrorEvent


@dataclass
class GenRequest:
    """One admitted generation request and its running state.

    ``emit`` receives the request's events in order (from the output thread,
    ``worker.serving.output.EmitWorker``); ``cancelled`` is set by the gRPC edge. ``generated``
    is appended by the scheduler thread as tokens are sampled; ``detok``, ``stop``,
    ``text_out`` and the token times belong to the output thread (``detok`` turns generated
    tokens into text incrementally, never re-decoding the whole output per step).
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams
    activation: AloraActivation
    emit: Callable[[Event], None]
    detok: IncrementalDetokenizer
    cancelled: threading.Event = field(default_factory=threading.Event)
    admitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    generated: list[int] = field(default_factory=list)
    prompt_logprobs: list[tuple[int, float, int] | None] = field(default_factory=list)
    prompt_top: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    telemetry: RequestTelemetry = field(default_factory=RequestTelemetry)
    held_ids: tuple[int, ...] = ()  # adapter ids this request pins (unload waits for them)
    stop: StopMatcher | None = None  # set when params.stop is non-empty
    text_out: list[str] = field(default_factory=list)  # pieces emitted so far (with stop strings)
    # Output thread's state (``worker.serving.output.EmitWorker``): tokens rendered so far, and
    # once a stop string completes, the generated tokens the response keeps (the scheduler
    # finishes the sequence when it sees it set; later tokens are cut).
    n_rendered: int = 0
    n_kept: int | None = None
    output_failed: bool = False  # rendering raised: the request ends with an error
    last_token_at: float | None = None  # monotonic time of the last token (inter-token latency)
    pool_held: list = field(default_factory=list)  # adapters it holds in the slot pool (LoraAdapter)
    bypassed: int = 0  # times passed over at the queue head (bounded waiting)
    # adapter id → (host source "host" | "loaded" | "fetched", ms spent getting it at submit)
    host_sources: dict[int, tuple[str, float]] = field(default_factory=dict)
    # sha256 → pooled pairs read ahead at submit for adapters not resident then (prefetch;
    # ``LoraPool.stage``); dropped at admission
    staged: dict = field(default_factory=dict)
    # structured output: the grammar the output must match (``worker.runtime.grammar``), or None
    constraint: Constraint | None = None
    tenant: RequestTenant = ANONYMOUS  # fair admission (``worker.serving.fairness``)
    # with --fairness vtc: its tenant's state (``fairness.TenantState``) while queued or running,
    # and whether it runs; set by ``FairQueue``
    fair_state: Any = None
    fair_running: bool = False
    # why the scheduler evicted it from the queue (its place given to a lighter tenant's
    # request: fair admission's queue shares); None: not evicted
    evicted: WorkerError | None = None

    def note_residency(self, was_resident: dict[str, bool], *, slot_wait_ms: float, page_in_ms: float) -> None:
        """Record, per adapter, where it came from and how long the request waited for it."""
        out = []
        for aid, a, _ in self.adapter_set.entries:
            src, load_ms = self.host_sources.get(aid, ("host", 0.0))
            if was_resident.get(a.sha256):
                src = "resident"
                wait = load_ms + slot_wait_ms
            else:
                wait = load_ms + slot_wait_ms + page_in_ms
            out.append(AdapterResidency(aid, src, wait))
        self.telemetry.adapter_residency = out

    @property
    def adapter_set(self) -> AdapterSet:
        """The request's full adapter set (what computes positions from the aLoRA start)."""
        return self.activation.adapter_set

    def set_at(self, pos: int) -> AdapterSet:
        """The adapter set that computes position ``pos`` of this request."""
        a = self.activation
        return a.pre_set if 0 <= pos < a.start else a.adapter_set

    def token_at(self, pos: int) -> int:
        """Token at position ``pos`` of the sequence (prompt, then generated tokens)."""
        n = len(self.prompt)
        return self.prompt[pos] if pos < n else self.generated[pos - n]

    @property
    def adapter_ids(self) -> tuple[int, ...]:
        """Ids of the adapters the request uses (metrics labels)."""
        return self.activation.adapter_set.ids


__all__ = [
    "ANONYMOUS",
    "AdapterResidency",
    "Event",
    "ErrorEvent",
    "FinishedEvent",
    "GenRequest",
    "RequestTelemetry",
    "RequestTenant",
    "StartedEvent",
    "StepInfo",
    "TokenEvent",
]
