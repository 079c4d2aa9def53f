"""The worker as a service: real worker processes on localhost, driven over gRPC only.

Two processes are started once for the module (in parallel; the model load is the slow part):
``mixed`` (mixed batching, keyed prefix cache, 8 slots so the 14 argmax walks of check 1 run
in two waves, queue limit 16) and ``compat`` (llama-server's batching rule and its
``lora_should_clear_cache`` prefix cache, 4 slots). Helpers: ``tests/helpers/worker_service.py``.
Both load the fixture adapters by server path under golden.json's ids. Every check reads real
numbers and telemetry off the wire:

1. llama-server's LoRA test restated: shout at scale 0 is the base model and at scale 1 the
   adapter, teacher-forced against llama.cpp's goldens with the fixtures README bounds.
2./3./6. Concurrent requests with different adapter sets get their own results in both batching
   modes (equal to each run alone); mixed vs compat log-probs agree; base rows in a mixed
   batch equal a base-only run.
4. A→B→A on one prefix under both cache policies.
5. aLoRA: PEFT/llama.cpp parity, activation position, base equivalence without the
   invocation, base-prefix sharing under the keyed cache, two aLoRAs refused.
7. Cancelling a stream frees its slot; 8. error codes; 9. unload while in use drains.

Argmax agreement against the goldens is measured exactly without top-N teacher forcing:
greedy-decode from prompt + reference[:j]; while our greedy tokens equal the reference they
are our argmax at those positions; at the first difference we record it and restart from the
reference prefix one past it (usually one or two calls per case).
"""

from __future__ import annotations

import json
import queue
import threading
import time

import grpc
import numpy as np
import pytest

from loraplane.v1 import common_pb2 as pb
from loraplane.v1 import worker_pb2
from tests.helpers.worker_service import (
    CALL_TIMEOUT,
    Result,
    WorkerProcess,
    find_last,
    gen,
    greedy_argmax_many,
    group_stats,
    second_alora_gguf,
    teacher_forced,
)

pytestmark = pytest.mark.slow

# The workers run the default path (packed GGUF weights, int16 activations per block of 32).
# Results that are exactly equal on the f32 reference (checked in-process at 1e-4 in
# tests/parity/test_model_parity.py and tests/unit/test_runtime.py with weights="dequant") differ here by
# the few activation rounding steps that a last-bit float difference upstream can move (KV
# computed in another ubatch shape, another batch composition); measured up to 2.3e-3.
SAME_RESULT_TOL = 3e-3

ADAPTER_FILES = {0: "shout.gguf", 1: "sea.gguf", 2: "shout_embd.gguf", 3: "critic_alora.gguf"}
SHOUT, SEA, SHOUT_EMBD, CRITIC = 0, 1, 2, 3
INVOCATION_SUFFIX = "\n<start_of_turn>shout\n"
ALORA_TOKENS = (105, 1179, 725, 107)  # "<start_of_turn>shout\n" (golden.json adapters[3])


@pytest.fixture(scope="module")
def workers(fixtures_dir):
    dirs = f"adapter_dirs=({str(fixtures_dir / 'adapters')!r},)"  # server paths are confined
    procs = {
        "mixed": WorkerProcess(
            "mixed", f"n_seqs=8, queue_limit=16, batching=Batching.MIXED, prefix_cache=PrefixCachePolicy.KEYED, {dirs}"
        ),
        "compat": WorkerProcess(
            "compat", f"n_seqs=4, batching=Batching.COMPAT, prefix_cache=PrefixCachePolicy.LLAMA, {dirs}"
        ),
    }
    try:
        t0 = time.monotonic()
        for w in procs.values():
            w.wait_ready()
        print(f"\nworkers ready in {time.monotonic() - t0:.1f}s")
        for w in procs.values():
            for aid, name in ADAPTER_FILES.items():
                info = w.load(aid, fixtures_dir / "adapters" / name)
                assert info.id == aid and info.name == name.removesuffix(".gguf")
        yield procs
    finally:
        for w in procs.values():
            w.stop()


