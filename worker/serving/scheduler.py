"""Continuous-batching scheduler loop (llama-server ``server_context::update_slots``).

One thread runs the loop: drop cancelled requests, run deferred adapter frees, attach queued
requests to free KV sequences (the cache policy picks the sequence and decides what KV survives),
assemble a ubatch (``worker.serving.ubatch``), set the context's adapter
sets once, decode, sample, append the ids to the requests, and hand the step's tokens to the
output thread in one non-blocking put (``worker.serving.output.EmitWorker``), which
detokenizes, matches stop strings and emits the events. The loop's critical path is the step.

Stops: end of generation, ``max_tokens`` and a full context are decided on ids here, and the
sequence is freed in the same step. A stop string is found by the output thread up to one
step late: it sets the request's ``n_kept``, the loop finishes the sequence at its next turn
(``_drop_stopped``, the KV trimmed back to what an immediate stop would have left) and the
output thread cuts the tokens past it from the response. With stop strings in the batch the
loop waits, before each step, for the previous-but-one step's tokens to be rendered, so the
delay never exceeds one step (the output thread is far faster than a step: in practice no
wait).

Admission with the adapter slot pool (``worker.lora.pool``): a request is attached
only once every adapter it uses is resident and held in the pool (``LoraPool.acquire``: the
page-in, an in-place copy, happens here between steps; fetching and parsing happened before,
at submit, off the loop). Among the first ``ADMIT_LOOKAHEAD`` queued requests, one whose
adapters are all resident goes first (no page-in, no eviction: fewer page-ins under skewed
traffic), then FIFO; the queue head is passed over at most ``MAX_BYPASS`` times, after which
nothing is admitted before it (bounded waiting, vLLM/SGLang-style fairness). When every sequence
is held the request waits in the queue (never fails); a request needing more adapters than
``--max-loras`` is refused at submit.

Fair admission (``--fairness vtc``, ``worker.serving.fairness``): the Virtual Token
Counter's order across the requests' tenants replaces FIFO as the base order — the queue
"head" above is the fair head (the request of the least-served backlogged tenant of the top
priority class), the lookahead window is the first ``ADMIT_LOOKAHEAD`` of the fair order
(within that class), and the same ``MAX_BYPASS`` bound applies to the fair head. Tenants'
counters are charged when a request is admitted (its prompt) and per sampled token (in
``_step_once``: one call per step, O(rows)); ``--fairness off`` (the default) creates no
tenant state and admission is exactly the FIFO rule above. With fair admission a full worker
(``--slots`` + ``--queue-limit``) still takes a request of a lighter tenant: the heaviest
tenant's newest queued request gives its place (``_make_room``, ``FairQueue.give_way``,
``loraplane.queue_shares``) and ends with ``QueueFullError`` at the loop's next turn.

Holds, one notion per layer: the scheduler counts *request holds* per adapter id — a request
queued or running holds its adapters, and so does a request being submitted
(``hold_adapters``/``holding``, taken before its adapters are brought to host) — which keep
an adapter in the host tier (``worker.lora.host_cache``) and make an unload wait
(``run_when_idle_of``); the pool counts *slot holds* (``LoraPool.acquire``), taken when a
request is admitted. Every way a request ends goes through ``_end``, which frees its KV
sequence and both kinds of hold, and reports the outcome to the observer.

The pieces live beside it: requests/events/telemetry in ``request``, sequences in ``sequences``, the
``llama``/``keyed`` prefix-cache rules in ``cache_policy``, ubatch assembly in ``ubatch``,
sampling/detokenizing/stop strings in ``output`` (``OutputStage``, ``EmitWorker``).

Faults: an exception anywhere in a step (ubatch assembly, ``set_adapters``, the forward pass,
sampling, handing the tokens over; a kernel error, an out-of-memory error, a bug) fails the
requests of that step only — every row of the step, whichever row raised, since the step's
K/V and logits are shared: each gets an ``ErrorEvent`` (``DecodeFailedError``, gRPC INTERNAL)
naming the error, leaves through ``_end`` like any error (its KV sequence dropped, its slot and
request holds released), the traceback is logged once, and the loop serves the next requests.
Queued requests and sequences outside the failed step are untouched. ``MAX_STEP_FAILURES``
failed steps in a row (the model or device itself is broken: a sticky CUDA error) or an
exception outside a step (the loop's own bookkeeping) stop the loop for good
(``_fail_fatally``): every queued and running request gets an error, deferred functions
raise, ``submit`` refuses with ``WorkerDrainingError`` (UNAVAILABLE: the control plane retries
elsewhere), and the ``on_fatal`` callbacks run — the worker process reports NOT_SERVING,
heartbeats ``draining`` and exits non-zero, so ``serve`` (or Kubernetes) restarts it
(``worker.rpc.server``). Never a live-looking worker whose loop is gone.

Step timing: the interval since the previous step start and the duration of the last
``STEP_LOG`` decode-only steps are kept in a ring (``step_log``); ``stats`` reports the median
interval between consecutive step starts (the loop not idle in between) and the median step
duration, so the serving tax (the interval minus the step) is measurable from outside
(``WorkerStats``, ``bench/``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from loraplane.formats.adapter_file import AdapterError
from worker.config import Batching, Fairness, WorkerConfig
from worker.errors import (
    AdapterFetchError,
    DecodeFailedError,
    InvalidRequestError,
    QueueFullError,
    WorkerDrainingError,
    WorkerError,
)
from worker.lora.adapter_set import AdapterSet
from worker.lora.alora import resolve_alora
from worker.lora.pool import LoraPool, PoolExhaustedError
from worker.runtime.context_base import AdapterContext
from worker.runtime.grammar import Constraint, GrammarError
from worker.runtime.sampling import RowLogprobs, SamplingParams, greedy_rows, penalize_rows
from worker.serving.cache_policy import make_cache_policy
from worker.serving.constraints import GRAMMAR_FAILED, GrammarStage
from worker.serving.fairness import FairQueue, TenantService
from worker.serving.heap import release_free_heap
from worker.serving.output import (
    FINISH,
    EmitWorker,
    IncrementalDetokenizer,
    OutputStage,
    RequestObserver,
    StopMatcher,
)
from worker.serving.prefix_store import PrefixCache
from worker.serving.request import ANONYMOUS, ErrorEvent, Event, GenRequest, RequestTenant, StepInfo
from worker.serving.sequences import Seq, SeqState
from worker.serving.ubatch import N_BATCH, assemble_ubatch

log = structlog.get_logger("loraplane.worker.serving.scheduler")

ADMIT_LOOKAHEAD = 8  # queued requests considered for resident-first admission
MAX_BYPASS = 4  # times the queue head may be passed over before strict FIFO
STEP_LOG = 48  # decode-only steps kept for the step-interval figures (module docstring)
MAX_STEP_FAILURES = 3  # failed steps in a row after which the loop stops for good (module docstring)


@dataclass(frozen=True)
class SchedulerStats:
    """Counters and gauges of the scheduler (a slice of proto ``WorkerStats``)."""

    n_slots: int
    slots_busy: int
    queue_depth: int
    queue_limit: int
    graph_reuses: int
    graph_rebuilds: int
    prefix_cache_entries: int
    prefix_cache_hit_tokens: int
    prompt_tokens_computed: int
    tokens_generated: int
    # loop timing over ``step_log`` (module docstring), ms; 0 before any decode-only step
    step_interval_p50_ms: float = 0.0
    step_busy_p50_ms: float = 0.0
    step_samples: int = 0
    # KV cache cells (token positions) held by busy sequences / all slots' capacity
    # (n_slots x n_ctx per slot): vLLM's kv_cache_usage_perc is their ratio. An idle slot's
    # kept prompt cache is reusable at once, so it counts as free (vLLM: cached free blocks).
    kv_cells_used: int = 0
    kv_cells_total: int = 0
    # fair admission: "off" or "vtc", and the tenants known (``FairQueue.snapshot``; vtc only)
    fairness: str = "off"
    tenants: tuple[TenantService, ...] = ()
    # the GPU engine's CUDA graphs (``worker.gpu.context``; 0 on the CPU engine), named
    # apart from graph_reuses/graph_rebuilds (the LoRA plan cache of every engine)
    cuda_graphs_captured: int = 0
    cuda_graph_replays: int = 0
    cuda_graph_eager_fallbacks: int = 0


@dataclass
class _StepProgress:
    """How far a step got, for ``Scheduler._step_failed``: its sequences (once the batch is
    assembled), whether its step number was taken and its tokens handed over, and how many
    tokens it sampled."""

    seqs: list[Seq] | None = None
    numbered: bool = False
    handed_over: bool = False
    sampled: int = 0


def admission_order(queue: Sequence[GenRequest], pool: LoraPool) -> list[GenRequest]:
    """The queued requests admission tries, in order (module docstring): the head alone once
    it was passed over ``MAX_BYPASS`` times; else, among the first ``ADMIT_LOOKAHEAD``, those
    whose adapters are all resident in ``pool`` first, then the rest, in ``queue``'s order
    within each. ``queue``: the base order, the FIFO queue itself or, with fair admission,
    ``FairQueue.order``'s list (its first element is the head either way)."""
    head = queue[0]
    window = [head] if head.bypassed >= MAX_BYPASS else list(queue)[:ADMIT_LOOKAHEAD]
    resident = [r for r in window if all(pool.slot_of(a.sha256) is not None for _, a, _ in r.adapter_set.entries)]
    ids = {id(r) for r in resident}  # identity: requests are dataclasses with value equality
    return resident + [r for r in window if id(r) not in ids]


