"""Unit tests of the serving rooms on tiny synthetic objects (fast tier, no model loaded):
the aLoRA rule, llama-server's cache rule, the keyed prefix store and policy, ubatch
assembly, the immutable LoRA plan and its routing input, scale rule, incremental
detokenization, and the telemetry/stats records against the protos."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest
import torch

from loraplane.adapter_scales import AdapterScales, AdapterScalesError
from loraplane.formats.adapter_file import lora_scale
from loraplane.v1 import common_pb2 as pb
from loraplane.v1 import worker_pb2
from tests.helpers.lora_fakes import D, K, adapter
from worker.config import PrefixCachePolicy
from worker.errors import InvalidRequestError
from worker.lora.adapter_set import EMPTY_SET, AdapterSet
from worker.lora.alora import find_last, resolve_alora
from worker.lora.plan import build_plan
from worker.runtime.kv_cache import KVCache
from worker.runtime.sampling import Sampler, SamplingParams
from worker.serving.cache_policy import KeyedCachePolicy, LlamaCachePolicy, lora_should_clear_cache
from worker.serving.engine import WorkerStatsRecord
from worker.serving.output import (
    IncrementalDetokenizer,
    OutputStage,
    StopMatcher,
    finish_reason,
    prompt_token_logprobs,
)
from worker.serving.prefix_store import PrefixCache
from worker.serving.request import GenRequest, RequestTelemetry, StartedEvent, StepInfo, TokenEvent
from worker.serving.sequences import Seq, SeqState
from worker.serving.stats import SchedulerStats
from worker.serving.ubatch import assemble_ubatch

A, B = adapter("aaaa", seed=1), adapter("bbbb", seed=2, rank=3, alpha=6.0)
AL = adapter("alora", invocation=(7, 8), seed=3)
AL2 = adapter("alor2", invocation=(9,), seed=4)


def request(prompt: list[int], aset: AdapterSet, *, prompt_logprobs: bool = False) -> GenRequest:
    return GenRequest(
        "r",
        prompt,
        SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs),
        resolve_alora(aset, prompt),
        lambda ev: None,
        detok=None,
    )  # type: ignore[arg-type]


# --- aLoRA rule ---------------------------------------------------------------------------
def test_alora_rule_activation_point_and_drop():
    s = AdapterSet.of({0: (A, 1.0), 5: (AL, 1.0)})
    act = resolve_alora(s, [1, 7, 8, 2, 7, 8, 3])
    assert act.start == 4 and act.adapter_set == s and act.pre_set == s.without([5])
    missing = resolve_alora(s, [1, 2, 3])
    assert missing.start == -1 and missing.adapter_set == missing.pre_set == s.without([5])
    plain = resolve_alora(AdapterSet.of({0: (A, 1.0)}), [7, 8])
    assert plain.start == -1 and plain.adapter_set == plain.pre_set
    assert find_last([1, 2, 1, 2], (1, 2)) == 2 and find_last([1], (1, 2)) == -1
    with pytest.raises(InvalidRequestError, match="more than one activated LoRA"):
        resolve_alora(AdapterSet.of({5: (AL, 1.0), 6: (AL2, 1.0)}), [7, 8, 9])


def test_request_set_at_switches_at_activation():
    r = request([1, 2, 7, 8, 5], AdapterSet.of({5: (AL, 1.0)}))
    assert [r.set_at(p).ids for p in range(6)] == [(), (), (5,), (5,), (5,), (5,)]


# --- llama-server's cache rule ------------------------------------------------------------
@pytest.mark.parametrize(
    "cur, nxt, clear",
    [
        (EMPTY_SET, EMPTY_SET, False),
        (EMPTY_SET, AdapterSet.of({0: (A, 1.0)}), True),
        (AdapterSet.of({0: (A, 1.0)}), AdapterSet.of({0: (A, 1.0)}), False),
        (AdapterSet.of({0: (A, 1.0)}), AdapterSet.of({0: (A, 0.5)}), True),
        (AdapterSet.of({0: (A, 1.0)}), EMPTY_SET, True),
        (EMPTY_SET, AdapterSet.of({5: (AL, 1.0)}), False),
        (AdapterSet.of({5: (AL, 1.0)}), AdapterSet.of({6: (AL2, 1.0)}), False),
        (AdapterSet.of({5: (AL, 1.0)}), EMPTY_SET, True),
        (AdapterSet.of({0: (A, 1.0)}), AdapterSet.of({5: (AL, 1.0)}), True),
    ],
)
def test_lora_should_clear_cache(cur, nxt, clear):
    assert lora_should_clear_cache(cur, nxt) is clear


def test_set_identity_is_content_and_scale_not_id():
    assert AdapterSet.of({0: (A, 1.0)}) == AdapterSet.of({7: (A, 1.0)})
    assert AdapterSet.of({0: (A, 1.0)}).fingerprint != AdapterSet.of({0: (A, 0.5)}).fingerprint
    assert AdapterSet.of({0: (A, 0.0)}) == EMPTY_SET and EMPTY_SET.fingerprint == "base"


# --- policies ------------------------------------------------------------------------------
def small_kv() -> KVCache:
    return KVCache(
        n_layer=1,
        n_head_kv=1,
        n_embd_head_k=2,
        n_embd_head_v=2,
        n_ctx_seq=32,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def fill(kv: KVCache, seq: int, n: int) -> None:
    kv.begin_append(seq, kv.seq_len(seq), n)
    kv.commit(seq, kv.seq_len(seq) + n)


def test_llama_policy_picks_longest_prefix_and_clears_on_switch():
    pol, kv = LlamaCachePolicy(), small_kv()
    s0, s1 = Seq(0, cache_tokens=[1, 2, 3], last_used=1.0), Seq(1, cache_tokens=[1, 9], last_used=0.0)
    a = AdapterSet.of({0: (A, 1.0)})
    s0.cache_sets, s1.cache_sets = [a] * 3, [a] * 2
    s0.last_set = s1.last_set = a
    req = request([1, 2, 3, 4], a)
    assert pol.pick_seq([s0, s1], req) is s0
    assert pol.pick_seq([s0, s1], request([5, 6], a)) is s1  # no common prefix: LRU
    fill(kv, 0, 3)
    assert pol.attach(s0, req, kv) == 3 and kv.seq_len(0) == 3 and not req.telemetry.cache_cleared
    other = request([1, 2, 3, 4], AdapterSet.of({0: (B, 1.0)}))
    assert pol.attach(s0, other, kv) == 0 and kv.seq_len(0) == 0
    assert other.telemetry.cache_cleared and "lora_should_clear_cache" in other.telemetry.cache_clear_reason


def test_keyed_store_isolates_fingerprints_and_evicts_lru():
    store = PrefixCache(max_tokens=10)
    snap = object()
    store.store("fa", [1, 2, 3, 4], snap)  # type: ignore[arg-type]
    store.store("fb", [1, 2, 3, 4, 5], snap)  # type: ignore[arg-type]
    assert store.lookup("fa", [1, 2, 3, 9], limit=8)[0] == 3  # "fa" is now most recently used
    assert store.lookup("fc", [1, 2, 3, 9], limit=8) == (0, None)
    assert store.lookup("fa", [1, 2, 3, 4, 5], limit=2)[0] == 2  # capped
    store.store("fa", [1, 2, 3, 4, 5, 6], snap)  # type: ignore[arg-type]  # replaces its own prefix
    # 5 + 6 = 11 > 10 tokens: the least recently used entry ("fb") is evicted
    assert len(store) == 1 and store.n_tokens == 6
    assert store.lookup("fb", [1, 2, 3, 4, 5], limit=8) == (0, None)
    assert store.lookup("fa", [1, 2, 3, 4, 5, 6, 7], limit=8)[0] == 6


def test_keyed_policy_roundtrip_respects_alora_start():
    store = PrefixCache()
    pol, kv = KeyedCachePolicy(store), small_kv()
    aset = AdapterSet.of({5: (AL, 1.0)})
    done = request([1, 2, 3, 7, 8, 4], aset)
    seq = Seq(0, req=done, n_past=6, cache_tokens=[1, 2, 3, 7, 8, 4])
    fill(kv, 0, 6)
    pol.on_finish(seq, done, kv)  # only the pre-activation prefix [1,2,3] is stored, under no adapter
    assert kv.seq_len(0) == 0 and seq.cache_tokens == []
    base_req = request([1, 2, 3, 5, 6], EMPTY_SET)
    assert pol.attach(seq, base_req, kv) == 3 and kv.seq_len(0) == 3
    assert pol.attach(seq, request([1, 2, 3, 5], AdapterSet.of({0: (A, 1.0)})), kv) == 0


# --- ubatch assembly ---------------------------------------------------------------------
def busy_seq(sid: int, req: GenRequest, state: SeqState, n_past: int, last_step: int = 0) -> Seq:
    s = Seq(sid, state=state, req=req, n_past=n_past, last_step=last_step)
    return s


def test_assemble_mixed_routes_every_row_to_its_set():
    a, b = AdapterSet.of({0: (A, 1.0)}), AdapterSet.of({1: (B, 1.0)})
    g = request([1, 2, 3], a)
    g.generated = [9]
    p = request([4, 5, 6, 7], b)
    seqs = [busy_seq(0, g, SeqState.GENERATING, 3), busy_seq(1, p, SeqState.PROMPT, 1)]
    batch = assemble_ubatch(seqs, compat=False)
    ub = batch.ubatch
    assert ub.tokens == [9, 5, 6, 7] and ub.pos == [3, 1, 2, 3] and ub.seq_ids == [0, 1, 1, 1]
    assert ub.logits == [True, False, False, True]
    assert [batch.sets[i] for i in ub.set_index] == [a, b, b, b]
    assert [s.fingerprint for s in batch.sets] == sorted(s.fingerprint for s in batch.sets)
    assert all(seq.state in (SeqState.GENERATING, SeqState.PROMPT) for seq in seqs)  # untouched


def test_assemble_compat_one_set_and_budget_and_alora_split():
    a = AdapterSet.of({0: (A, 1.0)})
    r1, r2, r3 = request([1, 2, 3, 4, 5], a), request([6, 7, 8], EMPTY_SET), request([1, 2], a)
    seqs = [
        busy_seq(0, r1, SeqState.PROMPT, 0, last_step=5),
        busy_seq(1, r2, SeqState.PROMPT, 0, last_step=1),
        busy_seq(2, r3, SeqState.PROMPT, 0, last_step=3),
    ]
    batch = assemble_ubatch(seqs, compat=True)
    assert [s.id for s, _ in batch.parts] == [1] and len(batch.sets) == 1  # oldest group only
    batch = assemble_ubatch([seqs[0], seqs[2]], compat=True, n_batch=4)
    assert [(s.id, rows) for s, rows in batch.parts] == [(0, [0, 1, 2, 3])]  # budget spent
    al = request([1, 7, 8, 2], AdapterSet.of({5: (AL, 1.0)}))
    batch = assemble_ubatch([busy_seq(0, al, SeqState.PROMPT, 0)], compat=True)
    assert batch.parts[0][1] == [0]  # compat splits at the activation point (start = 1)
    batch = assemble_ubatch([busy_seq(0, al, SeqState.PROMPT, 0)], compat=False)
    assert batch.parts[0][1] == [0, 1, 2, 3] and len(batch.sets) == 2


# --- plan and scale rule ------------------------------------------------------------------
def test_plan_routes_rows_by_slot_over_the_pool():
    """The plan is a routing input over the slot pool: each row gets exactly its own set's
    adapters at their scales (heterogeneous ranks 2 and 3 in one product), through
    ``build_lora_mm``'s masked dense product."""
    from worker.lora.pool import LoraPool
    from worker.runtime.graph import GraphContext, GraphInputs

    sets = (AdapterSet.of({0: (A, 1.0)}), AdapterSet.of({0: (A, 0.5), 1: (B, 2.0)}), EMPTY_SET)
    pool = LoraPool(4, 8)
    pool.acquire([A, B])
    plan = build_plan(sets, pool)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.sets = ()  # type: ignore[misc]
    assert plan.s_used == 2 and pool.weights["w"].a.shape == (4, 8, K) and pool.weights["w"].bt.shape == (4, 8, D)
    torch.testing.assert_close(plan.set_slot_scale, torch.tensor([[1.0, 0.0], [0.5, 2.0], [0.0, 0.0]]))
    route = torch.tensor([2, 0, 1, 1])
    x = torch.randn(4, K)
    w = torch.zeros(D, K)
    inputs = GraphInputs(
        tokens=torch.zeros(4, dtype=torch.long), pos=torch.arange(4), spans=[], out_rows=torch.arange(4), row_set=route
    )
    y = GraphContext({"w": w}, inputs, plan, None, torch.float32).build_lora_mm("w", x)  # type: ignore[arg-type]
    for i, j in enumerate(route.tolist()):  # every row gets exactly its own set's adapters
        ref = torch.zeros(D)
        for _, ad, sc in sets[j].entries:
            p = ad.pairs["w"]
            ref += lora_scale(sc, ad.alpha, p.rank) * (p.lora_b @ (p.lora_a @ x[i]))
        torch.testing.assert_close(y[i], ref, rtol=1e-5, atol=1e-5)


