"""The decode step: assemble a ubatch of the busy sequences, decode, sample, hand the tokens over.

``StepRunner.run`` is one step of the scheduler's loop (loop thread): ubatch assembly
(``worker.serving.ubatch``), the context's adapter sets set once, the forward pass, the grammar
and penalty steps, sampling (``worker.serving.output.OutputStage``) and the hand-off of the
step's tokens to the output thread in one put. ``contain`` fails the requests of a step that
raised; ``end`` is the one exit of every request, whatever ended it. The rules and why:
docs/architecture.md ("The serving loop") and docs/operations.md ("Faults in the decode loop").
"""

from __future__ import annotations

import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from worker.config import Batching, WorkerConfig
from worker.errors import DecodeFailedError
from worker.runtime.context_base import AdapterContext
from worker.runtime.sampling import RowLogprobs, greedy_rows, greedy_top, penalize_rows
from worker.serving.cache_policy import CachePolicy
from worker.serving.constraints import GRAMMAR_FAILED, GrammarStage
from worker.serving.fairness import FairQueue
from worker.serving.output import FINISH, EmitWorker, OutputStage
from worker.serving.request import ErrorEvent, Event, GenRequest, StepInfo
from worker.serving.sequences import Seq, SeqState
from worker.serving.ubatch import N_BATCH, assemble_ubatch

log = structlog.get_logger("loraplane.worker.serving.step")

STEP_LOG = 48  # decode-only steps kept for the step-interval figures (``StepRunner.step_log``)


@dataclass
class StepProgress:
    """How far a step got, for ``StepRunner.contain``: its sequences (once the batch is
    assembled), whether its step number was taken and its tokens handed over, and how many
    tokens it sampled."""

    seqs: list[Seq] | None = None
    numbered: bool = False
    handed_over: bool = False
    sampled: int = 0


