"""Admission: a request validated and built, queued, and attached to a free KV sequence.

``Admission`` owns the waiting side of the scheduler: the queue (FIFO, or the Virtual Token
Counter's order with ``--fairness vtc``), the capacity rule (``--slots`` + ``--queue-limit``,
with queue shares under fair admission) and the choice of what to attach next (resident-first
within ``ADMIT_LOOKAHEAD``, the head passed over at most ``MAX_BYPASS`` times, every adapter
acquired in the slot pool first). The rules and why: docs/architecture.md ("Paging rules",
"The serving loop") and docs/fairness.md.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence

import structlog

from loraplane.formats.adapter_file import AdapterError
from loraplane.grammar_limits import GrammarError
from worker.config import WorkerConfig
from worker.errors import AdapterFetchError, DecodeFailedError, InvalidRequestError, QueueFullError
from worker.lora.adapter_set import AdapterSet
from worker.lora.alora import resolve_alora
from worker.lora.pool import LoraPool, PoolExhaustedError
from worker.runtime.context_base import AdapterContext
from worker.runtime.grammar import Constraint
from worker.runtime.sampling import SamplingParams
from worker.serving.cache_policy import CachePolicy
from worker.serving.fairness import FairQueue
from worker.serving.output import IncrementalDetokenizer, StopMatcher
from worker.serving.request import ANONYMOUS, ErrorEvent, Event, GenRequest, RequestTenant
from worker.serving.sequences import Seq

log = structlog.get_logger("loraplane.worker.serving.admission")

ADMIT_LOOKAHEAD = 8  # queued requests considered for resident-first admission
MAX_BYPASS = 4  # times the queue head may be passed over before strict FIFO

EndRequest = Callable[[GenRequest, str, Event | object | None, Seq | None], None]
"""``StepRunner.end``: the one exit of a request (request, outcome, event, its sequence or None)."""


def admission_order(queue: Sequence[GenRequest], pool: LoraPool) -> list[GenRequest]:
    """The queued requests admission tries, in order: the head alone once it was passed over
    ``MAX_BYPASS`` times; else, among the first ``ADMIT_LOOKAHEAD``, those whose adapters are all
    resident in ``pool`` first, then the rest, in ``queue``'s order within each. ``queue``: the
    base order, the FIFO queue itself or, with fair admission, ``FairQueue.order``'s list (its
    first element is the head either way)."""
    head = queue[0]
    window = [head] if head.bypassed >= MAX_BYPASS else list(queue)[:ADMIT_LOOKAHEAD]
    resident = [r for r in window if all(pool.slot_of(a.sha256) is not None for _, a, _ in r.adapter_set.entries)]
    ids = {id(r) for r in resident}  # identity: requests are dataclasses with value equality
    return resident + [r for r in window if id(r) not in ids]


class Admission:
    """The queue of waiting requests and the rule that attaches them (loop thread, except
    ``build_request``; ``enqueue`` runs under the scheduler's lock).

    Args:
        ctx: the worker context (its slot pool, KV store and model).
        config: sequence count, queue limit, fairness, context length, grammar limits.
        worker_id: named in error messages.
        seqs: the scheduler's KV sequences.
        cache_policy: picks a free sequence for a request and what KV it reuses.
        fair: the Virtual Token Counter's queue (``--fairness vtc``); None: first come, first served.
        end: the one exit of a request (``StepRunner.end``), for requests admission fails.
    """

    def __init__(
        self,
        ctx: AdapterContext,
        config: WorkerConfig,
        worker_id: str,
        seqs: list[Seq],
        cache_policy: CachePolicy,
        fair: FairQueue | None,
        end: EndRequest,
    ):
        self.ctx = ctx
        self.config = config
        self.worker_id = worker_id
        self.seqs = seqs
        self.cache_policy = cache_policy
        self._end = end
        self.queue: deque[GenRequest] = deque()
        self.evicted: list[GenRequest] = []  # queued requests that gave way, ended at the next turn
        self.fair = fair

    def build_request(
        self,
        *,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        adapter_set: AdapterSet,
        emit: Callable[[Event], None],
        host_sources: dict[int, tuple[str, float]] | None,
        staged: dict | None,
        tenant: RequestTenant | None,
    ) -> GenRequest:
        """Validate a request and build it (the caller's thread): the aLoRA rule applied, a
        response format compiled, stop strings set up. Arguments: ``Scheduler.submit``.

        Raises:
            InvalidRequestError: empty/too long prompt, token out of range, more adapters than
                ``--max-loras``, bad sampling field, a response format that does not compile.
        """
        n_vocab = self.ctx.model.n_vocab
        tokenizer = self.ctx.model.tokenizer
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        bad = [t for t in prompt if not 0 <= t < n_vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} out of range [0, {n_vocab})")
        if len(prompt) >= self.config.n_ctx_seq:
            raise InvalidRequestError(f"prompt has {len(prompt)} tokens; a KV sequence holds {self.config.n_ctx_seq}")
        try:
            params.validate()
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        n_adapters = len(adapter_set.entries)
        if n_adapters > self.ctx.pool.max_loras:
            raise InvalidRequestError(
                f"request uses {n_adapters} adapters but worker {self.worker_id} has {self.ctx.pool.max_loras} "
                f"adapter slots (--max-loras {self.ctx.pool.max_loras})"
            )
        constraint = None
        if params.response_format is not None:
            try:  # compiled here, on the caller's thread: the loop only steps matchers
                constraint = Constraint.build(params.response_format, tokenizer, n_vocab, self.config.grammar_limits)
            except GrammarError as exc:
                raise InvalidRequestError(f"response_format: {exc}") from exc
        activation = resolve_alora(adapter_set, prompt)
        req = GenRequest(
            request_id or uuid.uuid4().hex, list(prompt), params, activation, emit, IncrementalDetokenizer(tokenizer)
        )
        if params.stop:
            req.stop = StopMatcher(params.stop)
        req.constraint = constraint
        req.host_sources = dict(host_sources or {})
        req.staged = dict(staged or {})
        req.tenant = tenant or ANONYMOUS
        return req

    def enqueue(self, req: GenRequest) -> None:
        """Queue ``req`` (the scheduler's lock held).

        Capacity is sequences + queue limit: a queued request that a free sequence takes at the
        next loop turn is not "waiting", so a burst admits exactly that many even while the
        loop is mid-step with idle sequences. A cancelled request (its client went away) takes
        no place: the loop drops it at its next turn, possibly a long step from now.

        Raises:
            QueueFullError: the worker is full and nothing gives way (``_make_room``).
        """
        busy = sum(s.req is not None and not s.req.cancelled.is_set() for s in self.seqs)
        queued = sum(not r.cancelled.is_set() for r in self.queue)
        if busy + queued >= len(self.seqs) + self.config.queue_limit:
            self._make_room(req.tenant, busy, queued)
        self.queue.append(req)
        if self.fair is not None:
            self.fair.enqueue(req)

    def _make_room(self, tenant: RequestTenant, busy: int, queued: int) -> None:
        """The worker is full: evict the queued request that gives its place to a request of
        ``tenant`` (fair admission's queue shares, ``FairQueue.give_way``; ended with
        ``QueueFullError`` at the loop's next turn), or refuse.

        Raises:
            QueueFullError: nothing gives way (or ``--fairness off``: first come, first served).
        """
        capacity = f"--slots + --queue-limit {self.config.queue_limit}"
        fair = self.fair
        victim = fair.give_way(tenant) if fair is not None else None
        if fair is None or victim is None:
            raise QueueFullError(
                f"worker {self.worker_id}: queue full ({busy}/{len(self.seqs)} KV sequences busy, {queued} "
                f"queued; admits {capacity})"
            )
        held = sum(1 for r in self.queue if r.tenant.name == victim.tenant.name)
        self.queue.remove(victim)
        fair.ended(victim)
        self.evicted.append(victim)
        log.info("queued_request_evicted", request_id=victim.request_id, tenant=victim.tenant.name, to=tenant.name)
        victim.evicted = QueueFullError(
            f"worker {self.worker_id}: queue full: this queued request gave its place to a lighter tenant's "
            f"(tenant '{victim.tenant.name}' had {held} of the {len(self.queue) + 1} queued; admits {capacity}, "
            "shared between tenants by --fairness vtc); retry later"
        )

    def drop_evicted(self) -> None:
        """End the queued requests that gave their place (``_make_room``) with their error."""
        evicted, self.evicted = self.evicted, []
        for req in evicted:
            self._end(req, "error", ErrorEvent(req.evicted or QueueFullError("evicted")), None)

    def drop_cancelled(self) -> None:
        """End the queued requests whose client went away."""
        for req in [r for r in self.queue if r.cancelled.is_set()]:
            self.queue.remove(req)
            self._end(req, "cancelled", None, None)

    def take_all(self) -> list[GenRequest]:
        """Empty the queue and the evicted list (the loop stopped for good); what they held."""
        waiting = list(self.queue) + self.evicted
        self.queue.clear()
        self.evicted = []
        return waiting

    def admit(self) -> None:
        """Attach queued requests to free sequences (resident-first within bounded waiting);
        the cache policy picks the sequence and the KV it keeps. A fault while attaching fails
        that request only."""
        while self.queue:
            free = [s for s in self.seqs if not s.busy]
            if not free:
                return
            req = self._next_admissible()
            if req is None:
                return
            del self.queue[next(i for i, r in enumerate(self.queue) if r is req)]
            if self.fair is not None:
                self.fair.admitted(req)  # its prompt charged to its tenant
            seq = self.cache_policy.pick_seq(free, req)
            try:
                n = self.cache_policy.attach(seq, req, self.ctx.kv)
            except Exception as exc:  # a cache fault fails this request, never the loop
                log.error("attach_failed", request_id=req.request_id, seq=seq.id, error=repr(exc))
                error = DecodeFailedError(f"attaching the request to KV sequence {seq.id} failed: {exc!r}")
                self._end(req, "error", ErrorEvent(error), seq)
                continue
            seq.cache_tokens = req.prompt[:n]
            seq.cache_sets = [req.set_at(p) for p in range(n)]
            seq.n_past = n
            req.telemetry.cached_prompt_tokens = n
            seq.assign(req)

    def _next_admissible(self) -> GenRequest | None:
        """The queued request to attach next, its adapters acquired in the pool; None when
        none can get its adapters resident now (it waits). Order: ``admission_order`` over the
        base order (the FIFO queue, or the fair order with fair admission). A request whose
        adapter cannot be paged in (its file cannot be re-read) ends with an error."""
        pool = self.ctx.pool
        base: Sequence[GenRequest] = self.queue if self.fair is None else self.fair.order(ADMIT_LOOKAHEAD)
        if not base:
            return None
        head = base[0]
        for req in admission_order(base, pool):
            adapters = [a for _, a, _ in req.adapter_set.entries]
            t0 = time.monotonic()
            was = {a.sha256: pool.slot_of(a.sha256) is not None for a in adapters}
            try:
                pool.acquire(adapters, req.staged)
            except PoolExhaustedError:
                continue
            except AdapterError as exc:
                self.queue.remove(req)
                self._end(req, "error", ErrorEvent(AdapterFetchError(f"paging the adapter in failed: {exc}")), None)
                return self._next_admissible() if self.queue else None
            req.staged = {}
            req.pool_held = adapters
            req.note_residency(
                was, slot_wait_ms=(t0 - req.admitted_at) * 1000, page_in_ms=(time.monotonic() - t0) * 1000
            )
            if req is not head:
                head.bypassed += 1
            return req
        return None


__all__ = ["ADMIT_LOOKAHEAD", "MAX_BYPASS", "Admission", "admission_order"]