def test_scale_rule():
    assert lora_scale(1.0, 0.0, 8) == 1.0 and lora_scale(0.5, 16.0, 8) == 1.0 and lora_scale(2.0, 6.0, 3) == 4.0


# --- output ------------------------------------------------------------------------------
def test_incremental_detokenizer_equals_decode(fixtures_dir):
    from loraplane.formats.gguf.reader import read_gguf
    from loraplane.formats.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(read_gguf(fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"))
    rng = random.Random(0)
    byte_ids = [tok.encode(ch, add_special=False)[-1] for ch in "é🌊中"]  # may be byte tokens
    for trial in range(200):
        ids = [rng.randrange(tok.n_vocab) for _ in range(rng.randrange(1, 30))]
        if trial % 3 == 0:
            ids += byte_ids
        if trial % 7 == 0 and tok.bos_id is not None:
            ids = [tok.bos_id, *ids]
        d = IncrementalDetokenizer(tok)
        text = "".join(d.push(t) for t in ids) + d.flush()
        assert text == tok.decode(ids), ids


def test_prompt_logprobs_and_finish_reason():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    got = prompt_token_logprobs(logits, [2, 0])
    ref = torch.log_softmax(logits, -1)
    assert got == [(2, pytest.approx(float(ref[0, 2])), 1), (0, pytest.approx(float(ref[1, 0])), 1)]
    assert prompt_token_logprobs(logits, [0, 1])[0][2] == 3 and prompt_token_logprobs(logits, [1])[0][2] == 2
    kw = dict(eog_ids=frozenset({1}), n_past=5, n_ctx=100)
    assert finish_reason(1, ignore_eos=False, n_generated=1, max_tokens=9, **kw) == "stop"
    assert finish_reason(1, ignore_eos=True, n_generated=1, max_tokens=9, **kw) is None
    assert finish_reason(2, ignore_eos=False, n_generated=9, max_tokens=9, **kw) == "length"
    assert (
        finish_reason(2, ignore_eos=False, n_generated=1, max_tokens=9, eog_ids=frozenset(), n_past=99, n_ctx=100)
        == "length"
    )


@pytest.fixture(scope="module")
def tiny_tokenizer(fixtures_dir):
    """The tiny llama-MoE's real tokenizer (32000 pieces, EOG = 2)."""
    from loraplane.formats.gguf.reader import read_gguf
    from loraplane.formats.tokenizer import Tokenizer

    return Tokenizer.from_gguf(read_gguf(fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"))


STEP = StepInfo(
    batch_size=1, batch_tokens=1, n_adapter_sets=1, graph_reused=True, n_nodes=0, node_budget=0, batching="mixed"
)


def _stage_request(tok, params: SamplingParams, prompt: list[int] | None = None) -> GenRequest:
    req = GenRequest(
        "r",
        prompt or [1, 450],
        params,
        resolve_alora(EMPTY_SET, prompt or [1, 450]),
        lambda ev: None,
        IncrementalDetokenizer(tok),
    )
    if params.stop:
        req.stop = StopMatcher(params.stop)
    return req


def _peaked(n_vocab: int, token_id: int) -> torch.Tensor:
    """f32 logits ``(n_vocab,)`` whose argmax is ``token_id``."""
    row = torch.zeros(n_vocab)
    row[token_id] = 10.0
    return row


def _feed(stage: OutputStage, req: GenRequest, ids: list[int], **kw) -> list[tuple[TokenEvent, str | None]]:
    """Run the stage on one peaked row per id until it gives a finish reason."""
    sampler = Sampler(req.params)
    out = []
    for i, t in enumerate(ids):
        ev, reason = stage.token(req, sampler, _peaked(stage.tokenizer.n_vocab, t), n_past=10 + i, step=STEP, **kw)
        out.append((ev, reason))
        if reason is not None:
            break
    return out


def test_output_stage_cuts_at_a_stop_string_across_tokens(tiny_tokenizer):
    """sample → detokenize → stop string → finish reason → event: the stop string ", then"
    spans two tokens; the piece before it is held back until it cannot start the stop
    string, nothing of it is emitted, and the final text is what was streamed."""
    tok = tiny_tokenizer
    ids = tok.encode("The sea, then the shore", add_special=False)  # ' The' ' sea' ',' ' then' ...
    stage = OutputStage(tok, n_ctx_seq=256)
    req = _stage_request(tok, SamplingParams(max_tokens=20, stop=(", then",)))
    seen: list[float | None] = []
    out = _feed(stage, req, ids, on_token=lambda r, now: seen.append(r.last_token_at))
    assert [ev.token_id for ev, _ in out] == ids[:4] and req.generated == ids[:4]
    assert [ev.text for ev, _ in out] == ["The", " sea", "", ""]  # ',' held back, then the stop hit
    assert [r for _, r in out] == [None, None, None, "stop"]
    assert stage.final_text(req) == "The sea"
    # f64 reference: torch's f32 log_softmax is itself ~3e-6 off on this near-uniform row (the
    # fused sampling kernel is within 1e-8 of f64)
    want = float(torch.log_softmax(_peaked(tok.n_vocab, ids[0]).double(), -1)[ids[0]])
    assert out[0][0].logprob == pytest.approx(want, abs=1e-5)
    # on_token sees the previous token's time (None for the first), then the time is recorded
    assert seen[0] is None and all(a is not None for a in seen[1:]) and req.first_token_at is not None
    assert req.telemetry.graph_reuses == 4 and req.telemetry.max_batch_size == 1


def test_output_stage_finish_reasons(tiny_tokenizer):
    """End of generation is "stop" (unless ignore_eos), max_tokens and a full slot context are
    "length"; a tail held back for a possible stop string is flushed on "length"."""
    tok = tiny_tokenizer
    stage = OutputStage(tok, n_ctx_seq=256)
    eog = min(tok.eog_ids)
    the, sea, comma = tok.encode("The sea,", add_special=False)
    req = _stage_request(tok, SamplingParams(max_tokens=5))
    assert [r for _, r in _feed(stage, req, [the, eog])] == [None, "stop"]
    assert stage.final_text(req) == tok.decode([the, eog]) == "The"
    req = _stage_request(tok, SamplingParams(max_tokens=2, ignore_eos=True))
    assert [r for _, r in _feed(stage, req, [eog, the])] == [None, "length"]
    req = _stage_request(tok, SamplingParams(max_tokens=3, stop=(", then",)))
    out = _feed(stage, req, [the, sea, comma])
    assert [ev.text for ev, _ in out] == ["The", " sea", ","] and out[-1][1] == "length"  # "," flushed
    assert stage.final_text(req) == "The sea,"
    small = OutputStage(tok, n_ctx_seq=12)  # _feed's n_past runs 10, 11: the context is full at 11
    req = _stage_request(tok, SamplingParams(max_tokens=9))
    assert [r for _, r in _feed(small, req, [the, sea, comma])] == [None, "length"]


def test_output_stage_prompt_logprobs_and_started(tiny_tokenizer):
    """Prompt log-probs accumulate over prompt chunks (one per next prompt token, none for
    the last position), and the started event carries them after a None for token 0."""
    stage = OutputStage(tiny_tokenizer, n_ctx_seq=256)
    prompt = [1, 450, 7205, 29892]
    req = _stage_request(tiny_tokenizer, SamplingParams(prompt_logprobs=True), prompt)
    logits = torch.randn(4, tiny_tokenizer.n_vocab, generator=torch.Generator().manual_seed(0))
    stage.prompt_rows(req, [0, 1], logits, [0, 1])
    stage.prompt_rows(req, [2, 3], logits, [2, 3])  # position 3 is the last: no next prompt token
    ref = torch.log_softmax(logits, -1)
    ranks = [int((ref[i] > ref[i, t]).sum()) + 1 for i, t in enumerate(prompt[1:])]
    assert req.prompt_logprobs == [(t, pytest.approx(float(ref[i, t])), ranks[i]) for i, t in enumerate(prompt[1:])]
    ev = stage.started(req)
    assert isinstance(ev, StartedEvent) and ev.prompt_tokens == prompt
    assert ev.prompt_logprobs == [None, *req.prompt_logprobs]
    plain = _stage_request(tiny_tokenizer, SamplingParams(), prompt)
    stage.prompt_rows(plain, [0, 1, 2, 3], logits, [0, 1, 2, 3])
    assert plain.prompt_logprobs == [] and stage.started(plain).prompt_logprobs is None


# --- typed records vs protos --------------------------------------------------------------
def _field_names(record) -> set[str]:
    """Field names, a nested record's fields flattened (WorkerStatsRecord.scheduler)."""
    out: set[str] = set()
    for f in dataclasses.fields(record):
        out |= (
            _field_names(f.type if not isinstance(f.type, str) else SchedulerStats)
            if f.name == "scheduler"
            else {f.name}
        )
    return out


@pytest.mark.parametrize(
    "record, message",
    [
        (RequestTelemetry, pb.RequestTelemetry),
        (StepInfo, pb.StepTelemetry),
        (WorkerStatsRecord, worker_pb2.WorkerStats),
    ],
)
def test_records_match_their_protos(record, message):
    ours = _field_names(record)
    assert ours == set(message.DESCRIPTOR.fields_by_name), ours ^ set(message.DESCRIPTOR.fields_by_name)


def test_telemetry_mapping_rejects_unknown_fields():
    from worker.rpc.servicer import telemetry_to_proto

    t = RequestTelemetry(
        prompt_tokens=3, adapters=AdapterScales([(1, 0.5)]), prefix_cache=PrefixCachePolicy.KEYED.value
    )
    msg = telemetry_to_proto(t)
    assert msg.prompt_tokens == 3 and [(a.id, a.scale) for a in msg.adapters] == [(1, 0.5)]
    with pytest.raises(ValueError):
        pb.RequestTelemetry(**{"prompt_tokenz": 1})


def test_kv_import_after_decode_outside_inference_mode():
    """The scheduler imports prefix snapshots between decodes, outside inference mode, into KV
    tensors that a decode (inside inference mode) grew: must not raise."""
    kv = KVCache(
        n_layer=1,
        n_head_kv=1,
        n_embd_head_k=2,
        n_embd_head_v=2,
        n_ctx_seq=256,
        dtype=torch.float32,
        device=torch.device("cpu"),
        n_seq_hint=4,
    )  # rows for both seqs
    assert kv.cap == 64
    with torch.inference_mode():  # what WorkerContext.decode does: grows the layer tensors
        kv.begin_append(1, 0, 100)
        kv.store(0, 1, 0, torch.ones(100, 1, 2), torch.ones(100, 1, 2))
        kv.commit(1, 100)
    assert kv.cap >= 100
    snap = kv.export(1, 100)
    assert kv.import_(2, snap, 80) == 80 and kv.seq_len(2) == 80
    assert torch.equal(kv.k[0][kv.row_of[2], :80], torch.ones(80, 1, 2))


# --- admission with the slot pool ----------------------------------------------------------
def test_admission_resident_first_with_bounded_bypass():
    from worker.lora.pool import LoraPool
    from worker.serving.admission import ADMIT_LOOKAHEAD, MAX_BYPASS, admission_order

    pool = LoraPool(2, 8)
    pool.acquire([A])
    pool.release([A])  # A resident, unheld
    head = request([1, 2], AdapterSet.of({1: (B, 1.0)}))
    warm = request([1, 2], AdapterSet.of({0: (A, 1.0)}))
    base = request([1, 2], EMPTY_SET)  # no adapters: always "resident"
    cold = request([1, 2], AdapterSet.of({5: (adapter("cccc", seed=9), 1.0)}))
    assert admission_order([head, warm, cold, base], pool) == [warm, base, head, cold]
    head.bypassed = MAX_BYPASS  # passed over enough: strict FIFO until it gets in
    assert admission_order([head, warm, cold, base], pool) == [head]
    many = [head] + [request([1, 2], AdapterSet.of({0: (A, 1.0)})) for _ in range(ADMIT_LOOKAHEAD + 3)]
    head.bypassed = 0
    assert len(admission_order(many, pool)) == ADMIT_LOOKAHEAD  # a bounded window


def test_the_worker_refuses_an_adapter_scale_above_the_limit_too():
    """Behind the control plane's check (``resolution.check_scale``): a peer holding the worker
    secret that sends 1e30 is refused at the worker's edge (``AdapterScales.from_proto``), not
    served NaN logits; negative scales pass there (the control plane refuses them itself)."""
    amap = pb.AdapterMap(entries=[pb.AdapterScale(id=i, scale=s) for i, s in ((3, 10000.0), (4, 0.0), (5, -2.0))])
    assert AdapterScales.from_proto(amap).entries == ((3, 10000.0), (5, -2.0))
    for scale in (1e30, -1e30, 10000.5):
        text = f"adapter 3: scale {scale:g} is above the limit of 10000"
        with pytest.raises(AdapterScalesError, match=re.escape(text)):
            AdapterScales.from_proto(pb.AdapterMap(entries=[pb.AdapterScale(id=3, scale=scale)]))