@pytest.fixture(scope="module")
def mixed(workers) -> WorkerProcess:
    return workers["mixed"]


@pytest.fixture(scope="module")
def compat(workers) -> WorkerProcess:
    return workers["compat"]


@pytest.fixture(scope="module")
def golden(fixtures_dir) -> dict:
    return json.loads((fixtures_dir / "golden.json").read_text())


@pytest.fixture(scope="module")
def peft_ref(fixtures_dir) -> dict:
    return json.loads((fixtures_dir / "peft_reference.json").read_text())


# --- 1. llama-server's LoRA test: scale 0 = base, scale 1 = the adapter -------------------------


def test_lora_scale_0_is_base_and_1_is_adapter_vs_llama_cpp(mixed, golden):
    """tools/server/tests/unit/test_lora.py restated against golden.json, teacher-forced."""
    groups = {"base": [(SHOUT, 0.0)], "shout@1": [(SHOUT, 1.0)]}
    cases, meta = [], []
    for name, ad in groups.items():
        for c in golden["completions"]:
            if c["case"] == name:
                cases.append((c["prompt_tokens"], c["tokens"], ad))
                meta.append((name, c))
    t0 = time.monotonic()
    tf = teacher_forced(mixed, cases, "llama-lora")
    t1 = time.monotonic()
    am = greedy_argmax_many(mixed, cases, "llama-lora")
    t2 = time.monotonic()
    print(f"\nteacher-forced {len(cases)} cases in {t1 - t0:.1f}s, greedy argmax in {t2 - t1:.1f}s")
    for res, (name, c) in zip(tf, meta, strict=False):
        assert res.prompt_ids == c["prompt_tokens"] + c["tokens"]
        # scale 0 detaches the adapter: the request runs on the base set
        assert [(a.id, a.scale) for a in res.telemetry.adapters] == ([] if name == "base" else [(SHOUT, 1.0)])
    for name in groups:
        idx = [i for i, (n, _) in enumerate(meta) if n == name]
        st = group_stats(
            name,
            [cases[i][0] for i in idx],
            [meta[i][1]["steps"] for i in idx],
            [tf[i] for i in idx],
            [am[i] for i in idx],
        )
        print(st)
        assert max(st.case_means) <= 0.10, st
        assert st.p95 <= 0.25, st
        assert st.argmax_total > 0 and st.argmax_rate >= 0.95, st
    # (the two goldens are different continuations of the same prompts, lower vs upper case, so
    # passing both bounds means scale 0 really is the base and scale 1 really is the adapter)


# --- 2./3./6. concurrent requests with different adapter sets ---------------------------------

MIX_PROMPT = "The lighthouse keeper"
MIX_CASES = {"base": [], "shout@1": [(SHOUT, 1.0)], "shout@0.5": [(SHOUT, 0.5)], "sea@1": [(SEA, 1.0)]}


@pytest.fixture(scope="module")
def mix_runs(mixed, compat):
    """The four cases run alone (mixed worker, one after another) and concurrently on both."""
    t0 = time.monotonic()
    # prompt_logprobs: computed cold (no prefix reuse), the plainest reference there is
    alone = {
        name: mixed.run(gen(f"alone-{name}", text=MIX_PROMPT, adapters=ad, prompt_logprobs=True))
        for name, ad in MIX_CASES.items()
    }
    t1 = time.monotonic()
    together = {}
    for wname, w in (("mixed", mixed), ("compat", compat)):
        res = w.run_concurrently(
            [gen(f"{wname}-{name}", text=MIX_PROMPT, adapters=ad) for name, ad in MIX_CASES.items()]
        )
        together[wname] = {name: res[f"{wname}-{name}"] for name in MIX_CASES}
    t2 = time.monotonic()
    print(f"\nalone runs {t1 - t0:.1f}s, concurrent runs (both workers) {t2 - t1:.1f}s")
    return alone, together


