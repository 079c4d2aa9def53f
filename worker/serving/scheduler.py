"""Continuous-batching scheduler (llama-server ``server_context::update_slots``).

One thread runs the loop: admit queued requests into free slots (FIFO, so none starves),
build a ubatch, set the context's adapter sets once, decode, sample, stream events.

- ``compat`` batching: only slots that ``can_batch_with`` each other share a ubatch (same
  adapter set for the rows they feed next); groups take turns, the group whose slot waited
  longest going first.
- ``mixed`` batching: every busy slot joins the ubatch; rows carry a set index and the
  low-rank branches are computed per segment (``worker.runtime.graph``).

Prefix cache: ``llama`` keeps each slot's last prompt and applies ``lora_should_clear_cache``
on a set change; ``keyed`` restores prefixes from ``PrefixCache`` by adapter-set fingerprint.
Either way a position is reused only if it was computed under the set the new request
uses there.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid
from collections import deque

import structlog
import torch

from worker.errors import DecodeFailedError, InvalidRequestError, QueueFullError, WorkerError
from worker.config import Batching, PrefixCachePolicy, WorkerConfig
from worker.runtime.context import DecodeError, UBatch, WorkerContext
from worker.lora.plan import AdapterSet
from worker.serving.prefix_store import PrefixCache
from worker.runtime.sampling import SamplingParams
from worker.serving.slots import (ErrorEvent, FinishedEvent, GenRequest, Slot, SlotState,
                          StartedEvent, StepInfo, TokenEvent, lora_should_clear_cache, resolve_alora)

log = structlog.get_logger("loraplane.worker.serving.scheduler")

N_BATCH = 512  # most token rows in one ubatch (llama.cpp n_batch / n_ubatch)


class Scheduler:
    """Owns the slots and the loop thread; ``submit`` is safe from any thread.

    Args:
        ctx: the worker context (model, adapters, KV cache).
        config: batching mode, prefix-cache policy, slot count, queue limit.
    """

    def __init__(self, ctx: WorkerContext, config: WorkerConfig, worker_id: str):
        self.ctx = ctx
        self.config = config
        self.worker_id = worker_id
        self.tokenizer = ctx.model.tokenizer
        self.slots = [Slot(i) for i in range(config.n_slots)]
        self.queue: deque[GenRequest] = deque()
        self.prefix_cache = PrefixCache(config.prefix_cache_tokens)
        self._cv = threading.Condition()
        self._stop = False
        self._step = 0
        self._in_flight: dict[int, int] = {}   # adapter id → requests holding it
        self._pending: list[tuple[int, object, concurrent.futures.Future]] = []  # run once an adapter is idle
        self.prompt_tokens_computed = 0
        self.tokens_generated = 0
        self._thread = threading.Thread(target=self._loop, name="loraplane-scheduler", daemon=True)

    # --- public -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    def submit(self, *, request_id: str, prompt: list[int], params: SamplingParams,
               adapter_set: AdapterSet, emit) -> GenRequest:
        """Admit a request (``scheduler.admit``): validate, apply the aLoRA rule, queue it.

        Raises:
            InvalidRequestError: empty/too long prompt, token out of range, two aLoRAs, bad
                sampling field.
            QueueFullError: the waiting queue is at ``queue_limit``.
        """
        n_vocab = self.ctx.model.n_vocab
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        bad = [t for t in prompt if not 0 <= t < n_vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} out of range [0, {n_vocab})")
        if len(prompt) >= self.config.n_ctx_slot:
            raise InvalidRequestError(f"prompt has {len(prompt)} tokens; the slot context holds {self.config.n_ctx_slot}")
        try:
            params.validate()
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        activation = resolve_alora(adapter_set, prompt)
        req = GenRequest(request_id or uuid.uuid4().hex, list(prompt), params, activation, emit)
        with self._cv:
            if len(self.queue) >= self.config.queue_limit:
                raise QueueFullError(f"worker {self.worker_id}: queue full ({self.config.queue_limit} waiting)")
            req.held_ids = adapter_set.ids
            for aid in req.held_ids:
                self._in_flight[aid] = self._in_flight.get(aid, 0) + 1
            self.queue.append(req)
            self._cv.notify_all()
        return req

    def run_when_idle_of(self, adapter_id: int, fn) -> concurrent.futures.Future:
        """Run ``fn`` on the loop thread, between steps, once no request holds ``adapter_id``."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._pending.append((adapter_id, fn, fut))
            self._cv.notify_all()
        return fut

    def _run_pending(self) -> None:
        for item in list(self._pending):
            aid, fn, fut = item
            if self._in_flight.get(aid, 0) == 0:
                self._pending.remove(item)
                try:
                    fut.set_result(fn())
                except Exception as exc:  # handed to the waiting caller
                    fut.set_exception(exc)

    def adapter_in_flight(self, adapter_id: int) -> int:
        with self._cv:
            return self._in_flight.get(adapter_id, 0)

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def stats(self) -> dict:
        with self._cv:
            return {
                "n_slots": len(self.slots), "slots_busy": sum(s.busy for s in self.slots),
                "queue_depth": len(self.queue), "queue_limit": self.config.queue_limit,
                "graph_reuses": self.ctx.stats.graph_reuses, "graph_rebuilds": self.ctx.stats.graph_rebuilds,
                "prefix_cache_entries": len(self.prefix_cache),
                "prefix_cache_hit_tokens": self.prefix_cache.hit_tokens,
                "prompt_tokens_computed": self.prompt_tokens_computed,
                "tokens_generated": self.tokens_generated,
            }

    # --- loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while (not self._stop and not self.queue and not self._pending
                       and not any(s.busy for s in self.slots)):
                    self._cv.wait()
                if self._stop:
                    return
                self._drop_cancelled()
                self._run_pending()
                self._admit()
            busy = [s for s in self.slots if s.busy]
            if busy:
                self._step_once(busy)

    def _drop_cancelled(self) -> None:
        for req in [r for r in self.queue if r.cancelled.is_set()]:
            self.queue.remove(req)
            self._release_adapters(req)
        for slot in self.slots:
            if slot.busy and slot.req.cancelled.is_set():
                log.info("request cancelled", request_id=slot.req.request_id, slot=slot.id)
                self._finish(slot, None)

    def _admit(self) -> None:
        while self.queue:
            free = [s for s in self.slots if not s.busy]
            if not free:
                return
            req = self.queue.popleft()
            slot = self._pick_slot(free, req)
            self._attach(slot, req)

    def _pick_slot(self, free: list[Slot], req: GenRequest) -> Slot:
        """llama policy: like llama-server's ``get_available_slot``, the idle slot whose cached
        tokens share the longest prefix with the prompt (tokens only: the adapter rule is
        applied after), else the least recently used. keyed policy: least recently used."""
        if self.config.prefix_cache == PrefixCachePolicy.LLAMA:
            def lcp(s: Slot) -> int:
                n = 0
                for a, b in zip(s.cache_tokens, req.prompt):
                    if a != b:
                        break
                    n += 1
                return n
            best = max(free, key=lambda s: (lcp(s), -s.last_used))
            if lcp(best) > 0:
                return best
        return min(free, key=lambda s: s.last_used)

    def _attach(self, slot: Slot, req: GenRequest) -> None:
        """``slot.assign``: an adapter-set change decides whether the slot's cache survives."""
        tel = req.telemetry
        tel.update(cache_cleared=False, cache_clear_reason="", cached_prompt_tokens=0)
        if self.config.prefix_cache == PrefixCachePolicy.LLAMA:
            cur_set = slot.last_set
            if slot.cache_tokens and cur_set is not None and lora_should_clear_cache(cur_set, req.adapter_set):
                tel.update(cache_cleared=True,
                           cache_clear_reason=f"adapter set changed ({cur_set.fingerprint} -> "
                                              f"{req.adapter_set.fingerprint}): lora_should_clear_cache")
                slot.cache_tokens, slot.cache_sets = [], []
            n = 0 if req.params.prompt_logprobs else slot.cached_prefix_for(req)
            self.ctx.kv.seq_rm(slot.id, n)  # n == 0 drops the whole sequence
        else:
            self.ctx.kv.seq_rm(slot.id)
            n = 0
            if not req.params.prompt_logprobs:
                limit = len(req.prompt) - 1
                if req.activation.start >= 0:
                    limit = min(limit, req.activation.start)  # positions >= start use another set
                n, entry = self.prefix_cache.lookup(req.activation.pre_set.fingerprint, req.prompt, limit)
                if entry is not None and n > 0:
                    self.ctx.kv.import_(slot.id, entry.kv, n)
        slot.cache_tokens = req.prompt[:n]
        slot.cache_sets = [req.set_at(p) for p in range(n)]
        slot.n_past = n
        tel["cached_prompt_tokens"] = n
        slot.assign(req)

    def _rows_for(self, slot: Slot, budget: int, compat: bool) -> list[int]:
        """Positions this slot feeds in the next ubatch."""
        req = slot.req
        if slot.state == SlotState.GENERATING:
            return [slot.n_past]
        end = min(len(req.prompt), slot.n_past + budget)
        s = req.activation.start
        if compat and s > slot.n_past:
            end = min(end, s)  # one adapter set per ubatch: split at the activation point
        return list(range(slot.n_past, end))

    def _step_once(self, busy: list[Slot]) -> None:
        compat = self.config.batching == Batching.COMPAT
        if compat:
            chosen = self._compat_group(busy)
        else:
            chosen = busy
        gen = [s for s in chosen if s.state == SlotState.GENERATING]
        prm = [s for s in chosen if s.state == SlotState.PROMPT]
        budget = N_BATCH - len(gen)
        plan: list[tuple[Slot, list[int]]] = []
        for s in gen + prm:
            rows = self._rows_for(s, max(budget, 1), compat)
            if s.state == SlotState.PROMPT:
                budget -= len(rows)
            if rows:
                plan.append((s, rows))
            if budget <= 0 and s.state == SlotState.PROMPT:
                break
        sets: list[AdapterSet] = []
        tokens, pos, seqs, want, set_idx = [], [], [], [], []
        for s, rows in plan:
            req = s.req
            for p in rows:
                tok = req.prompt[p] if p < len(req.prompt) else req.generated[p - len(req.prompt)]
                st = req.set_at(p)
                if st not in sets:
                    sets.append(st)
                tokens.append(tok)
                pos.append(p)
                seqs.append(s.id)
                # logits for the last prompt row and generated rows; every row for prompt_logprobs
                want.append(p >= len(req.prompt) - 1 or req.params.prompt_logprobs)
                set_idx.append(sets.index(st))
        order = sorted(range(len(sets)), key=lambda i: sets[i].fingerprint)
        remap = {old: new for new, old in enumerate(order)}
        sets = [sets[i] for i in order]
        set_idx = [remap[i] for i in set_idx]
        self.ctx.set_adapters(sets)
        t0 = time.monotonic()
        try:
            res = self.ctx.decode(UBatch(tokens, pos, seqs, want, set_idx))
        except (DecodeError, RuntimeError) as exc:
            log.error("decode failed", error=str(exc), slots=[s.id for s, _ in plan])
            for s, _ in plan:
                self._fail(s, DecodeFailedError(f"decode failed: {exc}"))
            return
        self._step += 1
        step = StepInfo(batch_size=len(plan), batch_tokens=len(tokens), n_adapter_sets=len(sets),
                        graph_reused=res.graph_reused, n_nodes=res.n_nodes, node_budget=self.ctx.node_budget,
                        batching=self.config.batching.value)
        row_of = {r: i for i, r in enumerate(res.out_rows)}
        i = 0
        for s, rows in plan:
            self._after_rows(s, rows, res.logits, row_of, i, step)
            i += len(rows)
        log.debug("step", n=len(tokens), slots=len(plan), sets=len(sets), ms=(time.monotonic() - t0) * 1000)

    def _compat_group(self, busy: list[Slot]) -> list[Slot]:
        oldest = min(busy, key=lambda s: (s.last_step, s.id))
        return [s for s in busy if s.can_batch_with(oldest)]

    def _after_rows(self, slot: Slot, rows: list[int], logits: torch.Tensor, row_of: dict[int, int],
                    first_row: int, step: StepInfo) -> None:
        req = slot.req
        slot.last_step = self._step
        n_prompt = len(req.prompt)
        for j, p in enumerate(rows):
            tok = req.prompt[p] if p < n_prompt else req.generated[p - n_prompt]
            slot.cache_tokens.append(tok)
            slot.cache_sets.append(req.set_at(p))
        slot.n_past = rows[-1] + 1
        if slot.state == SlotState.PROMPT:
            self.prompt_tokens_computed += len(rows)
            if req.params.prompt_logprobs:
                for j, p in enumerate(rows):
                    if p + 1 < n_prompt:
                        lg = logits[row_of[first_row + j]]
                        lp = torch.log_softmax(lg.float(), -1)[req.prompt[p + 1]]
                        req.prompt_logprobs.append((req.prompt[p + 1], float(lp)))
            if slot.n_past < n_prompt:
                return
            slot.state = SlotState.GENERATING
            plp = None
            if req.params.prompt_logprobs:
                plp = [None] + req.prompt_logprobs
            req.emit(StartedEvent(list(req.prompt), plp))
        out = logits[row_of[first_row + len(rows) - 1]]
        sampled = slot.sampler.sample(out)
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        req.generated.append(sampled.token_id)
        self.tokens_generated += 1
        self._count_step(req, step)
        text = self.tokenizer.decode(req.generated)
        safe = len(text) - 1 if text.endswith("\ufffd") else len(text)
        piece = text[req.text_sent:safe] if safe > req.text_sent else ""
        req.text_sent = max(req.text_sent, safe)
        req.emit(TokenEvent(sampled.token_id, piece, sampled.logprob, sampled.top, step))
        eog = sampled.token_id in self.tokenizer.eog_ids and not req.params.ignore_eos
        if eog:
            self._finish(slot, "stop")
        elif len(req.generated) >= req.params.max_tokens or slot.n_past + 1 >= self.config.n_ctx_slot:
            self._finish(slot, "length")

    @staticmethod
    def _count_step(req: GenRequest, step: StepInfo) -> None:
        t = req.telemetry
        key = "graph_reuses" if step.graph_reused else "graph_rebuilds"
        t[key] = t.get(key, 0) + 1
        t["max_batch_size"] = max(t.get("max_batch_size", 0), step.batch_size)
        t["max_adapter_sets_in_batch"] = max(t.get("max_adapter_sets_in_batch", 0), step.n_adapter_sets)

    def _store_prefix(self, slot: Slot, req: GenRequest) -> None:
        """keyed policy: save the cacheable prefix under the fingerprint that computed it."""
        n = slot.n_past
        start = req.activation.start
        if start >= 0:
            n, st = min(n, start), req.activation.pre_set
        else:
            st = req.adapter_set
        if n > 0 and self.ctx.kv.seq_len(slot.id) >= n:
            self.prefix_cache.store(st.fingerprint, slot.cache_tokens[:n], self.ctx.kv.export(slot.id, n))

    def _finish(self, slot: Slot, reason: str | None) -> None:
        req = slot.req
        if self.config.prefix_cache == PrefixCachePolicy.KEYED:
            self._store_prefix(slot, req)
            self.ctx.kv.seq_rm(slot.id)
            slot.cache_tokens, slot.cache_sets = [], []
        if reason is not None:
            now = time.monotonic()
            t = req.telemetry
            t.update(
                prompt_tokens=len(req.prompt), prefix_cache=self.config.prefix_cache.value,
                alora_activation_pos=req.activation.start, adapter_set_fingerprint=req.adapter_set.fingerprint,
                slot_id=slot.id, worker_id=self.worker_id,
                adapters=[(i, s) for i, _, s in req.adapter_set.entries],
                ttft_ms=((req.first_token_at or now) - req.admitted_at) * 1000,
                total_ms=(now - req.admitted_at) * 1000,
            )
            req.emit(FinishedEvent(reason, self.tokenizer.decode(req.generated), dict(t)))
        self._release_adapters(req)
        slot.release()

    def _fail(self, slot: Slot, error: WorkerError) -> None:
        req = slot.req
        req.emit(ErrorEvent(error))
        self.ctx.kv.seq_rm(slot.id)
        slot.cache_tokens, slot.cache_sets = [], []
        self._release_adapters(req)
        slot.release()

    def _release_adapters(self, req: GenRequest) -> None:
        with self._cv:
            for aid in req.held_ids:
                self._in_flight[aid] = self._in_flight.get(aid, 1) - 1
            req.held_ids = ()
            self._cv.notify_all()
