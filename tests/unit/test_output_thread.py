"""The output thread (``worker.serving.output.EmitWorker``) on the tiny llama-MoE model: a stop
string found a step late never leaks a token, cancellation mid-stream, many streams ending at
once, per-stream order. In-process engine, greedy decoding (deterministic ids)."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from loraplane.adapter_scales import NO_ADAPTERS
from worker.config import Batching, PrefixCachePolicy, WorkerConfig
from worker.runtime.sampling import SamplingParams
from worker.serving.engine import WorkerEngine
from worker.serving.output import EmitWorker
from worker.serving.request import ErrorEvent, FinishedEvent, StartedEvent, TokenEvent

PROMPT = [1, 450, 4996, 17354]


@pytest.fixture
def engine(fixtures_dir):
    made = []

    def make(n_slots: int = 4, **config) -> WorkerEngine:
        e = WorkerEngine(
            WorkerConfig(
                model_path=str(fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"),
                n_seqs=n_slots,
                batching=Batching.MIXED,
                prefix_cache=PrefixCachePolicy.LLAMA,
                device="cpu",
                n_ctx_seq=256,
                grammar_warmup=False,  # no structured output here
                **config,
            )
        )
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


class LaggingEmitWorker(EmitWorker):
    """Renders each step's tokens only once the next step's are handed over (or a request
    ends): every stop string is found exactly one step late, the case the rules allow."""

    def __init__(self, stage, observer, after_step):
        super().__init__(stage, observer, threaded=False, after_step=after_step)
        self.held: list[tuple] = []

    def _put(self, item: tuple) -> None:
        if item[0] == "started":
            self._handle(item)
            return
        for h in self.held:
            self._handle(h)
        self.held = []
        if item[0] == "tokens":
            self.held = [item]
        else:
            self._handle(item)


def _submit(e: WorkerEngine, rid: str, params: SamplingParams, q: queue.Queue, prompt=PROMPT):
    return e.submit(
        request_id=rid,
        prompt_tokens=list(prompt),
        prompt_text=None,
        params=params,
        adapters=NO_ADAPTERS,
        emit=lambda ev, rid=rid: q.put((rid, ev)),
    )


def _collect(q: queue.Queue, rids: set[str], timeout: float = 120) -> dict[str, list]:
    """Every request's events, in arrival order, until each has its final event."""
    out: dict[str, list] = {r: [] for r in rids}
    open_ = set(rids)
    deadline = time.monotonic() + timeout
    while open_:
        rid, ev = q.get(timeout=max(1.0, deadline - time.monotonic()))
        out[rid].append(ev)
        if isinstance(ev, FinishedEvent | ErrorEvent):
            open_.discard(rid)
    return out


def _generate(e: WorkerEngine, params: SamplingParams) -> tuple[list[int], list[str], FinishedEvent]:
    q: queue.Queue = queue.Queue()
    _submit(e, "ref", params, q)
    evs = _collect(q, {"ref"})["ref"]
    toks = [ev for ev in evs if isinstance(ev, TokenEvent)]
    return [t.token_id for t in toks], [t.text for t in toks], evs[-1]


def _metric(e: WorkerEngine, name: str, **labels) -> float:
    return e.metrics.registry.get_sample_value("loraplane_worker_" + name, labels) or 0.0


def _stop_at(pieces: list[str]) -> tuple[int, str, str]:
    """A stop string that the generated text first contains at token ``j`` (its whole piece,
    from a token after the third): ``(j, stop, text before it)``."""
    text = "".join(pieces)
    for j in range(3, len(pieces) - 2):
        start = sum(len(p) for p in pieces[:j])
        if pieces[j].strip() and text.find(pieces[j]) == start:
            return j, pieces[j], text[:start]
    raise AssertionError(f"no usable stop string in {pieces!r}")


def test_stop_string_found_a_step_late_never_leaks(engine):
    """The output thread sees the stop string one step after the token that completes it was
    sampled (forced: ``LaggingEmitWorker``); the scheduler has sampled one more token by then.
    That token never reaches the response: not in the events, the final text, the request's
    ids, the worker's token count nor the metrics; the finish reason is "stop" and the KV
    sequence keeps what an immediate stop would have left (the llama policy reuses it)."""
    e = engine()
    ids, pieces, fin = _generate(e, SamplingParams(max_tokens=24, ignore_eos=True))
    assert len(ids) == 24 and fin.finish_reason == "length"
    j, stop, before = _stop_at(pieces)
    base_tokens = e.stats().scheduler.tokens_generated
    base_metric = _metric(e, "generation_tokens_total", adapter="none")

    s = e.scheduler
    s.emitter.close()
    s.emitter = LaggingEmitWorker(s.output, lambda: s.observer, s.steps.n_steps)
    q: queue.Queue = queue.Queue()
    req = _submit(e, "stopped", SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,)), q)
    evs = _collect(q, {"stopped"})["stopped"]

    assert isinstance(evs[0], StartedEvent) and isinstance(evs[-1], FinishedEvent)
    toks = [ev for ev in evs[1:-1] if isinstance(ev, TokenEvent)]
    assert len(toks) == len(evs) - 2
    assert [t.token_id for t in toks] == ids[: j + 1]  # up to the token completing the stop
    assert "".join(t.text for t in toks) == before == evs[-1].text
    assert evs[-1].finish_reason == "stop"
    assert s.emitter.dropped == 1  # the token sampled past the stop: cut, one step late
    assert req.generated == ids[: j + 1]
    assert e.stats().scheduler.tokens_generated - base_tokens == j + 1
    assert _metric(e, "generation_tokens_total", adapter="none") - base_metric == j + 1
    assert _metric(e, "requests_total", outcome="stop", adapter="none") == 1
    # the same prompt went to the reference run's sequence (longest common prefix); it keeps
    # the positions an immediate stop leaves: the stop token itself was never fed back
    (sq,) = [sq for sq in s.seqs if sq.cache_tokens]
    assert sq.cache_tokens == PROMPT + ids[:j] and s.ctx.kv.seq_len(sq.id) == len(PROMPT) + j