@pytest.mark.parametrize("mode", ["mixed", "compat"])
def test_concurrent_adapter_sets_each_get_their_own_result(mix_runs, mode):
    alone, together = mix_runs
    runs = together[mode]
    # the four cases really are different continuations
    assert len({tuple(r.tokens) for r in alone.values()}) == 4
    for name, r in runs.items():
        assert r.tokens == alone[name].tokens, f"{mode} {name}: concurrent tokens differ from the run alone"
        assert len(r.tokens) == 24 and r.finished.finish_reason == "length"
        assert [(a.id, round(a.scale, 6)) for a in r.telemetry.adapters] == MIX_CASES[name]
        assert all(s.batching == mode for s in r.steps)
    steps = [s for r in runs.values() for s in r.steps]
    if mode == "mixed":
        assert any(s.n_adapter_sets > 1 and s.batch_size > 1 for s in steps), (
            "mixed batching never put different adapter sets in one ubatch"
        )
        assert max(r.telemetry.max_adapter_sets_in_batch for r in runs.values()) > 1
    else:
        assert all(s.n_adapter_sets == 1 for s in steps)
        assert all(r.telemetry.max_adapter_sets_in_batch == 1 for r in runs.values())
        # four different vectors: llama-server's can_batch_with never lets them share a batch
        assert all(s.batch_size == 1 for s in steps)


def test_mixed_and_compat_logprobs_match(mix_runs):
    _, together = mix_runs
    worst = 0.0
    for name in MIX_CASES:
        m, c = together["mixed"][name], together["compat"][name]
        assert m.tokens == c.tokens
        d = np.abs(np.array(m.logprobs) - np.array(c.logprobs))
        worst = max(worst, float(d.max()))
    print(f"\nmixed vs compat: max |d logprob| = {worst:.2e}")
    # the same computation in other ubatch shapes: 1.03e-3 seen on an AMD EPYC (vnni path)
    assert worst <= SAME_RESULT_TOL


def test_base_rows_in_a_mixed_batch_equal_a_base_only_run(mix_runs):
    alone, together = mix_runs
    base = together["mixed"]["base"]
    assert any(s.n_adapter_sets > 1 for s in base.steps), "the base request never shared a ubatch with adapter rows"
    d = np.abs(np.array(base.logprobs) - np.array(alone["base"].logprobs))
    print(f"\nbase rows in mixed batch vs base only: max |d| = {d.max():.2e}")
    assert base.tokens == alone["base"].tokens
    assert d.max() <= SAME_RESULT_TOL


# --- 4. A→B→A on the same prefix under both cache policies ----------------------------------

ABA_PROMPT = "The old sailor told the children a story about"


