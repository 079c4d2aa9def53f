"""Scheduler fairness and batching rules, on the tiny llama-MoE model (fast, in-process)."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from worker.config import Batching, PrefixCachePolicy, WorkerConfig
from worker.errors import QueueFullError
from worker.rpc.status import status_of
from worker.runtime.sampling import SamplingParams
from worker.serving.engine import WorkerEngine
from worker.serving.request import FinishedEvent, TokenEvent


@pytest.fixture
def engine_for(fixtures_dir):
    made = []

    def make(batching: Batching, n_slots: int = 4, queue_limit: int = 64) -> WorkerEngine:
        e = WorkerEngine(
            WorkerConfig(
                model_path=str(fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"),
                n_slots=n_slots,
                batching=batching,
                prefix_cache=PrefixCachePolicy.LLAMA,
                device="cpu",
                n_ctx_slot=256,
                queue_limit=queue_limit,
            )
        )
        e.load_adapter(0, path=str(fixtures_dir / "tiny_moe" / "moe_lora.gguf"))
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def _submit_all(engine: WorkerEngine, specs, max_tokens: int, q: queue.Queue) -> None:
    for rid, entries in specs:
        engine.submit(
            request_id=rid,
            prompt_tokens=[1, 450, 4996, 17354],
            prompt_text=None,
            params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            entries=entries,
            emit=lambda ev, rid=rid: q.put((rid, ev)),
        )


def _run(engine: WorkerEngine, specs: list[tuple[str, list[tuple[int, float]]]], max_tokens: int = 8):
    """Submit all at once; return per request the ordered (global event index, event) list.

    The scheduler's loop thread is held (a deferred function waiting on a gate) while the
    requests are submitted, so they are all queued before the first admission: without it the
    first request may run a few steps alone, depending on thread timing."""
    q: queue.Queue = queue.Queue()
    gate = threading.Event()
    engine.scheduler.run_soon(lambda: gate.wait(30))
    try:
        _submit_all(engine, specs, max_tokens, q)
    finally:
        gate.set()
    out: dict[str, list] = {rid: [] for rid, _ in specs}
    done, i = 0, 0
    deadline = time.monotonic() + 120
    while done < len(specs):
        rid, ev = q.get(timeout=max(1.0, deadline - time.monotonic()))
        out[rid].append((i, ev))
        i += 1
        done += isinstance(ev, FinishedEvent)
    return out


def test_compat_mode_rare_adapter_is_not_starved(engine_for):
    """Three slots on adapter 0 and one on the base: compat batches them apart, but the groups
    take turns, so the lone base request progresses step by step alongside the others."""
    e = engine_for(Batching.COMPAT)
    specs = [("a1", [(0, 1.0)]), ("a2", [(0, 1.0)]), ("a3", [(0, 1.0)]), ("base", [])]
    out = _run(e, specs)
    tok = {rid: [i for i, ev in evs if isinstance(ev, TokenEvent)] for rid, evs in out.items()}
    for _rid, evs in out.items():
        steps = [ev.step for _, ev in evs if isinstance(ev, TokenEvent)]
        assert all(s.n_adapter_sets == 1 for s in steps)
        assert len(steps) == 8
    a_steps = [ev.step.batch_size for _, ev in out["a1"] if isinstance(ev, TokenEvent)]
    assert max(a_steps) == 3  # the three adapter-0 slots share batches
    # turn-taking: the base request's tokens are spread across the run, not all at the end
    first_a_done = min(max(tok[r]) for r in ("a1", "a2", "a3"))
    assert sum(i < first_a_done for i in tok["base"]) >= 7, tok


def test_mixed_mode_one_batch_for_all_sets(engine_for):
    e = engine_for(Batching.MIXED)
    out = _run(e, [("a", [(0, 1.0)]), ("half", [(0, 0.5)]), ("base", [])])
    steps = [ev.step for _, ev in out["a"] if isinstance(ev, TokenEvent)]
    assert max(s.n_adapter_sets for s in steps) == 3 and max(s.batch_size for s in steps) == 3
    # the same requests alone give the same tokens
    for rid, entries in [("a", [(0, 1.0)]), ("half", [(0, 0.5)]), ("base", [])]:
        alone = _run(e, [(rid + "-alone", entries)])
        ids = lambda evs: [ev.token_id for _, ev in evs if isinstance(ev, TokenEvent)]  # noqa: E731
        assert ids(alone[rid + "-alone"]) == ids(out[rid])


def test_queue_limit_answers_resource_exhausted(engine_for):
    e = engine_for(Batching.MIXED, n_slots=1, queue_limit=1)
    e.scheduler.stop()  # hold the loop so the queue cannot drain while we fill it
    sink = lambda ev: None  # noqa: E731
    params = SamplingParams(max_tokens=2)
    # capacity = 1 slot + 1 queue place: q1 is the free slot's (not "waiting"), q2 waits
    for rid in ("q1", "q2"):
        e.submit(request_id=rid, prompt_tokens=[1, 2], prompt_text=None, params=params, entries=[], emit=sink)
    with pytest.raises(QueueFullError) as err:
        e.submit(request_id="q3", prompt_tokens=[1, 2], prompt_text=None, params=params, entries=[], emit=sink)
    assert status_of(err.value).name == "RESOURCE_EXHAUSTED"
    assert "queue full (0/1 slots busy, 2 queued; admits slots + --queue-limit 1)" in str(err.value)


def test_every_worker_error_has_one_status():
    """The one table: every concrete WorkerError class maps to a status code, none to INTERNAL
    by accident (only a decode fault is INTERNAL)."""
    import inspect

    from worker import errors

    classes = [
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, errors.WorkerError) and c is not errors.WorkerError
    ]
    assert len(classes) >= 8
    codes = {c.__name__: status_of(c("x")).name for c in classes}
    assert codes["QueueFullError"] == "RESOURCE_EXHAUSTED"
    assert codes["AdapterNotFoundError"] == "NOT_FOUND"
    assert [n for n, code in codes.items() if code == "INTERNAL"] == ["DecodeFailedError"]
    with pytest.raises(KeyError):
        status_of(type("Unlisted", (errors.WorkerError,), {})("x"))
