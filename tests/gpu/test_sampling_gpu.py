"""Sampling, penalties and structured output with the worker engine on the GPU
(``WorkerEngine(device="cuda")``, the tiny llama-MoE model and its expert adapter, mixed
batching, f32), as ``tests/unit/test_structured_output.py`` and ``tests/unit/test_scheduler.py``
check them on the CPU, plus the device's greedy tokens and log-probs against the CPU engine
(f32 reference weights).
"""

from __future__ import annotations

import json
import queue
import threading

import pytest

from loraplane.adapter_scales import AdapterScales
from loraplane.response_format import ResponseFormat
from worker.config import Batching, PrefixCachePolicy, WorkerConfig
from worker.runtime.sampling import SamplingParams
from worker.serving.engine import WorkerEngine
from worker.serving.request import ErrorEvent, FinishedEvent, TokenEvent

pytestmark = pytest.mark.cuda

PROMPT = [1, 450, 4996, 17354]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def _engine(model, lora, device: str, **config) -> WorkerEngine:
    e = WorkerEngine(
        WorkerConfig(
            model_path=str(model),
            n_seqs=6,
            batching=Batching.MIXED,
            prefix_cache=PrefixCachePolicy.LLAMA,
            device=device,
            n_ctx_seq=256,
            **config,
        )
    )
    e.load_adapter(0, path=str(lora))
    return e


@pytest.fixture(scope="module")
def engine(tiny_moe):
    e = _engine(*tiny_moe, "cuda")
    assert e.base.device.type == "cuda", e.base.device
    yield e
    e.close()


def _run(engine: WorkerEngine, specs: list[tuple[str, SamplingParams, list]]) -> dict[str, list]:
    """Submit ``specs`` while the loop is held (one batch from the first step); events per id."""
    q: queue.Queue = queue.Queue()
    gate = threading.Event()
    engine.scheduler.run_soon(lambda: gate.wait(30))
    try:
        for rid, params, entries in specs:
            engine.submit(
                request_id=rid,
                prompt_tokens=PROMPT,
                prompt_text=None,
                params=params,
                adapters=AdapterScales(entries),
                emit=lambda ev, rid=rid: q.put((rid, ev)),
            )
    finally:
        gate.set()
    out: dict[str, list] = {rid: [] for rid, _, _ in specs}
    done = 0
    while done < len(specs):
        rid, ev = q.get(timeout=120)
        out[rid].append(ev)
        done += isinstance(ev, FinishedEvent | ErrorEvent)
    for rid, evs in out.items():
        assert not any(isinstance(ev, ErrorEvent) for ev in evs), (rid, evs[-1])
    return out


def _ids(evs: list) -> list[int]:
    return [ev.token_id for ev in evs if isinstance(ev, TokenEvent)]


def test_constrained_rows_in_a_mixed_adapter_batch_on_cuda(engine):
    fmt = ResponseFormat("json_schema", schema=json.dumps(SCHEMA))
    plain = SamplingParams(max_tokens=6, ignore_eos=True)
    specs = [
        ("json-base", SamplingParams(max_tokens=40, response_format=fmt), []),
        ("json-lora", SamplingParams(max_tokens=40, response_format=fmt), [(0, 1.0)]),
        ("json-sampled", SamplingParams(max_tokens=40, temperature=1.0, seed=7, response_format=fmt), [(0, 0.5)]),
        ("regex", SamplingParams(max_tokens=40, response_format=ResponseFormat("regex", pattern="[ab]{3}")), []),
        ("free-base", plain, []),
        ("free-lora", plain, [(0, 1.0)]),
    ]
    out = _run(engine, specs)
    for rid in ("json-base", "json-lora", "json-sampled"):
        fin = out[rid][-1]
        assert isinstance(fin, FinishedEvent) and fin.finish_reason == "stop", fin
        doc = json.loads(fin.text)
        assert set(doc) == {"ok", "n"} and isinstance(doc["ok"], bool) and doc["n"] in range(10), doc
        steps = [ev.step for ev in out[rid] if isinstance(ev, TokenEvent)]
        assert max(s.n_adapter_sets for s in steps) >= 2  # shared a batch with other adapter sets
    assert out["regex"][-1].finish_reason == "stop"
    assert out["regex"][-1].text in {a + b + c for a in "ab" for b in "ab" for c in "ab"}
    alone = _run(engine, [("free-base", plain, []), ("free-lora", plain, [(0, 1.0)])])
    assert _ids(out["free-base"]) == _ids(alone["free-base"]) and len(_ids(alone["free-base"])) == 6
    assert _ids(out["free-lora"]) == _ids(alone["free-lora"])