@pytest.mark.parametrize("mode", ["mixed", "compat"])
def test_aba_prefix_cache(workers, mode):
    w = workers[mode]
    A, B = [(SHOUT, 1.0)], [(SEA, 1.0)]
    n = 12
    a1 = w.run(gen(f"aba-{mode}-a1", text=ABA_PROMPT, adapters=A, max_tokens=n))
    # B right after A on the same prompt; four at once so that under the llama policy every
    # slot ends up holding the prompt computed under B (the next A finds no A prefix anywhere)
    bs = w.run_concurrently([gen(f"aba-{mode}-b{i}", text=ABA_PROMPT, adapters=B, max_tokens=n) for i in range(4)])
    a2 = w.run(gen(f"aba-{mode}-a2", text=ABA_PROMPT, adapters=A, max_tokens=n))
    # cold references: prompt_logprobs never reuses cached KV, under either policy
    b_cold = w.run(gen(f"aba-{mode}-bcold", text=ABA_PROMPT, adapters=B, max_tokens=n, prompt_logprobs=True))
    a_cold = w.run(gen(f"aba-{mode}-acold", text=ABA_PROMPT, adapters=A, max_tokens=n, prompt_logprobs=True))
    assert b_cold.telemetry.cached_prompt_tokens == 0 and a_cold.telemetry.cached_prompt_tokens == 0
    assert a1.tokens != b_cold.tokens
    worst = 0.0
    for r in list(bs.values()):
        assert r.tokens == b_cold.tokens
        worst = max(worst, float(np.max(np.abs(np.array(r.logprobs) - np.array(b_cold.logprobs)))))
    for r in (a1, a2):
        assert r.tokens == a_cold.tokens
        worst = max(worst, float(np.max(np.abs(np.array(r.logprobs) - np.array(a_cold.logprobs)))))
    print(
        f"\n{mode}: A->B->A vs cold max |d| = {worst:.2e}; A2 cached={a2.telemetry.cached_prompt_tokens} "
        f"cleared={a2.telemetry.cache_cleared} reason={a2.telemetry.cache_clear_reason!r}"
    )
    assert worst <= SAME_RESULT_TOL
    n_prompt = len(a1.prompt_ids)
    if mode == "mixed":  # keyed: B never sees A's prefix, A finds its own again
        assert all(r.telemetry.prefix_cache == "keyed" for r in (a1, a2))
        assert 0 < a2.telemetry.cached_prompt_tokens <= n_prompt - 1
        # B may reuse what B itself computed earlier on a common prefix (e.g. "<bos> The"),
        # never A's KV of this prompt
        assert all(r.telemetry.cached_prompt_tokens < a2.telemetry.cached_prompt_tokens for r in bs.values())
        assert not a2.telemetry.cache_cleared
    else:  # llama: lora_should_clear_cache drops the slot's B prompt for the second A
        assert all(r.telemetry.prefix_cache == "llama" for r in (a1, a2))
        assert sorted(r.telemetry.slot_id for r in bs.values()) == [0, 1, 2, 3]  # B went into every slot
        assert a2.telemetry.cache_cleared
        assert "lora_should_clear_cache" in a2.telemetry.cache_clear_reason
        assert a2.telemetry.cached_prompt_tokens == 0
        # same-vector slots do batch together in compat mode
        assert any(s.batch_size > 1 for r in bs.values() for s in r.steps)
        assert all(s.n_adapter_sets == 1 for r in bs.values() for s in r.steps)


# --- 5. aLoRA --------------------------------------------------------------------------------


def test_alora_parity_with_peft_and_llama_cpp(mixed, peft_ref, golden):
    peft_cases = [
        c for c in peft_ref["cases"] if c["adapter"] == "critic_alora" and c["prompt_text"].endswith(INVOCATION_SUFFIX)
    ]
    llama_cases = [c for c in golden["completions"] if c["case"] == "critic_alora@1 (invoked)"]
    assert len(peft_cases) == 3 and len(llama_cases) == 7
    ad = [(CRITIC, 1.0)]
    cases = [(c["prompt_tokens"], c["token_ids"], ad) for c in peft_cases]
    cases += [(c["prompt_tokens"], c["tokens"], ad) for c in llama_cases]
    tf = teacher_forced(mixed, cases, "alora")
    for (p, _ref, _), res in zip(cases, tf, strict=False):
        start = find_last(p, ALORA_TOKENS)
        assert start == len(p) - len(ALORA_TOKENS)
        assert res.telemetry.alora_activation_pos == start
        assert [(a.id, a.scale) for a in res.telemetry.adapters] == ad
    am = greedy_argmax_many(mixed, cases[:3], "alora-peft")
    peft = group_stats(
        "critic_alora invoked vs PEFT", [c[0] for c in cases[:3]], [c["steps"] for c in peft_cases], tf[:3], am
    )
    llama = group_stats(
        "critic_alora invoked vs llama.cpp", [c[0] for c in cases[3:]], [c["steps"] for c in llama_cases], tf[3:], None
    )
    print(f"\n{peft}\n{llama}\nvs PEFT: max |d| = {max(peft.deltas):.2e}")
    assert max(peft.case_means) <= 0.05, peft
    assert peft.argmax_total > 0 and peft.argmax_rate >= 0.95, peft
    assert max(llama.case_means) <= 0.10 and llama.p95 <= 0.25, llama