def test_stop_string_on_the_output_thread_matches_inline(engine):
    """The threaded output stage and the inline one (text work on the loop) give the same
    events for a stop-string request, whether the stop is seen at once or a step late."""
    e = engine()
    _, pieces, _ = _generate(e, SamplingParams(max_tokens=24, ignore_eos=True))
    _, stop, before = _stop_at(pieces)
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,), logprobs=2)
    threaded = _generate(e, params)
    e.scheduler.use_output_thread(False)
    inline = _generate(e, params)
    assert threaded[0] == inline[0] and threaded[1] == inline[1]
    assert threaded[2].text == inline[2].text == before and threaded[2].finish_reason == "stop"


def test_cancel_mid_stream_frees_the_sequence(engine):
    """A request cancelled after a few tokens gets no final event, is counted "cancelled",
    frees its sequence, and the next request runs to the end with the reference tokens."""
    e = engine(n_slots=1)
    ref_ids, _, _ = _generate(e, SamplingParams(max_tokens=6, ignore_eos=True))
    q: queue.Queue = queue.Queue()
    req = _submit(e, "long", SamplingParams(max_tokens=200, ignore_eos=True), q)
    seen = []
    while len(seen) < 4:
        seen.append(q.get(timeout=60)[1])
    req.cancelled.set()
    e.scheduler.wake()
    got = _generate(e, SamplingParams(max_tokens=6, ignore_eos=True))  # waits for the one slot
    assert got[0] == ref_ids and got[2].finish_reason == "length"
    late = []
    while not q.empty():
        late.append(q.get_nowait()[1])
    assert not any(isinstance(ev, FinishedEvent | ErrorEvent) for ev in seen + late)
    toks = [ev for ev in seen + late if isinstance(ev, TokenEvent)]
    assert 3 <= len(toks) < 200 and [t.token_id for t in toks] == req.generated[: len(toks)]
    assert _metric(e, "requests_total", outcome="cancelled", adapter="none") == 1
    assert e.stats().scheduler.slots_busy == 0


def test_many_streams_finish_at_once_in_order(engine):
    """16 streams admitted together, 12 ending on ``max_tokens`` at the same step and 4 on a
    stop string: each stream gets Started, its tokens in order (the ids a lone run gives),
    then one Finished whose text is its tokens' text, and nothing after."""
    e = engine(n_slots=16)
    ref_ids, pieces, ref_fin = _generate(e, SamplingParams(max_tokens=12, ignore_eos=True))
    j, stop, before = _stop_at(pieces)
    q: queue.Queue = queue.Queue()
    gate = threading.Event()
    e.scheduler.run_soon(lambda: gate.wait(30))  # all queued before the first admission
    try:
        for i in range(16):
            p = SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,) if i % 4 == 0 else ())
            _submit(e, f"r{i}", p, q)
    finally:
        gate.set()
    out = _collect(q, {f"r{i}" for i in range(16)})
    e.scheduler.stop()  # renders whatever is still queued: nothing may follow a Finished
    assert q.empty()
    for i in range(16):
        evs = out[f"r{i}"]
        assert isinstance(evs[0], StartedEvent) and isinstance(evs[-1], FinishedEvent)
        toks = evs[1:-1]
        assert all(isinstance(t, TokenEvent) for t in toks)
        if i % 4 == 0:
            assert [t.token_id for t in toks] == ref_ids[: j + 1] and evs[-1].finish_reason == "stop"
            assert "".join(t.text for t in toks) == evs[-1].text == before
        else:
            assert [t.token_id for t in toks] == ref_ids and evs[-1].finish_reason == "length"
            assert "".join(t.text for t in toks) == evs[-1].text == ref_fin.text
            assert max(t.step.batch_size for t in toks) == 16
    assert e.stats().scheduler.slots_busy == 0


def test_a_slow_output_thread_holds_the_loop_to_one_token_past_a_stop(engine):
    """The output thread lags (each token's emit sleeps 50 ms while the tiny model steps in a
    few ms): with a stop-string request running the loop waits for it before each step, so at
    most one token past the stop string is ever sampled, and none reaches the response."""
    e = engine()
    ids, pieces, _ = _generate(e, SamplingParams(max_tokens=24, ignore_eos=True))
    j, stop, before = _stop_at(pieces)
    q: queue.Queue = queue.Queue()

    def slow(ev, q=q):
        if isinstance(ev, TokenEvent):
            time.sleep(0.05)
        q.put(("slow", ev))

    e.submit(
        request_id="slow",
        prompt_tokens=list(PROMPT),
        prompt_text=None,
        params=SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,)),
        adapters=NO_ADAPTERS,
        emit=slow,
    )
    evs = _collect(q, {"slow"})["slow"]
    assert [ev.token_id for ev in evs if isinstance(ev, TokenEvent)] == ids[: j + 1]
    assert evs[-1].text == before and evs[-1].finish_reason == "stop"
    assert e.scheduler.emitter.dropped <= 1