def test_penalties_apply_per_row_in_a_mixed_batch_on_cuda(engine):
    """As the CPU test: each row's tokens equal the same request alone, a huge repetition penalty
    leaves a never-repeating greedy run unchanged, negative presence/frequency penalties make the
    run repeat an output token."""
    plain = SamplingParams(max_tokens=8, ignore_eos=True)
    rep = SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=1e4)
    pres = SamplingParams(max_tokens=8, ignore_eos=True, presence_penalty=-2.0, frequency_penalty=-2.0)
    together = {
        rid: _ids(evs)
        for rid, evs in _run(
            engine, [("a", plain, [(0, 1.0)]), ("a-rep", rep, [(0, 1.0)]), ("base", plain, []), ("base-pres", pres, [])]
        ).items()
    }
    assert _ids(_run(engine, [("alone", pres, [])])["alone"]) == together["base-pres"]
    for rid in ("a", "base"):
        assert len(set(together[rid])) == 8 and not set(together[rid]) & set(PROMPT), together[rid]
    assert together["a-rep"] == together["a"]
    ref, pen = together["base"], together["base-pres"]
    assert pen != ref and len(set(pen)) < 8, (ref, pen)


def test_seeded_sampling_repeats_and_top_k_1_is_greedy_on_cuda(engine):
    sampled = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, seed=5)
    k1 = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, top_k=1, seed=5)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5)
    first = _run(engine, [("s", sampled, [(0, 1.0)]), ("k1", k1, []), ("g", greedy, [])])
    again = _run(engine, [("s", sampled, [(0, 1.0)])])
    assert _ids(first["s"]) == _ids(again["s"]) and len(_ids(first["s"])) == 12
    assert _ids(first["k1"]) == _ids(first["g"])
    for ev in (e for e in first["g"] if isinstance(e, TokenEvent)):
        assert len(ev.top) == 5 and ev.top[0][0] == ev.token_id, ev
        assert abs(ev.top[0][1] - ev.logprob) < 1e-5 and [lp for _, lp in ev.top] == sorted(
            (lp for _, lp in ev.top), reverse=True
        )


def test_greedy_tokens_and_logprobs_equal_the_cpu_engine(engine, tiny_moe):
    """Base and adapter rows decoded together on the device give the CPU engine's tokens (f32
    reference weights), with log-probs within 5e-3."""
    greedy = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1)
    specs = [("base", greedy, []), ("lora", greedy, [(0, 1.0)]), ("half", greedy, [(0, 0.5)])]
    gpu = _run(engine, specs)
    cpu_engine = _engine(*tiny_moe, "cpu", weight_form="dequant")
    try:
        cpu = _run(cpu_engine, specs)
    finally:
        cpu_engine.close()
    for rid, _, _ in specs:
        g = [ev for ev in gpu[rid] if isinstance(ev, TokenEvent)]
        c = [ev for ev in cpu[rid] if isinstance(ev, TokenEvent)]
        assert [e.token_id for e in g] == [e.token_id for e in c], rid
        worst = max(abs(a.logprob - b.logprob) for a, b in zip(g, c, strict=True))
        print(f"{rid}: device vs CPU log-probs max |d| {worst:.6f}")
        assert worst <= 5e-3, f"{rid}: {worst:.5f}"