def test_alora_without_invocation_is_base(mixed):
    prompt = "My first computer was"
    base = mixed.run(gen("alora-noinv-base", text=prompt, adapters=[]))
    alora = mixed.run(gen("alora-noinv-alora", text=prompt, adapters=[(CRITIC, 1.0)]))
    assert alora.telemetry.alora_activation_pos == -1
    assert list(alora.telemetry.adapters) == []  # dropped: scale 0 for this request
    assert alora.tokens == base.tokens
    d = np.abs(np.array(alora.logprobs) - np.array(base.logprobs))
    assert d.max() <= SAME_RESULT_TOL


def test_alora_shares_the_base_prefix_in_the_keyed_cache(mixed):
    prompt = "The garden behind the school was"
    alora_text = prompt + INVOCATION_SUFFIX
    cold = mixed.run(
        gen("alora-share-cold", text=alora_text, adapters=[(CRITIC, 1.0)], max_tokens=12, prompt_logprobs=True)
    )
    base = mixed.run(gen("alora-share-base", text=prompt, adapters=[], max_tokens=4))
    warm = mixed.run(gen("alora-share-warm", text=alora_text, adapters=[(CRITIC, 1.0)], max_tokens=12))
    start = find_last(warm.prompt_ids, ALORA_TOKENS)
    assert start > 0 and warm.telemetry.alora_activation_pos == start
    assert warm.prompt_ids[: len(base.prompt_ids)] == base.prompt_ids
    # the base request's KV serves the aLoRA request up to (never past) its activation point
    print(
        f"\naLoRA after base: cached {warm.telemetry.cached_prompt_tokens} of {len(warm.prompt_ids)}, "
        f"activation at {start}"
    )
    assert 0 < warm.telemetry.cached_prompt_tokens <= start
    assert warm.tokens == cold.tokens
    assert np.max(np.abs(np.array(warm.logprobs) - np.array(cold.logprobs))) <= SAME_RESULT_TOL
    # and the adapter really acts after the invocation
    assert warm.tokens != mixed.run(gen("alora-share-base2", text=alora_text, adapters=[], max_tokens=12)).tokens


