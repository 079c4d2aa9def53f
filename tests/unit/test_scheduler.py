"""Scheduler fairness and batching rules, on the tiny llama-MoE model (fast, in-process)."""

from __future__ import annotations

import hashlib
import queue
import shutil
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from loraplane.adapter_scales import NO_ADAPTERS, AdapterScales
from worker.config import Batching, PrefixCachePolicy, WorkerConfig
from worker.errors import AdapterFetchError, DecodeFailedError, QueueFullError
from worker.rpc.status import status_of
from worker.runtime.sampling import SamplingParams
from worker.serving.admission import MAX_BYPASS
from worker.serving.engine import WorkerEngine
from worker.serving.request import ErrorEvent, FinishedEvent, RequestTenant, TokenEvent


@pytest.fixture
def engine_for(fixtures_dir):
    made = []

    def make(batching: Batching, n_slots: int = 4, queue_limit: int = 64, **config) -> WorkerEngine:
        e = WorkerEngine(
            WorkerConfig(
                model_path=str(fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"),
                n_seqs=n_slots,
                batching=batching,
                prefix_cache=PrefixCachePolicy.LLAMA,
                device="cpu",
                n_ctx_seq=256,
                queue_limit=queue_limit,
                grammar_warmup=False,  # no structured output here
                **config,
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
            adapters=AdapterScales(entries),
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
        e.submit(request_id=rid, prompt_tokens=[1, 2], prompt_text=None, params=params, adapters=NO_ADAPTERS, emit=sink)
    with pytest.raises(QueueFullError) as err:  # another tenant too: --fairness off has no queue shares
        e.submit(
            request_id="q3",
            prompt_tokens=[1, 2],
            prompt_text=None,
            params=params,
            adapters=NO_ADAPTERS,
            emit=sink,
            tenant=RequestTenant("light"),
        )
    assert status_of(err.value).name == "RESOURCE_EXHAUSTED"
    assert "queue full (0/1 KV sequences busy, 2 queued; admits --slots + --queue-limit 1)" in str(err.value)


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


# --- how requests end, and what the metrics see -------------------------------------------
PROMPT = [1, 450, 4996, 17354]


def _requests_total(engine: WorkerEngine, outcome: str, adapter: str) -> float:
    """``loraplane_worker_requests_total{outcome, adapter}`` from the engine's own registry."""
    v = engine.metrics.registry.get_sample_value(
        "loraplane_worker_requests_total", {"outcome": outcome, "adapter": adapter}
    )
    return 0.0 if v is None else v


def _until_end(q: queue.Queue, timeout: float = 60.0) -> list:
    """Events of one request until its FinishedEvent or ErrorEvent."""
    out: list = []
    while not out or not isinstance(out[-1], FinishedEvent | ErrorEvent):
        out.append(q.get(timeout=timeout))
    return out


def _generate(engine: WorkerEngine, rid: str, entries, max_tokens: int = 3) -> list:
    q: queue.Queue = queue.Queue()
    engine.submit(
        request_id=rid,
        prompt_tokens=PROMPT,
        prompt_text=None,
        params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        adapters=AdapterScales(entries),
        emit=q.put,
    )
    return _until_end(q)


def _write_llama_adapter(path: Path, seed: int) -> Path:
    """A rank-2 adapter on ``blk.0.attn_q.weight`` of the tiny llama-MoE (W ne [64, 64])."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 4.0)
    w.add_name(f"tiny{seed}")
    rng = np.random.default_rng(seed)
    w.add_tensor("blk.0.attn_q.weight.lora_a", rng.standard_normal((2, 64)).astype(np.float32))
    w.add_tensor("blk.0.attn_q.weight.lora_b", rng.standard_normal((64, 2)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_attach_failure_ends_the_request_through_the_one_exit(engine_for):
    """A fault while attaching a request to its slot (the prefix-cache step) fails that
    request only, and now counts like every other error: requests_total{outcome="error"}
    for its adapter, its slot hold and request hold dropped, its slot free for the next."""
    e = engine_for(Batching.MIXED, n_slots=1)
    sha = e.adapters()[0].sha256
    policy = e.scheduler.cache_policy
    real_attach = policy.attach

    def attach(seq, req, kv):
        if req.request_id == "bad":
            raise RuntimeError("KV import failed")
        return real_attach(seq, req, kv)

    policy.attach = attach  # type: ignore[method-assign]
    assert _requests_total(e, "error", "0") == 0
    events = _generate(e, "bad", [(0, 1.0)])
    assert len(events) == 1 and isinstance(events[0].error, DecodeFailedError)
    assert "attaching the request to KV sequence 0 failed" in str(events[0].error)
    assert status_of(events[0].error).name == "INTERNAL"
    # the observer runs right after the event, on the loop thread
    deadline = time.monotonic() + 10
    while _requests_total(e, "error", "0") < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _requests_total(e, "error", "0") == 1
    assert not e.scheduler.holds.is_held(0) and e.ctx.pool.held(sha) == 0
    assert e.scheduler.stats().slots_busy == 0
    # the slot serves the next request, which finishes normally and is counted as such
    ok = _generate(e, "good", [(0, 1.0)])
    assert isinstance(ok[-1], FinishedEvent) and ok[-1].finish_reason == "length"
    deadline = time.monotonic() + 10
    while _requests_total(e, "length", "0") < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _requests_total(e, "length", "0") == 1 and _requests_total(e, "error", "0") == 1
    e.unload_adapter(0, timeout_s=10)  # nothing holds it any more


def test_page_in_failure_ends_the_request_with_an_error_and_counts_it(engine_for, tmp_path):
    """An adapter whose file changed on disk after validation cannot be paged in again: its
    request ends with AdapterFetchError (no mock: the file really changed), is counted in
    requests_total{outcome="error"}, and leaves no hold behind."""
    e = engine_for(Batching.MIXED, n_slots=1, max_loras=1, max_cpu_loras=2)
    path_a = shutil.copy(Path(e.adapters()[0].source.path), tmp_path / "a.gguf")  # type: ignore[union-attr]
    e.load_adapter(1, path=str(path_a))
    e.load_adapter(2, path=str(_write_llama_adapter(tmp_path / "b.gguf", seed=1)))
    assert isinstance(_generate(e, "warm", [(1, 1.0)])[-1], FinishedEvent)  # adapter 1 resident
    qa: queue.Queue = queue.Queue()
    qb: queue.Queue = queue.Queue()
    gate = threading.Event()
    e.scheduler.run_soon(lambda: gate.wait(30))  # queue both before any admission
    try:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        rb = e.submit(
            request_id="b",
            prompt_tokens=PROMPT,
            prompt_text=None,
            params=params,
            adapters=AdapterScales([(2, 1.0)]),
            emit=qb.put,
        )
        # adapter 1 is resident now, so nothing is read ahead for "a": its page-in re-reads the file
        e.submit(
            request_id="a",
            prompt_tokens=PROMPT,
            prompt_text=None,
            params=params,
            adapters=AdapterScales([(1, 1.0)]),
            emit=qa.put,
        )
        rb.bypassed = MAX_BYPASS  # "b" goes first (bounded waiting), evicting adapter 1 from the one slot
        with open(path_a, "ab") as f:
            f.write(b"\0")  # the file changes after validation
    finally:
        gate.set()
    assert isinstance(_until_end(qb)[-1], FinishedEvent)
    events = _until_end(qa)
    assert len(events) == 1 and isinstance(events[0].error, AdapterFetchError)
    assert "paging the adapter in failed" in str(events[0].error) and "changed on disk" in str(events[0].error)
    deadline = time.monotonic() + 10
    while _requests_total(e, "error", "1") < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _requests_total(e, "error", "1") == 1
    assert not e.scheduler.holds.is_held(1) and e.scheduler.stats().slots_busy == 0


def test_adapters_being_submitted_stay_on_host_with_their_files(engine_for, tmp_path):
    """The host tier (capacity 2 here) may drop an entry while another request is still
    being submitted; the request's adapters are held from before they are fetched until the
    scheduler counts the request, so the entry dropped is another one and the fetched copy
    the request reads ahead at submit is still there."""
    e = engine_for(Batching.MIXED, n_slots=2, max_loras=2, max_cpu_loras=2)
    e.unload_adapter(0, timeout_s=10)
    files = {i: _write_llama_adapter(tmp_path / f"f{i}.gguf", seed=10 + i) for i in (0, 1, 2)}
    sha = {i: hashlib.sha256(files[i].read_bytes()).hexdigest() for i in files}
    by_sha = {sha[i]: files[i] for i in files}

    def fetcher(digest: str):
        if digest == sha[1]:
            # Meanwhile another caller registers adapter 2: the host tier holds 0, 2, then 1.
            e.load_adapter(2, path=str(files[2]))
        yield by_sha[digest].read_bytes()

    e.fetcher = fetcher
    for i in (0, 1):
        e.load_adapter(i, sha256=sha[i], fetch_on_demand=True)
    events = _generate(e, "r", [(0, 1.0), (1, 1.0)])
    assert isinstance(events[-1], FinishedEvent), events[-1]
    sources = {r.id: r.source for r in events[-1].telemetry.adapter_residency}
    assert sources == {0: "fetched", 1: "fetched"}
    st = e.stats()
    assert st.host_evictions == 1 and st.fetches == 2
    assert sorted(st.host_adapter_ids) == [0, 1]  # 2 was dropped, not 0 (held by the request)
    assert (e.host.cache_dir / f"{sha[0]}.gguf").is_file()


# --- faults inside a step: contained; the loop stopping for good: unhealthy and exiting ---------


def _tokens(events: list) -> list[int]:
    return [ev.token_id for ev in events if isinstance(ev, TokenEvent)]


def _assert_no_leak(e: WorkerEngine, sha: str) -> None:
    """Every slot free, nothing queued, no slot or request hold left, and each KV sequence
    holding exactly what its sequence's cache records (an error drops both)."""
    st = e.scheduler.stats()
    assert (st.slots_busy, st.queue_depth) == (0, 0)
    assert e.ctx.pool.held(sha) == 0 and not e.scheduler.holds.is_held(0)
    for seq in e.scheduler.seqs:
        assert not seq.busy
        assert e.ctx.kv.seq_len(seq.id) == len(seq.cache_tokens) == len(seq.cache_sets), seq.id


def test_a_fault_in_a_step_fails_that_step_only_and_the_loop_serves_on(engine_for):
    """An exception inside a step (here sampling, injected for one request id) fails every
    request of that step with INTERNAL naming the error — the faulty one and its batch peer —
    frees their slots, holds and KV sequences, and the loop goes on: a request queued behind
    them and the next one are served with the greedy reference's exact tokens."""
    e = engine_for(Batching.MIXED, n_slots=2)
    sha = e.adapters()[0].sha256
    ref = _tokens(_generate(e, "ref", [(0, 1.0)], max_tokens=6))
    assert len(ref) == 6
    real_sample = e.scheduler.output.sample

    def sample(req, *args, **kwargs):
        if req.request_id == "bad":
            raise RuntimeError("injected sampling fault")
        return real_sample(req, *args, **kwargs)

    e.scheduler.output.sample = sample  # type: ignore[method-assign]
    queues = {rid: queue.Queue() for rid in ("peer", "bad", "queued")}
    gate = threading.Event()
    e.scheduler.run_soon(lambda: gate.wait(30))  # all three queued before the first admission
    try:
        for rid, q in queues.items():
            e.submit(
                request_id=rid,
                prompt_tokens=PROMPT,
                prompt_text=None,
                params=SamplingParams(max_tokens=6, ignore_eos=True),
                adapters=AdapterScales([(0, 1.0)]),
                emit=q.put,
            )
    finally:
        gate.set()
    for rid in ("peer", "bad"):  # one step: both rows fail, the faulty one and its peer
        events = _until_end(queues[rid])
        assert isinstance(events[-1], ErrorEvent) and _tokens(events) == [], rid
        assert status_of(events[-1].error).name == "INTERNAL"
        assert "RuntimeError: injected sampling fault" in str(events[-1].error)
        assert e.worker_id in str(events[-1].error)
    queued = _until_end(queues["queued"])  # was not in the failed step: untouched
    assert isinstance(queued[-1], FinishedEvent) and _tokens(queued) == ref
    after = _generate(e, "after", [(0, 1.0)], max_tokens=6)
    assert isinstance(after[-1], FinishedEvent) and _tokens(after) == ref
    assert e.scheduler._thread.is_alive() and e.scheduler.failure is None and e.scheduler.step_failures == 0
    deadline = time.monotonic() + 10
    while _requests_total(e, "length", "0") < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _requests_total(e, "error", "0") == 2 and _requests_total(e, "length", "0") == 3
    _assert_no_leak(e, sha)
    e.unload_adapter(0, timeout_s=10)  # nothing holds it any more


def test_a_failing_forward_pass_fails_its_requests_and_counts_in_a_row(engine_for):
    """The forward pass itself raising (a kernel error, out of memory): the step's requests
    fail INTERNAL, the failures-in-a-row counter rises, and one good step resets it."""
    e = engine_for(Batching.MIXED, n_slots=1)
    sha = e.adapters()[0].sha256
    real_decode = e.ctx.decode
    fail = {"n": 2}

    def decode(ub):
        if fail["n"] > 0:
            fail["n"] -= 1
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return real_decode(ub)

    e.ctx.decode = decode  # type: ignore[method-assign]
    for rid in ("f1", "f2"):
        events = _until_end_q(e, rid)
        assert isinstance(events[-1], ErrorEvent) and "OutOfMemoryError" in str(events[-1].error)
    assert e.scheduler.step_failures == 2 and e.scheduler.failure is None
    ok = _until_end_q(e, "ok")
    assert isinstance(ok[-1], FinishedEvent) and len(_tokens(ok)) == 3
    assert e.scheduler.step_failures == 0
    _assert_no_leak(e, sha)


def _until_end_q(e: WorkerEngine, rid: str) -> list:
    return _generate(e, rid, [(0, 1.0)], max_tokens=3)


def test_the_loop_stopping_for_good_marks_the_worker_unhealthy(fixtures_dir):
    """MAX_STEP_FAILURES failed steps in a row (a broken device): the loop stops for good, and
    the worker says so instead of looking alive — gRPC health NOT_SERVING on the real port,
    new requests refused UNAVAILABLE (the control plane retries elsewhere), the request
    queued at that moment failed UNAVAILABLE, a deferred call failed, and ``serve_worker`` then
    exits non-zero (``SchedulerStoppedError``: the process test is in the slow tier)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from worker.errors import WorkerDrainingError
    from worker.rpc.server import create_server
    from worker.serving.scheduler import MAX_STEP_FAILURES

    config = WorkerConfig(
        model_path=str(fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"),
        addr="127.0.0.1:0",
        n_seqs=1,
        device="cpu",
        n_ctx_seq=256,
        grammar_warmup=False,
    )
    server, port, e = create_server(config)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)

        def status() -> int:
            return health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status

        assert status() == health_pb2.HealthCheckResponse.SERVING

        def decode(ub):
            raise RuntimeError("injected: device lost")

        e.ctx.decode = decode  # type: ignore[method-assign]
        fatal: list[BaseException] = []
        e.scheduler.on_fatal.append(fatal.append)
        queues = {f"r{i}": queue.Queue() for i in range(MAX_STEP_FAILURES + 1)}
        gate = threading.Event()
        e.scheduler.run_soon(lambda: gate.wait(30))
        try:
            for rid, q in queues.items():
                e.submit(
                    request_id=rid,
                    prompt_tokens=PROMPT,
                    prompt_text=None,
                    params=SamplingParams(max_tokens=3, ignore_eos=True),
                    adapters=NO_ADAPTERS,
                    emit=q.put,
                )
        finally:
            gate.set()
        ends = {rid: _until_end(q)[-1] for rid, q in queues.items()}
        assert all(isinstance(ev, ErrorEvent) for ev in ends.values())
        *stepped, last = queues
        assert [status_of(ends[r].error).name for r in stepped] == ["INTERNAL"] * MAX_STEP_FAILURES
        assert "injected: device lost" in str(ends[stepped[-1]].error)
        assert status_of(ends[last].error).name == "UNAVAILABLE"  # queued: never started
        assert "scheduler stopped" in str(ends[last].error)
        e.scheduler._thread.join(10)
        assert not e.scheduler._thread.is_alive()
        assert isinstance(e.scheduler.failure, RuntimeError) and fatal == [e.scheduler.failure]
        assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
        assert status_of(WorkerDrainingError("x")).name == "UNAVAILABLE"
        with pytest.raises(WorkerDrainingError, match="draining"):
            e.submit(
                request_id="late",
                prompt_tokens=PROMPT,
                prompt_text=None,
                params=SamplingParams(max_tokens=3),
                adapters=NO_ADAPTERS,
                emit=lambda ev: None,
            )
        with pytest.raises(WorkerDrainingError, match="scheduler stopped"):
            e.scheduler.run_soon(lambda: None).result(10)
        assert e.scheduler.stats().slots_busy == 0 and e.scheduler.stats().queue_depth == 0
    finally:
        channel.close()
        server.stop(0).wait()
        e.close()


def test_a_fault_outside_a_step_stops_the_loop_and_fails_what_it_held(engine_for):
    """An exception in the loop's own bookkeeping (outside a step: state may be inconsistent)
    stops the loop at once — no retry — and fails the running request INTERNAL, and the
    ``on_fatal`` callbacks run (the worker process marks itself unhealthy and exits)."""
    e = engine_for(Batching.MIXED, n_slots=1)
    fatal: list[BaseException] = []
    e.scheduler.on_fatal.append(fatal.append)

    def broken() -> None:  # once the request runs (after its first step)
        if any(s.busy for s in e.scheduler.seqs):
            raise KeyError("injected bookkeeping fault")

    e.scheduler._bound_stop_delay = broken  # type: ignore[method-assign]
    events = _generate(e, "victim", [(0, 1.0)])
    assert isinstance(events[-1], ErrorEvent) and status_of(events[-1].error).name == "INTERNAL"
    assert "scheduler stopped (KeyError" in str(events[-1].error)
    e.scheduler._thread.join(10)
    assert not e.scheduler._thread.is_alive() and fatal == [e.scheduler.failure]
    assert e.scheduler.stats().slots_busy == 0 and not e.scheduler.holds.is_held(0)


def _run_params(engine: WorkerEngine, specs: list[tuple[str, list[tuple[int, float]], SamplingParams]]) -> dict:
    """Submit ``(rid, adapter entries, params)`` all at once (the loop held, as `_run`); the
    generated token ids per request."""
    q: queue.Queue = queue.Queue()
    gate = threading.Event()
    engine.scheduler.run_soon(lambda: gate.wait(30))
    try:
        for rid, entries, params in specs:
            engine.submit(
                request_id=rid,
                prompt_tokens=[1, 450, 4996, 17354],
                prompt_text=None,
                params=params,
                adapters=AdapterScales(entries),
                emit=lambda ev, rid=rid: q.put((rid, ev)),
            )
    finally:
        gate.set()
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in specs}
    done = 0
    while done < len(specs):
        rid, ev = q.get(timeout=120)
        assert not isinstance(ev, ErrorEvent), ev
        if isinstance(ev, TokenEvent):
            out[rid].append(ev.token_id)
        done += isinstance(ev, FinishedEvent)
    return out


def test_penalties_apply_per_row_in_a_mixed_batch(engine_for):
    """Rows with different penalties and different adapters in one step: each row's tokens equal
    the same request run alone (the penalty step is per row), and the penalties really act: the
    plain greedy runs never repeat a token in 8 steps (a random tiny model), a huge repetition
    penalty leaves such a run unchanged (it only lowers seen tokens), while negative presence /
    frequency penalties make the run repeat an output token."""
    e = engine_for(Batching.MIXED)
    plain = SamplingParams(max_tokens=8, ignore_eos=True)
    rep = SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1e4)
    pres = SamplingParams(max_tokens=8, ignore_eos=True, presence_penalty=-2.0, frequency_penalty=-2.0)
    specs = [
        ("a", [(0, 1.0)], plain),
        ("a-rep", [(0, 1.0)], rep),
        ("base", [], plain),
        ("base-pres", [], pres),
    ]
    together = _run_params(e, specs)
    alone = _run_params(e, [("alone", [], pres)])["alone"]
    assert alone == together["base-pres"]
    prompt = [1, 450, 4996, 17354]
    for rid in ("a", "base"):
        assert len(set(together[rid])) == 8 and not set(together[rid]) & set(prompt)
    assert together["a-rep"] == together["a"]
    ref, pen = together["base"], together["base-pres"]
    first = next(i for i, t in enumerate(pen) if t in pen[:i])  # the first repeat
    assert pen != ref and len(set(pen)) < 8 and first >= 1, (ref, pen)


# --- fair admission (--fairness vtc) --------------------------------------------------------
@pytest.mark.parametrize("fairness", ["off", "vtc"])
def test_fair_admission_puts_a_light_tenant_before_a_heavy_backlog(engine_for, fairness):
    """One slot; a heavy tenant queues four requests, then a light tenant one, all while the
    loop is held. Off: first come, first served. vtc: the light tenant (lifted to the heavy
    one's counter, 0) goes right after the heavy one's first request, which charged its
    prompt; counters in ``stats`` follow (prompt 4 x 1 + 3 tokens x 2 per request)."""
    from worker.config import Fairness
    from worker.serving.request import RequestTenant

    e = engine_for(Batching.MIXED, n_slots=1, fairness=Fairness(fairness))
    q: queue.Queue = queue.Queue()
    gate = threading.Event()
    e.scheduler.run_soon(lambda: gate.wait(30))
    specs = [(f"h{i}", RequestTenant("heavy")) for i in range(4)] + [("l0", RequestTenant("light", 2.0))]
    try:
        for rid, tenant in specs:
            e.submit(
                request_id=rid,
                prompt_tokens=PROMPT,
                prompt_text=None,
                params=SamplingParams(max_tokens=3, ignore_eos=True),
                adapters=NO_ADAPTERS,
                emit=lambda ev, rid=rid: q.put((rid, ev)),
                tenant=tenant,
            )
    finally:
        gate.set()
    started: list[str] = []
    done = 0
    while done < len(specs):
        rid, ev = q.get(timeout=60)
        if isinstance(ev, TokenEvent) and rid not in started:
            started.append(rid)
        done += isinstance(ev, FinishedEvent)
    st = e.scheduler.stats()
    assert st.fairness == fairness
    if fairness == "off":
        assert started == ["h0", "h1", "h2", "h3", "l0"]
        assert st.tenants == ()
        return
    assert started == ["h0", "l0", "h1", "h2", "h3"]
    t = {x.name: x for x in st.tenants}
    assert (t["heavy"].virtual_tokens, t["heavy"].prompt_tokens, t["heavy"].output_tokens) == (40.0, 16, 12)
    # light: lifted to 0 (heavy's counter when it arrived), then (4 + 3 x 2) / weight 2
    assert (t["light"].virtual_tokens, t["light"].weight, t["light"].queued, t["light"].running) == (5.0, 2.0, 0, 0)


def test_a_full_worker_gives_a_heavy_tenants_newest_queued_place_to_a_light_tenant(engine_for):
    """--fairness vtc, one slot + a queue of 2, the loop held, all three places the heavy
    tenant's: a light tenant's request takes the place of the heavy tenant's newest queued one
    (which ends with RESOURCE_EXHAUSTED naming why); a second light request finds an even split
    (2 : 1 counting it) and is refused, as is the heavy tenant's next; a tenant of weight 4 takes
    one more place. (--fairness off refuses: ``test_queue_limit_answers_resource_exhausted``.)"""
    from worker.config import Fairness

    e = engine_for(Batching.MIXED, n_slots=1, queue_limit=2, fairness=Fairness.VTC)
    q: queue.Queue = queue.Queue()
    gate = threading.Event()
    e.scheduler.run_soon(lambda: gate.wait(30))
    heavy, light, weighty = RequestTenant("heavy"), RequestTenant("light"), RequestTenant("weighty", 4.0)

    def submit(rid: str, tenant: RequestTenant) -> None:
        e.submit(
            request_id=rid,
            prompt_tokens=PROMPT,
            prompt_text=None,
            params=SamplingParams(max_tokens=2, ignore_eos=True),
            adapters=NO_ADAPTERS,
            emit=lambda ev: q.put((rid, ev)),
            tenant=tenant,
        )

    refused: list[str] = []
    try:
        for rid, tenant in [("h0", heavy), ("h1", heavy), ("h2", heavy), ("l0", light), ("l1", light)]:
            try:
                submit(rid, tenant)
            except QueueFullError as exc:
                assert status_of(exc).name == "RESOURCE_EXHAUSTED"
                assert "queue full (0/1 KV sequences busy, 3 queued; admits --slots + --queue-limit 2)" in str(exc)
                refused.append(rid)
        with pytest.raises(QueueFullError):
            submit("h3", heavy)
        submit("w0", weighty)  # heavy 2 of weight 1 > (0 + 1) / 4: h1 gives way
    finally:
        gate.set()
    ends: dict[str, object] = {}
    while set(ends) != {"h0", "h1", "h2", "l0", "w0"}:
        rid, ev = q.get(timeout=60)
        if isinstance(ev, (FinishedEvent, ErrorEvent)):
            ends[rid] = ev
    assert refused == ["l1"]
    gave = {rid for rid, ev in ends.items() if isinstance(ev, ErrorEvent)}
    assert gave == {"h2", "h1"}  # the heavy tenant's newest queued, each time
    err = ends["h2"].error  # type: ignore[attr-defined]
    assert isinstance(err, QueueFullError) and status_of(err).name == "RESOURCE_EXHAUSTED"
    assert str(err) == (
        f"worker {e.worker_id}: queue full: this queued request gave its place to a lighter tenant's "
        "(tenant 'heavy' had 3 of the 3 queued; admits --slots + --queue-limit 2, shared between tenants "
        "by --fairness vtc); retry later"
    )
    assert {rid for rid, ev in ends.items() if isinstance(ev, FinishedEvent)} == {"h0", "l0", "w0"}
    assert e.scheduler.stats().queue_depth == 0