class Scheduler:
    """Owns the KV sequences and the loop thread; ``submit`` is safe from any thread.

    Args:
        ctx: the worker context (model, adapters, KV cache).
        config: batching mode, prefix-cache policy, sequence count (``--slots``), queue limit.
        worker_id: reported in telemetry and error messages.
    """

    def __init__(self, ctx: AdapterContext, config: WorkerConfig, worker_id: str):
        self.ctx = ctx
        self.config = config
        self.worker_id = worker_id
        self.tokenizer = ctx.model.tokenizer
        self.seqs = [Seq(i) for i in range(config.n_slots)]
        self.queue: deque[GenRequest] = deque()
        self._evicted: list[GenRequest] = []  # queued requests that gave way, ended at the next turn
        # fair admission (module docstring); None with --fairness off: no tenant state at all
        self.fair: FairQueue | None = (
            FairQueue(config.fairness_prompt_weight, config.fairness_output_weight)
            if config.fairness == Fairness.VTC
            else None
        )
        self.prefix_cache = PrefixCache(config.prefix_cache_tokens)
        self.cache_policy = make_cache_policy(config.prefix_cache, self.prefix_cache)
        self._cv = threading.Condition()
        self._stop = False
        self._step = 0
        self._trimmed_at_step = 0  # step count at the last idle heap trim
        self._holds: dict[int, int] = {}  # adapter id → request holds (module docstring)
        self._pending: list[tuple[int | None, Callable[[], Any], concurrent.futures.Future[Any]]] = []
        self.prompt_tokens_computed = 0
        self.tokens_generated = 0
        # Observer of request outcomes and token times (worker.serving.metrics); None: no metrics.
        self.observer: RequestObserver | None = None
        self.output = OutputStage(self.tokenizer, config.n_ctx_slot)
        self.grammar = GrammarStage(ctx.model.n_vocab, config.n_slots)  # structured output (per row)
        self.emitter = EmitWorker(self.output, lambda: self.observer)
        # (interval since the previous step start or None after idling, step duration) in s,
        # of the last STEP_LOG decode-only steps (module docstring)
        self.step_log: deque[tuple[float | None, float]] = deque(maxlen=STEP_LOG)
        self._last_step_start: float | None = None
        self.step_failures = 0  # failed steps in a row (module docstring: Faults)
        self.failure: BaseException | None = None  # why the loop stopped for good; None: it runs
        # Called once, on the loop thread, with that exception when the loop stops for good.
        self.on_fatal: list[Callable[[BaseException], None]] = []
        self._thread = threading.Thread(target=self._loop, name="loraplane-scheduler", daemon=True)

    # --- public -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop thread (at its next turn; waits up to 10 s). Queued and running
        requests are abandoned: the process is ending."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.emitter.close()
        self.grammar.close()

    def use_output_thread(self, threaded: bool) -> None:
        """Render and emit on the output thread (``threaded``, the default) or on the loop thread
        as each step's tokens are handed over (the text work back on the critical path, as
        before the output thread existed; ``bench/step_interval.py`` measures both). Call while
        no request runs."""
        old = self.emitter
        old.close()
        self.emitter = EmitWorker(self.output, lambda: self.observer, threaded=threaded, after_step=self._step)
        self.emitter.dropped = old.dropped  # ``stats`` subtracts it from the tokens sampled

    def submit(
        self,
        *,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        adapter_set: AdapterSet,
        emit: Callable[[Event], None],
        host_sources: dict[int, tuple[str, float]] | None = None,
        staged: dict | None = None,
        tenant: RequestTenant | None = None,
    ) -> GenRequest:
        """Admit a request: validate, apply the aLoRA rule, queue it. ``staged``: tensors of
        its non-resident adapters read ahead on the caller's thread (``LoraPool.stage``);
        ``tenant``: who it is accounted to (fair admission; None: "anonymous").

        Raises:
            InvalidRequestError: empty/too long prompt, token out of range, two aLoRAs, bad
                sampling field, a response format (schema / regex / grammar) that does not compile.
            QueueFullError: busy sequences + queued requests already equal ``--slots`` + ``queue_limit``.
            WorkerDrainingError: the loop stopped for good (``failure``); the worker is exiting.
        """
        n_vocab = self.ctx.model.n_vocab
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        bad = [t for t in prompt if not 0 <= t < n_vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} out of range [0, {n_vocab})")
        if len(prompt) >= self.config.n_ctx_slot:
            raise InvalidRequestError(f"prompt has {len(prompt)} tokens; a KV sequence holds {self.config.n_ctx_slot}")
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
                constraint = Constraint.build(
                    params.response_format, self.tokenizer, n_vocab, self.config.grammar_limits
                )
            except GrammarError as exc:
                raise InvalidRequestError(f"response_format: {exc}") from exc
        activation = resolve_alora(adapter_set, prompt)
        req = GenRequest(
            request_id or uuid.uuid4().hex,
            list(prompt),
            params,
            activation,
            emit,
            IncrementalDetokenizer(self.tokenizer),
        )
        if params.stop:
            req.stop = StopMatcher(params.stop)
        req.constraint = constraint
        req.host_sources = dict(host_sources or {})
        req.staged = dict(staged or {})
        req.tenant = tenant or ANONYMOUS
        with self._cv:
            if self.failure is not None:
                raise self._stopped_error()
            # Capacity is sequences + queue limit: a queued request that a free sequence takes at
            # the next loop turn is not "waiting", so a burst admits exactly that many even
            # while the loop is mid-step with idle sequences. A cancelled request (its client
            # went away) takes no place: the loop drops it at its next turn, possibly a long
            # step from now.
            busy = sum(s.req is not None and not s.req.cancelled.is_set() for s in self.seqs)
            queued = sum(not r.cancelled.is_set() for r in self.queue)
            if busy + queued >= len(self.seqs) + self.config.queue_limit:
                self._make_room(req.tenant, busy, queued)
            req.held_ids = adapter_set.ids
            self._count_holds(req.held_ids, +1)
            self.queue.append(req)
            if self.fair is not None:
                self.fair.enqueue(req)
            self._cv.notify_all()
        return req

    def _make_room(self, tenant: RequestTenant, busy: int, queued: int) -> None:
        """The worker is full: evict the queued request that gives its place to a request of
        ``tenant`` (fair admission's queue shares, ``FairQueue.give_way``; ended with
        ``QueueFullError`` at the loop's next turn), or refuse. The condition's lock held.

        Raises:
            QueueFullError: nothing gives way (or ``--fairness off``: first come, first served).
        """
        capacity = f"slots + --queue-limit {self.config.queue_limit}"
        fair = self.fair
        victim = fair.give_way(tenant) if fair is not None else None
        if fair is None or victim is None:
            raise QueueFullError(
                f"worker {self.worker_id}: queue full ({busy}/{len(self.seqs)} slots busy, {queued} "
                f"queued; admits {capacity})"
            )
        held = sum(1 for r in self.queue if r.tenant.name == victim.tenant.name)
        self.queue.remove(victim)
        fair.ended(victim)
        self._evicted.append(victim)
        log.info("queued_request_evicted", request_id=victim.request_id, tenant=victim.tenant.name, to=tenant.name)
        victim.evicted = QueueFullError(
            f"worker {self.worker_id}: queue full: this queued request gave its place to a lighter tenant's "
            f"(tenant '{victim.tenant.name}' had {held} of the {len(self.queue) + 1} queued; admits {capacity}, "
            "shared between tenants by --fairness vtc); retry later"
        )

    def run_when_idle_of(self, adapter_id: int, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn`` on the loop thread, between steps, once no request holds ``adapter_id``."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cv:
            if self.failure is not None:
                fut.set_exception(self._stopped_error())
                return fut
            self._pending.append((adapter_id, fn, fut))
            self._cv.notify_all()
        return fut

    def run_soon(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn`` on the loop thread at the next step boundary (pool changes go here)."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cv:
            if self.failure is not None:
                fut.set_exception(self._stopped_error())
                return fut
            self._pending.append((None, fn, fut))
            self._cv.notify_all()
        return fut

    # --- request holds ------------------------------------------------------------------
    def hold_adapters(self, adapter_ids: Iterable[int]) -> None:
        """Take one request hold on each id for a request not submitted yet (its adapters are
        being brought to host): the host tier keeps them and an unload waits, from now until
        ``release_adapters``. ``submit`` takes the request's own holds, so a caller that
        releases after ``submit`` returns leaves no gap."""
        with self._cv:
            self._count_holds(adapter_ids, +1)

    def release_adapters(self, adapter_ids: Iterable[int]) -> None:
        """Drop holds taken with ``hold_adapters`` (one per id)."""
        with self._cv:
            self._count_holds(adapter_ids, -1)
            self._cv.notify_all()

    @contextlib.contextmanager
    def holding(self, adapter_ids: Iterable[int]) -> Iterator[None]:
        """``hold_adapters`` for the duration of a ``with`` block."""
        ids = tuple(adapter_ids)
        self.hold_adapters(ids)
        try:
            yield
        finally:
            self.release_adapters(ids)

    def is_held(self, adapter_id: int) -> bool:
        """Whether any request (submitted, or being submitted) holds ``adapter_id``."""
        with self._cv:
            return self._holds.get(adapter_id, 0) > 0

    def _count_holds(self, adapter_ids: Iterable[int], delta: int) -> None:
        """Add ``delta`` to each id's request holds (the condition's lock held)."""
        for aid in adapter_ids:
            n = self._holds.get(aid, 0) + delta
            if n > 0:
                self._holds[aid] = n
            else:
                self._holds.pop(aid, None)

    def wake(self) -> None:
        """Wake the loop (a request was cancelled from another thread)."""
        with self._cv:
            self._cv.notify_all()

    def stats(self) -> SchedulerStats:
        """A consistent snapshot of the counters and gauges (any thread). ``tokens_generated``
        counts the tokens responses keep (those sampled past a stop string are not counted);
        the step figures are medians over ``step_log`` in ms (0 when empty)."""
        log_ = list(self.step_log)
        intervals = sorted(i for i, _ in log_ if i is not None)
        busy = sorted(b for _, b in log_)
        with self._cv:
            return SchedulerStats(
                n_slots=len(self.seqs),
                slots_busy=sum(s.busy for s in self.seqs),
                queue_depth=len(self.queue),
                queue_limit=self.config.queue_limit,
                graph_reuses=self.ctx.stats.graph_reuses,
                graph_rebuilds=self.ctx.stats.graph_rebuilds,
                prefix_cache_entries=len(self.prefix_cache),
                prefix_cache_hit_tokens=self.prefix_cache.hit_tokens,
                prompt_tokens_computed=self.prompt_tokens_computed,
                tokens_generated=self.tokens_generated - self.emitter.dropped,
                step_interval_p50_ms=_median(intervals) * 1000,
                step_busy_p50_ms=_median(busy) * 1000,
                step_samples=len(intervals),
                kv_cells_used=sum(self.ctx.kv.seq_len(s.id) for s in self.seqs if s.busy),
                kv_cells_total=len(self.seqs) * self.ctx.kv.n_ctx_seq,
                fairness=Fairness(self.config.fairness).value,
                tenants=() if self.fair is None else tuple(self.fair.snapshot()),
                **self.ctx.graph_counts(),
            )

    # --- loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        """The loop thread: ``_turns`` until stopped; an exception escaping it (outside a step,
        or ``MAX_STEP_FAILURES`` failed steps in a row) stops the loop for good."""
        try:
            self._turns()
        except Exception as exc:
            self._fail_fatally(exc)

    def _turns(self) -> None:
        while True:
            with self._cv:
                while (
                    not self._stop
                    and not self.queue
                    and not self._pending
                    and not self._evicted
                    and not any(s.busy for s in self.seqs)
                ):
                    if self._step != self._trimmed_at_step:  # just went idle after decoding
                        self._trimmed_at_step = self._step
                        release_free_heap()  # the steps' freed buffers back to the OS (worker.serving.heap)
                        continue
                    self._last_step_start = None  # the next step's interval would count idle time
                    self._cv.wait()
                if self._stop:
                    return
            self._bound_stop_delay()
            with self._cv:
                self._drop_evicted()
                self._drop_cancelled()
                self._drop_stopped()
                ready = self._take_ready_pending()
            # Outside the condition's lock: a deferred function may take the host tier's lock
            # (an unload's free), which is taken before this one elsewhere (the host tier asks
            # ``is_held`` with its lock held).
            for fn, fut in ready:
                try:
                    fut.set_result(fn())
                except Exception as exc:  # handed to the waiting caller
                    fut.set_exception(exc)
            with self._cv:
                self._admit()
                busy = [s for s in self.seqs if s.busy]
                if not busy and not ready and (self.queue or self._pending):
                    # Queued requests wait for pool slots, deferred functions for request
                    # holds to go (a request being submitted holds them too): no hot spin.
                    self._last_step_start = None
                    self._cv.wait(0.05)
            if busy:
                self._step_contained(busy)

    def _fail_fatally(self, exc: BaseException) -> None:
        """The loop cannot go on (module docstring: Faults): record ``exc`` (``submit`` and the
        deferred-function calls refuse from now on), run the ``on_fatal`` callbacks, fail every
        running request (``DecodeFailedError``: INTERNAL) and every queued one
        (``WorkerDrainingError``: UNAVAILABLE, it never started and may run elsewhere), and
        fail the deferred functions. Runs on the loop thread, which then ends."""
        log.critical("scheduler_stopped", worker_id=self.worker_id, error=repr(exc), exception=_traceback_of(exc))
        with self._cv:
            self.failure = exc
            queued = list(self.queue) + self._evicted
            self.queue.clear()
            self._evicted = []
            pending, self._pending = self._pending, []
            self._cv.notify_all()
        for callback in self.on_fatal:
            try:
                callback(exc)
            except Exception as cb_exc:
                log.error("scheduler_on_fatal_failed", error=repr(cb_exc), exception=_traceback_of(cb_exc))
        running = f"worker {self.worker_id}: the scheduler stopped ({type(exc).__name__}: {exc}); the worker restarts"
        ends: list[tuple[GenRequest, Seq | None, WorkerError]] = [(r, None, self._stopped_error()) for r in queued]
        ends += [(s.req, s, DecodeFailedError(running)) for s in self.seqs if s.req is not None]
        for req, seq, error in ends:
            try:
                self._end(req, "error", ErrorEvent(error), seq)
            except Exception as end_exc:  # the clean-up is broken too: the client still hears
                log.error("request_end_failed", request_id=req.request_id, error=repr(end_exc))
                self.emitter.put_end(req, "error", ErrorEvent(error), time.monotonic())
        for _, _, fut in pending:
            fut.set_exception(self._stopped_error())

    def _stopped_error(self) -> WorkerDrainingError:
        """What ``submit`` and deferred calls get once the loop stopped for good."""
        exc = self.failure
        return WorkerDrainingError(
            f"worker {self.worker_id} admits nothing: its scheduler stopped "
            f"({type(exc).__name__}: {exc}) and the worker restarts"
        )

    def _take_ready_pending(self) -> list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]:
        """Deferred functions that may run now (no request holds their adapter)."""
        ready = []
        for item in list(self._pending):
            aid, fn, fut = item
            if aid is None or self._holds.get(aid, 0) == 0:
                self._pending.remove(item)
                ready.append((fn, fut))
        return ready

    def _bound_stop_delay(self) -> None:
        """With a stop-string request running, wait until the output thread rendered the tokens
        of the step before the last one: a stop string completed by them is then seen before
        the next step, so at most one token past it is ever computed (module docstring)."""
        if self._step >= 2 and any(s.req is not None and s.req.stop is not None for s in self.seqs):
            self.emitter.wait_rendered(self._step - 1)

    def _drop_stopped(self) -> None:
        """Finish the sequences whose output found a stop string (``req.n_kept`` set)."""
        for seq in self.seqs:
            if seq.req is not None and seq.req.n_kept is not None:
                self._finish(seq, seq.req, "stop")

    def _drop_evicted(self) -> None:
        """End the queued requests that gave their place (``_make_room``) with their error."""
        evicted, self._evicted = self._evicted, []
        for req in evicted:
            self._end(req, "error", ErrorEvent(req.evicted or QueueFullError("evicted")))

    def _drop_cancelled(self) -> None:
        for req in [r for r in self.queue if r.cancelled.is_set()]:
            self.queue.remove(req)
            self._end(req, "cancelled", None)
        for seq in self.seqs:
            if seq.req is not None and seq.req.cancelled.is_set():
                log.info("request_cancelled", request_id=seq.req.request_id, seq=seq.id)
                self._end(seq.req, "cancelled", None, seq)

    def _next_admissible(self) -> GenRequest | None:
        """The queued request to attach next, its adapters acquired in the pool; None when
        none can get its adapters resident now (it waits). Rules: module docstring. A request
        whose adapter cannot be paged in (its file cannot be re-read) ends with an error.
        With fair admission the fair order is the base order (module docstring)."""
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
                self._end(req, "error", ErrorEvent(AdapterFetchError(f"paging the adapter in failed: {exc}")))
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

    def _admit(self) -> None:
        """Attach queued requests to free sequences (resident-first within bounded waiting)."""
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
                error = DecodeFailedError(f"attaching the request to slot {seq.id} failed: {exc!r}")
                self._end(req, "error", ErrorEvent(error), seq)
                continue
            seq.cache_tokens = req.prompt[:n]
            seq.cache_sets = [req.set_at(p) for p in range(n)]
            seq.n_past = n
            req.telemetry.cached_prompt_tokens = n
            seq.assign(req)

    def _step_contained(self, busy: list[Seq]) -> None:
        """Run one step; an exception in it fails the step's requests and the loop goes on
        (module docstring: Faults). Raises the step's exception once ``MAX_STEP_FAILURES``
        steps in a row failed, or any exception of the clean-up itself."""
        progress = _StepProgress()
        try:
            self._step_once(busy, progress)
        except Exception as exc:
            self._step_failed(busy, progress, exc)
        else:
            self.step_failures = 0

    def _step_failed(self, busy: list[Seq], progress: _StepProgress, exc: Exception) -> None:
        """Fail the requests still running on the failed step's sequences (all of ``busy`` when
        the batch was not assembled yet) through ``_end``; keep the output thread's step count
        going. Raises ``exc`` after ``MAX_STEP_FAILURES`` failures in a row."""
        self.step_failures += 1
        seqs = [s for s in (progress.seqs if progress.seqs is not None else busy) if s.req is not None]
        ids = [s.request.request_id for s in seqs]
        log.error(
            "step_failed",
            worker_id=self.worker_id,
            error=repr(exc),
            request_ids=ids,
            seqs=[s.id for s in seqs],
            failures_in_a_row=self.step_failures,
            exception=_traceback_of(exc),
        )
        if not progress.handed_over:
            self.tokens_generated -= progress.sampled  # never emitted
            if progress.numbered:
                self.emitter.put_tokens(self._step, [])  # ``wait_rendered`` counts every step
        if self.step_failures >= MAX_STEP_FAILURES:
            raise exc
        message = f"worker {self.worker_id}: the decode step failed ({type(exc).__name__}: {exc})"
        for s in seqs:
            self._end(s.request, "error", ErrorEvent(DecodeFailedError(message)), s)

    def _step_once(self, busy: list[Seq], progress: _StepProgress) -> None:
        """Assemble a ubatch of ``busy``, decode, sample and hand the tokens over; ``progress``
        records how far it got (``_step_failed``)."""
        t0 = time.monotonic()
        interval = None if self._last_step_start is None else t0 - self._last_step_start
        self._last_step_start = t0
        batch = assemble_ubatch(busy, compat=self.config.batching == Batching.COMPAT, n_batch=N_BATCH)
        progress.seqs = [s for s, _ in batch.parts]
        self.ctx.set_adapters(batch.sets)
        # structured output: the constrained rows that sample this step get their bitmasks
        # computed beside the forward pass (worker.serving.constraints)
        masks = self.grammar.start([s.request for s, rows in batch.parts if rows[-1] + 1 >= len(s.request.prompt)])
        res = self.ctx.decode(batch.ubatch)
        self._step += 1
        progress.numbered = True
        step = StepInfo(
            batch_size=len(batch.parts),
            batch_tokens=len(batch.ubatch),
            n_adapter_sets=len(batch.sets),
            graph_reused=res.graph_reused,
            n_nodes=res.n_nodes,
            node_budget=self.ctx.node_budget,
            batching=self.config.batching.value,
        )
        row_of = {r: i for i, r in enumerate(res.out_rows)}
        first = 0
        parts = []
        for s, rows in batch.parts:
            parts.append((s, rows, [row_of.get(first + j, -1) for j in range(len(rows))]))
            first += len(rows)
        # the grammar-mask step: disallowed logits of constrained rows → -inf, before sampling
        self.grammar.apply(
            masks, res.logits, {id(s.request): out_idx[-1] for s, _, out_idx in parts if out_idx[-1] >= 0}
        )
        # greedy rows that sample this step: one batched log_softmax + argmax for all of them
        greedy = [
            out_idx[-1]
            for s, rows, out_idx in parts
            if s.sampler is not None and s.sampler.greedy and rows[-1] + 1 >= len(s.request.prompt) and out_idx[-1] >= 0
        ]
        pre: dict[int, tuple[RowLogprobs, int]] = {}
        if len(greedy) > 1:
            logp, tok = greedy_rows(res.logits, greedy)
            pre = {r: (logp[i], tok[i]) for i, r in enumerate(greedy)}
        penalized = _penalize_step(parts, res.logits)
        records: list = []
        ended: list[tuple[Seq, str]] = []
        for s, rows, out_idx in parts:
            reason = self._after_rows(
                s, rows, res.logits, out_idx, step, records, pre.get(out_idx[-1]), penalized.get(out_idx[-1])
            )
            progress.sampled = len(records)
            if reason is not None:
                ended.append((s, reason))
        if self.fair is not None:
            self.fair.charge_output([r[0] for r in records])  # one token per sampled row
        self.emitter.put_tokens(self._step, records)  # every step: ``wait_rendered`` counts steps
        progress.handed_over = True
        for s, reason in ended:  # after the tokens: the output thread sees them first
            if reason == GRAMMAR_FAILED:
                self._end(s.request, "error", ErrorEvent(self.grammar.failure(s.request)), s)
            else:
                self._finish(s, s.request, reason)
        t1 = time.monotonic()
        if len(batch.ubatch) == len(batch.parts) and records:  # decode-only: one generated row each
            self.step_log.append((interval, t1 - t0))
        log.debug("step", n=len(batch.ubatch), seqs=len(batch.parts), sets=len(batch.sets), ms=(t1 - t0) * 1000)

    def _after_rows(
        self,
        seq: Seq,
        rows: list[int],
        logits: torch.Tensor,
        out_idx: list[int],
        step: StepInfo,
        records: list,
        pre: tuple[RowLogprobs, int] | None = None,
        penalized: torch.Tensor | None = None,
    ) -> str | None:
        """Record the computed positions ``rows`` in the sequence's cache; once the prompt is done,
        sample the last row (``OutputStage.sample``; ``pre``: its batched ``(log_softmax,
        argmax)`` for a greedy sampler; ``penalized``: the row after the request's penalties,
        `_penalize_step`) and append the token's record for the output thread to ``records``.
        Returns the finish reason the ids decide, or None."""
        req = seq.request
        seq.last_step = self._step
        for p in rows:
            seq.cache_tokens.append(req.token_at(p))
            seq.cache_sets.append(req.set_at(p))
        seq.n_past = rows[-1] + 1
        if seq.state == SeqState.PROMPT:
            self.prompt_tokens_computed += len(rows)
            self.output.prompt_rows(req, rows, logits, out_idx)
            if seq.n_past < len(req.prompt):
                return None
            seq.state = SeqState.GENERATING
            self.emitter.put_started(req)
        assert seq.sampler is not None
        sampled, reason = self.output.sample(
            req, seq.sampler, logits[out_idx[-1]], n_past=seq.n_past, pre=pre, penalized=penalized
        )
        if req.constraint is not None:
            reason = self.grammar.advance(req, sampled.token_id, reason)
        records.append((req, sampled, step, time.monotonic(), reason))
        self.tokens_generated += 1
        return reason

    def _finish(self, seq: Seq, req: GenRequest, reason: str) -> None:
        """End a request that finished with ``reason`` ("stop" or "length"): its telemetry
        summary (the output thread adds the times and the text, ``EmitWorker``), then ``_end``."""
        t = req.telemetry
        t.prompt_tokens = len(req.prompt)
        t.prefix_cache = self.cache_policy.name
        t.alora_activation_pos = req.activation.start
        t.adapter_set_fingerprint = req.adapter_set.fingerprint
        t.slot_id = seq.id
        t.worker_id = self.worker_id
        t.adapters = [(i, s) for i, _, s in req.adapter_set.entries]
        self._end(req, reason, FINISH, seq)

    def _end(self, req: GenRequest, outcome: str, event: Event | object | None, seq: Seq | None = None) -> None:
        """The one exit of a request, whatever ended it (loop thread).

        Frees its KV sequence (``seq``: the one it runs on or was being attached to, None
        for a queued request): on "stop", "length" or "cancelled" the cache policy keeps or
        stores what it may (llama-server keeps a slot's last sequence), on "error" the sequence
        is dropped, its content unknown; a sequence stopped by a stop string found late is first
        trimmed to what an immediate stop would have left (positions up to the kept tokens). Then
        hands ``event`` (``FINISH``: the finished event; None: the client went away) to the
        output thread, which emits it after the request's tokens and reports ``outcome`` ("stop",
        "length", "cancelled" or "error") to the observer — always, so every ended request is
        counted once; drops the request's slot and request holds and frees the sequence.
        """
        if seq is not None:
            kept = req.n_kept
            if kept is not None and outcome != "error":
                n = min(seq.n_past, len(req.prompt) + kept - 1)
                self.ctx.kv.seq_rm(seq.id, max(n, 1))
                del seq.cache_tokens[n:], seq.cache_sets[n:]
                seq.n_past = n
            if outcome == "error":
                self.ctx.kv.seq_rm(seq.id)
                seq.drop_cache()
            else:
                self.cache_policy.on_finish(seq, req, self.ctx.kv)
        self._release_holds(req)
        if self.fair is not None:
            self.fair.ended(req)
        if seq is not None and seq.req is req:
            seq.release()
        self.emitter.put_end(req, outcome, event, time.monotonic())

    def _release_holds(self, req: GenRequest) -> None:
        """Drop the request's slot holds (pool) and request holds (this scheduler)."""
        if req.pool_held:
            self.ctx.pool.release(req.pool_held)
            req.pool_held = []
        with self._cv:
            self._count_holds(req.held_ids, -1)
            req.held_ids = ()
            self._cv.notify_all()