def test_two_aloras_in_one_request_are_refused(mixed, fixtures_dir, tmp_path):
    data = second_alora_gguf(
        fixtures_dir / "adapters" / "critic_alora.gguf", tmp_path / "alora2.gguf", [105, 2364, 107]
    )  # "<start_of_turn>user\n"
    info = mixed.load(4, data=data)  # uploaded as bytes
    assert list(info.alora_invocation_tokens) == [105, 2364, 107]
    prompt = "Hello" + INVOCATION_SUFFIX
    err = mixed.error_of(gen("two-aloras", text=prompt, adapters=[(CRITIC, 1.0), (4, 1.0)]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "aLoRA" in err.details()
    # each one alone is fine
    assert (
        mixed.run(gen("one-alora", text=prompt, adapters=[(4, 1.0)], max_tokens=2)).telemetry.alora_activation_pos == -1
    )
    mixed.stub.UnloadAdapter(pb.AdapterRef(id=4), timeout=60)


# --- 7. cancellation -------------------------------------------------------------------------


def test_cancelling_a_stream_frees_its_slot(mixed):
    mixed.wait_idle()
    before = mixed.stats().tokens_generated
    call = mixed.stub.Decode(
        iter(
            [
                worker_pb2.DecodeRequest(
                    submit=gen("cancel-long", text="Tell me a long story", adapters=[(SEA, 1.0)], max_tokens=200)
                )
            ]
        ),
        timeout=CALL_TIMEOUT,
    )
    other: dict[str, Result] = {}
    t = threading.Thread(
        target=lambda: other.update(
            mixed.decode(
                [gen("cancel-other", text="The bakery on Main Street", adapters=[(SHOUT, 1.0)], max_tokens=24)]
            )
        )
    )
    n = 0
    for ev in call:
        if ev.WhichOneof("event") == "token":
            n += 1
            if n == 1:
                t.start()
            if n >= 4 and mixed.stats().slots_busy == 2:  # both running
                break
    assert n < 100
    call.cancel()
    cancelled_at = time.monotonic()
    # the cancelled request's slot is freed at the next step, while the other one still runs
    while mixed.stats().slots_busy == 2:
        assert time.monotonic() - cancelled_at < 10, "cancelled request still holds its slot"
        time.sleep(0.02)
    freed_at = time.monotonic()
    t.join(CALL_TIMEOUT)
    r = other["cancel-other"]
    assert r.finished.finish_reason == "length" and len(r.tokens) == 24
    assert r.finished_at > freed_at
    s = mixed.wait_idle(timeout=10)
    print(
        f"\ncancelled after {n} tokens; slot freed {freed_at - cancelled_at:.2f}s after cancel; "
        f"tokens generated in total {s.tokens_generated - before}"
    )
    # the cancelled request stopped long before its 200 tokens
    assert s.tokens_generated - before < 24 + 100


def test_cancel_request_id_stops_one_request_of_a_stream(mixed):
    """``DecodeRequest.cancel_request_id`` stops that request only; the others on the stream go
    on, and the stream still ends once the rest are finished and the input is closed."""
    mixed.wait_idle()
    outbox: queue.Queue = queue.Queue()

    def requests():
        while (item := outbox.get()) is not None:
            yield item

    call = mixed.stub.Decode(requests(), timeout=60)  # a stream left open would hit this
    outbox.put(
        worker_pb2.DecodeRequest(submit=gen("cid-long", text="Tell me a long story", adapters=[], max_tokens=200))
    )
    outbox.put(
        worker_pb2.DecodeRequest(
            submit=gen("cid-short", text="Tell me a short story", adapters=[(SEA, 1.0)], max_tokens=16)
        )
    )
    res = {"cid-long": Result("cid-long"), "cid-short": Result("cid-short")}
    for ev in call:
        res[ev.request_id].add(ev)
        if ev.request_id == "cid-long" and len(res["cid-long"].tokens) == 3:
            outbox.put(worker_pb2.DecodeRequest(cancel_request_id="cid-long"))
            outbox.put(None)  # half-close: nothing more to submit
    long, short = res["cid-long"], res["cid-short"]
    assert short.finished.finish_reason == "length" and len(short.tokens) == 16
    assert long.finished is None and len(long.tokens) < 10
    mixed.wait_idle(timeout=10)


def test_request_ids_are_opaque(mixed):
    """Request ids are the client's strings, whatever they are (the stream multiplexes on them)."""
    res = mixed.decode([gen(rid, text="Hi", adapters=[], max_tokens=2) for rid in ("opened", "closed", "")[:2]])
    assert all(len(r.tokens) == 2 and r.finished.finish_reason == "length" for r in res.values())


# --- 8. errors -------------------------------------------------------------------------------


def test_errors(mixed):
    err = mixed.error_of(gen("err-unknown", text="Hi", adapters=[(42, 1.0)]))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "adapter 42" in err.details()
    err = mixed.error_of(gen("err-novector", text="Hi", adapters=None))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "adapter vector" in err.details()
    err = mixed.error_of(gen("err-range", tokens=[2, 262144], adapters=[]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "262144" in err.details()
    err = mixed.error_of(gen("err-empty", tokens=[], adapters=[]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    named = gen("err-named", text="Hi", adapters=[])
    named.adapters.entries.add(name="shout", scale=1.0)  # names are the control plane's to resolve
    err = mixed.error_of(named)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "['shout'] given by name" in err.details()
    # a zero scale for an unknown id is "absent", not an error
    assert mixed.run(gen("err-zero", text="Hi", adapters=[(42, 0.0)], max_tokens=1)).finished.finish_reason


def test_queue_full_is_resource_exhausted(mixed):
    """All slots busy with long requests + 16 waiting (the queue limit): the next is refused.
    The refusal ends the stream, which cancels everything it submitted."""
    mixed.wait_idle()
    s = mixed.stats()
    assert (s.n_slots, s.queue_limit) == (8, 16)
    reqs = [
        gen(f"qf-{i}", text="Count to one hundred:", adapters=[], max_tokens=200)
        for i in range(s.n_slots + s.queue_limit + 1)
    ]
    with pytest.raises(grpc.RpcError) as info:
        mixed.decode(reqs, timeout=60)
    err = info.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in err.details()
    mixed.wait_idle(timeout=10)


# --- 9. unload while in use ------------------------------------------------------------------


def test_unload_drains_running_requests(mixed):
    mixed.wait_idle()
    running: dict[str, Result] = {}
    first_token = threading.Event()
    result = Result("unload-running")

    def run_long():
        call = mixed.stub.Decode(
            iter(
                [
                    worker_pb2.DecodeRequest(
                        submit=gen(
                            "unload-running", text="The weather today is", adapters=[(SHOUT_EMBD, 1.0)], max_tokens=40
                        )
                    )
                ]
            ),
            timeout=CALL_TIMEOUT,
        )
        for ev in call:
            result.add(ev)
            first_token.set()
        running["r"] = result

    t_run = threading.Thread(target=run_long)
    t_run.start()
    assert first_token.wait(60)
    unload_done: dict[str, float] = {}

    def unload():
        mixed.stub.UnloadAdapter(pb.AdapterRef(id=SHOUT_EMBD), timeout=120)
        unload_done["at"] = time.monotonic()

    t_unload = threading.Thread(target=unload)
    t_unload.start()
    # draining: new requests naming it are refused at once (poll until the unload call has
    # arrived; a probe admitted before that just joins the drain), the running one goes on
    for i in range(50):
        try:
            mixed.run(gen(f"unload-probe-{i}", text="Hi", adapters=[(SHOUT_EMBD, 1.0)], max_tokens=1), timeout=60)
        except grpc.RpcError as exc:
            err = exc
            break
        time.sleep(0.1)
    assert err.code() == grpc.StatusCode.NOT_FOUND and f"adapter {SHOUT_EMBD}" in err.details()
    assert result.finished is None and t_unload.is_alive()
    # the worker keeps serving everyone else meanwhile
    other = mixed.run(gen("unload-other", text="Hi there", adapters=[(SEA, 1.0)], max_tokens=4))
    assert len(other.tokens) == 4
    assert result.finished is None and t_unload.is_alive()
    t_run.join(CALL_TIMEOUT)
    t_unload.join(CALL_TIMEOUT)
    r = running["r"]
    # drained, not cut short: the unload was pending while it ran (asserted above) and it still
    # produced all its tokens
    assert r.finished.finish_reason == "length" and len(r.tokens) == 40
    assert "at" in unload_done
    # shout_embd (token-embedding LoRA) was applied: PEFT's greedy start (margins > 4 nats),
    # not the base's " a bit of a" [496, 3103, 529, 496]
    assert r.tokens[:4] == [562, 86510, 3639, 562]
    err = mixed.error_of(gen("unload-after", text="Hi", adapters=[(SHOUT_EMBD, 1.0)]))
    assert err.code() == grpc.StatusCode.NOT_FOUND and f"adapter {SHOUT_EMBD}" in err.details()
    assert SHOUT_EMBD not in [a.id for a in mixed.stub.ListAdapters(pb.Empty(), timeout=10).adapters]
    assert SHOUT_EMBD not in mixed.stats().adapter_ids
    assert len(mixed.run(gen("unload-after-base", text="Hi", adapters=[(SHOUT, 1.0)], max_tokens=2)).tokens) == 2
    # unloading it again: NOT_FOUND
    with pytest.raises(grpc.RpcError) as info:
        mixed.stub.UnloadAdapter(pb.AdapterRef(id=SHOUT_EMBD), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
