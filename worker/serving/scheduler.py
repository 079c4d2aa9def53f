"""The continuous-batching loop (llama-server ``server_context::update_slots``).

``Scheduler`` owns the KV sequences and the loop thread. Each turn drops cancelled, evicted and
stop-string-finished requests, runs deferred functions (adapter frees, pool changes) once no
request holds their adapter, attaches queued requests (``worker.serving.admission``) and runs
one decode step (``worker.serving.step``); ``holds`` counts the request holds per adapter id
(``worker.serving.holds``). It stops for good after ``MAX_STEP_FAILURES`` failed steps in a row
or a fault outside a step. The rules and why: docs/architecture.md ("The serving loop") and
docs/operations.md ("Faults in the decode loop").
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from worker.config import Fairness, WorkerConfig
from worker.errors import DecodeFailedError, WorkerDrainingError, WorkerError
from worker.lora.adapter_set import AdapterSet
from worker.runtime.context_base import AdapterContext
from worker.runtime.sampling import SamplingParams
from worker.serving.admission import Admission
from worker.serving.cache_policy import make_cache_policy
from worker.serving.constraints import GrammarStage
from worker.serving.fairness import FairQueue
from worker.serving.heap import release_free_heap
from worker.serving.holds import RequestHolds
from worker.serving.output import EmitWorker, OutputStage, RequestObserver
from worker.serving.prefix_store import PrefixCache
from worker.serving.request import ErrorEvent, Event, GenRequest, RequestTenant
from worker.serving.sequences import Seq
from worker.serving.stats import SchedulerStats, median
from worker.serving.step import StepProgress, StepRunner, traceback_of

log = structlog.get_logger("loraplane.worker.serving.scheduler")

MAX_STEP_FAILURES = 3  # failed steps in a row after which the loop stops for good


class Scheduler:
    """Owns the KV sequences, the request holds and the loop thread; ``submit``, ``holds``,
    ``run_soon``/``run_when_idle_of``, ``wake`` and ``stats`` are safe from any thread.

    Args:
        ctx: the worker context (model, adapters, KV cache).
        config: batching mode, prefix-cache policy, sequence count (``--slots``), queue limit.
        worker_id: reported in telemetry and error messages.

    Attributes:
        admission: the queue and the rule that attaches queued requests (``Admission``).
        steps: the decode step and the one exit of a request (``StepRunner``).
        holds: request holds per adapter id (``RequestHolds``): what a deferred free waits for.
        step_failures: failed steps in a row (``_step_contained``).
        failure: why the loop stopped for good; None while it runs.
        on_fatal: called once, on the loop thread, with ``failure`` when the loop stops.
    """

    def __init__(self, ctx: AdapterContext, config: WorkerConfig, worker_id: str):
        self.ctx = ctx
        self.config = config
        self.worker_id = worker_id
        self.seqs = [Seq(i) for i in range(config.n_seqs)]
        self.prefix_cache = PrefixCache(config.prefix_cache_tokens)
        self.cache_policy = make_cache_policy(config.prefix_cache, self.prefix_cache)
        self._cv = threading.Condition()
        self._stop = False
        self._trimmed_at_step = 0  # step count at the last idle heap trim
        self.holds = RequestHolds(self._cv, ctx.pool)  # request holds per adapter id
        self._pending: list[tuple[int | None, Callable[[], Any], concurrent.futures.Future[Any]]] = []
        # Observer of request outcomes and token times (worker.serving.metrics); None: no metrics.
        self.observer: RequestObserver | None = None
        self.output = OutputStage(ctx.model.tokenizer, config.n_ctx_seq)
        self.grammar = GrammarStage(ctx.model.n_vocab, config.n_seqs)  # structured output (per row)
        # fair admission (docs/fairness.md); None with --fairness off: no tenant state at all
        fair = (
            FairQueue(config.fairness_prompt_weight, config.fairness_output_weight)
            if config.fairness == Fairness.VTC
            else None
        )
        self.steps = StepRunner(
            ctx,
            config,
            worker_id,
            cache_policy=self.cache_policy,
            output=self.output,
            grammar=self.grammar,
            emitter=EmitWorker(self.output, lambda: self.observer),
            fair=fair,
            release_holds=self.holds.release,
        )
        self.admission = Admission(ctx, config, worker_id, self.seqs, self.cache_policy, fair, self.steps.end)
        self.step_failures = 0  # failed steps in a row (``_step_contained``)
        self.failure: BaseException | None = None  # why the loop stopped for good; None: it runs
        # Called once, on the loop thread, with that exception when the loop stops for good.
        self.on_fatal: list[Callable[[BaseException], None]] = []
        self._thread = threading.Thread(target=self._loop, name="loraplane-scheduler", daemon=True)

    @property
    def emitter(self) -> EmitWorker:
        """The output thread the steps hand their tokens and the requests' ends to."""
        return self.steps.emitter

    @emitter.setter
    def emitter(self, emitter: EmitWorker) -> None:
        """Swap the output thread (``use_output_thread``; a test's lagging one), no request running."""
        self.steps.emitter = emitter

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
        self.emitter = EmitWorker(self.output, lambda: self.observer, threaded=threaded, after_step=self.steps.n_steps)
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
        req = self.admission.build_request(
            request_id=request_id,
            prompt=prompt,
            params=params,
            adapter_set=adapter_set,
            emit=emit,
            host_sources=host_sources,
            staged=staged,
            tenant=tenant,
        )
        with self._cv:
            if self.failure is not None:
                raise self._stopped_error()
            self.admission.enqueue(req)
            req.held_ids = adapter_set.ids
            self.holds.add(req.held_ids)
            self._cv.notify_all()
        return req

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

    def wake(self) -> None:
        """Wake the loop (a request was cancelled from another thread)."""
        with self._cv:
            self._cv.notify_all()

    def stats(self) -> SchedulerStats:
        """A consistent snapshot of the counters and gauges (any thread). ``tokens_generated``
        counts the tokens responses keep (those sampled past a stop string are not counted);
        the step figures are medians over ``step_log`` in ms (0 when empty)."""
        log_ = list(self.steps.step_log)
        intervals = sorted(i for i, _ in log_ if i is not None)
        busy = sorted(b for _, b in log_)
        with self._cv:
            return SchedulerStats(
                n_slots=len(self.seqs),
                slots_busy=sum(s.busy for s in self.seqs),
                queue_depth=len(self.admission.queue),
                queue_limit=self.config.queue_limit,
                graph_reuses=self.ctx.stats.graph_reuses,
                graph_rebuilds=self.ctx.stats.graph_rebuilds,
                prefix_cache_entries=len(self.prefix_cache),
                prefix_cache_hit_tokens=self.prefix_cache.hit_tokens,
                prompt_tokens_computed=self.steps.prompt_tokens_computed,
                tokens_generated=self.steps.tokens_generated - self.emitter.dropped,
                step_interval_p50_ms=median(intervals) * 1000,
                step_busy_p50_ms=median(busy) * 1000,
                step_samples=len(intervals),
                kv_cells_used=sum(self.ctx.kv.seq_len(s.id) for s in self.seqs if s.busy),
                kv_cells_total=len(self.seqs) * self.ctx.kv.n_ctx_seq,
                fairness=Fairness(self.config.fairness).value,
                tenants=() if self.admission.fair is None else tuple(self.admission.fair.snapshot()),
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
                    and not self.admission.queue
                    and not self._pending
                    and not self.admission.evicted
                    and not any(s.busy for s in self.seqs)
                ):
                    if self.steps.n_steps != self._trimmed_at_step:  # just went idle after decoding
                        self._trimmed_at_step = self.steps.n_steps
                        release_free_heap()  # the steps' freed buffers back to the OS (worker.serving.heap)
                        continue
                    self.steps.last_start = None  # the next step's interval would count idle time
                    self._cv.wait()
                if self._stop:
                    return
            self._bound_stop_delay()
            with self._cv:
                self.admission.drop_evicted()
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
                self.admission.admit()
                busy = [s for s in self.seqs if s.busy]
                if not busy and not ready and (self.admission.queue or self._pending):
                    # Queued requests wait for pool slots, deferred functions for request
                    # holds to go (a request being submitted holds them too): no hot spin.
                    self.steps.last_start = None
                    self._cv.wait(0.05)
            if busy:
                self._step_contained(busy)

    def _fail_fatally(self, exc: BaseException) -> None:
        """The loop cannot go on (docs/operations.md, "Faults in the decode loop"): record ``exc`` (``submit`` and the
        deferred-function calls refuse from now on), run the ``on_fatal`` callbacks, fail every
        running request (``DecodeFailedError``: INTERNAL) and every queued one
        (``WorkerDrainingError``: UNAVAILABLE, it never started and may run elsewhere), and
        fail the deferred functions. Runs on the loop thread, which then ends."""
        log.critical("scheduler_stopped", worker_id=self.worker_id, error=repr(exc), exception=traceback_of(exc))
        with self._cv:
            self.failure = exc
            queued = self.admission.take_all()
            pending, self._pending = self._pending, []
            self._cv.notify_all()
        for callback in self.on_fatal:
            try:
                callback(exc)
            except Exception as cb_exc:
                log.error("scheduler_on_fatal_failed", error=repr(cb_exc), exception=traceback_of(cb_exc))
        running = f"worker {self.worker_id}: the scheduler stopped ({type(exc).__name__}: {exc}); the worker restarts"
        ends: list[tuple[GenRequest, Seq | None, WorkerError]] = [(r, None, self._stopped_error()) for r in queued]
        ends += [(s.req, s, DecodeFailedError(running)) for s in self.seqs if s.req is not None]
        for req, seq, error in ends:
            try:
                self.steps.end(req, "error", ErrorEvent(error), seq)
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
            if aid is None or self.holds.count(aid) == 0:
                self._pending.remove(item)
                ready.append((fn, fut))
        return ready

    def _bound_stop_delay(self) -> None:
        """With a stop-string request running, wait until the output thread rendered the tokens
        of the step before the last one: a stop string completed by them is then seen before
        the next step, so at most one token past it is ever computed (docs/architecture.md)."""
        n = self.steps.n_steps
        if n >= 2 and any(s.req is not None and s.req.stop is not None for s in self.seqs):
            self.emitter.wait_rendered(n - 1)

    def _drop_stopped(self) -> None:
        """Finish the sequences whose output found a stop string (``req.n_kept`` set)."""
        for seq in self.seqs:
            if seq.req is not None and seq.req.n_kept is not None:
                self.steps.finish(seq, seq.req, "stop")

    def _drop_cancelled(self) -> None:
        """End the requests whose client went away, queued then running."""
        self.admission.drop_cancelled()
        for seq in self.seqs:
            if seq.req is not None and seq.req.cancelled.is_set():
                log.info("request_cancelled", request_id=seq.req.request_id, seq=seq.id)
                self.steps.end(seq.req, "cancelled", None, seq)

    def _step_contained(self, busy: list[Seq]) -> None:
        """Run one step; an exception in it fails the step's requests and the loop goes on
        (``StepRunner.contain``). Raises the step's exception once ``MAX_STEP_FAILURES`` steps
        in a row failed (the loop then stops for good and fails every request itself), or any
        exception of the clean-up itself."""
        progress = StepProgress()
        try:
            self.steps.run(busy, progress)
        except Exception as exc:
            self.step_failures += 1
            give_up = self.step_failures >= MAX_STEP_FAILURES
            self.steps.contain(busy, progress, exc, failures_in_a_row=self.step_failures, end_requests=not give_up)
            if give_up:
                raise
        else:
            self.step_failures = 0


__all__ = ["MAX_STEP_FAILURES", "Scheduler"]