def _traceback_of(exc: BaseException) -> str:
    """The formatted traceback of ``exc``, logged as the ``exception`` field (what structlog's
    ``format_exc_info`` writes) without any renderer's locals dump: fast, and no tensors or
    prompts in the log."""
    return "".join(traceback.format_exception(exc))


def _median(xs: list[float]) -> float:
    """Median of sorted ``xs`` (0.0 when empty)."""
    if not xs:
        return 0.0
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def _penalize_step(parts: list, logits: torch.Tensor) -> dict[int, torch.Tensor]:
    """The penalty step of a decode step (`sampling.penalize_rows`, one batched call): for
    every sequence that samples this step with a penalty on (``SamplingParams.penalized``), its
    output row of ``logits`` (f32 ``(n_out, n_vocab)``) after its own presence / frequency /
    repetition penalties over its prompt and the tokens generated so far. Runs on the raw
    logits, before any other per-row logits step. Returns ``{output row: penalized row
    (n_vocab,)}``; empty when no row is penalized (the common case costs one scan of ``parts``).

    ``parts``: ``(seq, positions, output rows)`` per sequence of the ubatch."""
    rows, params, prompts, outputs = [], [], [], []
    for s, pos, out_idx in parts:
        if s.sampler is None or not s.sampler.params.penalized or out_idx[-1] < 0:
            continue
        if pos[-1] + 1 < len(s.request.prompt):
            continue  # still in the prompt: nothing is sampled this step
        rows.append(out_idx[-1])
        params.append(s.sampler.params)
        prompts.append(s.request.prompt)
        outputs.append(s.request.generated)
    if not rows:
        return {}
    pen = penalize_rows(logits, rows, params, prompts, outputs)
    return {r: pen[i] for i, r in enumerate(rows)}


__all__ = ["RequestObserver", "Scheduler", "SchedulerStats"]