class StepRunner:
    """Runs the decode steps and ends requests (loop thread).

    Args:
        ctx: the worker context (``set_adapters``, ``decode``, the KV store, the slot pool).
        config: batching mode.
        worker_id: reported in telemetry, logs and error messages.
        cache_policy: what a finished sequence keeps (``on_finish``).
        output: sampling and the id-decided finish.
        grammar: the per-row grammar step of structured output.
        emitter: the output thread the step's tokens and the requests' ends go to.
        fair: fair admission's tenant counters (charged per sampled token); None: off.
        release_holds: drops a request's slot holds and request holds (``Scheduler``).

    Attributes:
        n_steps: steps numbered so far (the output thread counts the same steps).
        step_log: (interval since the previous step start or None after idling, step duration)
            in s, of the last ``STEP_LOG`` decode-only steps.
        tokens_generated, prompt_tokens_computed: counters for ``SchedulerStats``.
    """

    def __init__(
        self,
        ctx: AdapterContext,
        config: WorkerConfig,
        worker_id: str,
        *,
        cache_policy: CachePolicy,
        output: OutputStage,
        grammar: GrammarStage,
        emitter: EmitWorker,
        fair: FairQueue | None,
        release_holds: Callable[[GenRequest], None],
    ):
        self.ctx = ctx
        self.config = config
        self.worker_id = worker_id
        self.cache_policy = cache_policy
        self.output = output
        self.grammar = grammar
        self.emitter = emitter
        self.fair = fair
        self._release_holds = release_holds
        self.n_steps = 0
        self.step_log: deque[tuple[float | None, float]] = deque(maxlen=STEP_LOG)
        self.last_start: float | None = None  # None: idle since the last step (no interval)
        self.prompt_tokens_computed = 0
        self.tokens_generated = 0

    def run(self, busy: list[Seq], progress: StepProgress) -> None:
        """Assemble a ubatch of ``busy``, decode, sample and hand the tokens over; ``progress``
        records how far it got (``contain``). Any exception of the step propagates."""
        t0 = time.monotonic()
        interval = None if self.last_start is None else t0 - self.last_start
        self.last_start = t0
        batch = assemble_ubatch(busy, compat=self.config.batching == Batching.COMPAT, n_batch=N_BATCH)
        progress.seqs = [s for s, _ in batch.parts]
        self.ctx.set_adapters(batch.sets)
        # structured output: the constrained rows that sample this step get their bitmasks
        # computed beside the forward pass (worker.serving.constraints)
        masks = self.grammar.start([s.request for s, rows in batch.parts if rows[-1] + 1 >= len(s.request.prompt)])
        res = self.ctx.decode(batch.ubatch)
        self.n_steps += 1
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
        greedy_seqs = [
            (s.sampler, out_idx[-1])
            for s, rows, out_idx in parts
            if s.sampler is not None and s.sampler.greedy and rows[-1] + 1 >= len(s.request.prompt) and out_idx[-1] >= 0
        ]
        greedy = [r for _, r in greedy_seqs]
        pre: dict[int, tuple[RowLogprobs, int]] = {}
        if len(greedy) > 1:
            logp, tok = greedy_rows(res.logits, greedy, greedy_top(sp for sp, _ in greedy_seqs))
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
        self.emitter.put_tokens(self.n_steps, records)  # every step: ``wait_rendered`` counts steps
        progress.handed_over = True
        for s, reason in ended:  # after the tokens: the output thread sees them first
            if reason == GRAMMAR_FAILED:
                self.end(s.request, "error", ErrorEvent(self.grammar.failure(s.request)), s)
            else:
                self.finish(s, s.request, reason)
        t1 = time.monotonic()
        if len(batch.ubatch) == len(batch.parts) and records:  # decode-only: one generated row each
            self.step_log.append((interval, t1 - t0))
        log.debug("step", n=len(batch.ubatch), seqs=len(batch.parts), sets=len(batch.sets), ms=(t1 - t0) * 1000)

    def contain(
        self, busy: list[Seq], progress: StepProgress, exc: Exception, *, failures_in_a_row: int, end_requests: bool
    ) -> None:
        """A step raised ``exc``: log it once with its requests, keep the output thread's step
        count going, and (``end_requests``) fail the requests still running on the step's
        sequences (all of ``busy`` when the batch was not assembled yet) through ``end`` with
        ``DecodeFailedError``. The scheduler passes ``end_requests=False`` when it gives up:
        it then fails every request itself."""
        seqs = [s for s in (progress.seqs if progress.seqs is not None else busy) if s.req is not None]
        log.error(
            "step_failed",
            worker_id=self.worker_id,
            error=repr(exc),
            request_ids=[s.request.request_id for s in seqs],
            seqs=[s.id for s in seqs],
            failures_in_a_row=failures_in_a_row,
            exception=traceback_of(exc),
        )
        if not progress.handed_over:
            self.tokens_generated -= progress.sampled  # never emitted
            if progress.numbered:
                self.emitter.put_tokens(self.n_steps, [])  # ``wait_rendered`` counts every step
        if not end_requests:
            return
        message = f"worker {self.worker_id}: the decode step failed ({type(exc).__name__}: {exc})"
        for s in seqs:
            self.end(s.request, "error", ErrorEvent(DecodeFailedError(message)), s)

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
        seq.last_step = self.n_steps
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

    def finish(self, seq: Seq, req: GenRequest, reason: str) -> None:
        """End a request that finished with ``reason`` ("stop" or "length"): its telemetry
        summary (the output thread adds the times and the text, ``EmitWorker``), then ``end``."""
        t = req.telemetry
        t.prompt_tokens = len(req.prompt)
        t.prefix_cache = self.cache_policy.name
        t.alora_activation_pos = req.activation.start
        t.adapter_set_fingerprint = req.adapter_set.fingerprint
        t.slot_id = seq.id
        t.worker_id = self.worker_id
        t.adapters = req.adapter_set.scales
        self.end(req, reason, FINISH, seq)

    def end(self, req: GenRequest, outcome: str, event: Event | object | None, seq: Seq | None) -> None:
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


def traceback_of(exc: BaseException) -> str:
    """The formatted traceback of ``exc``, logged as the ``exception`` field (what structlog's
    ``format_exc_info`` writes) without any renderer's locals dump: fast, and no tensors or
    prompts in the log."""
    return "".join(traceback.format_exception(exc))


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


__all__ = ["STEP_LOG", "StepProgress", "StepRunner", "traceback_of"]
