"""A worker whose device is spelled ``cpu:0`` runs every path that creates or compares tensors
on the model's device, with the same results as ``cpu`` bit for bit: the forward pass, adapters
loaded onto the device and paged in and out of the slot pool (in memory and file-backed), the
prefix cache's KV snapshots, sampling, penalties and a grammar-masked step. Before the device was
resolved once, ``cpu:0`` failed at the first matmul like ``cuda`` vs ``cuda:0`` did on a GPU.

Model: the tiny MoE fixture (``tests/fixtures/tiny_moe``: llama with 4 experts, F16 matrices,
32 000 tokens), its fixture adapter (attn_q and expert branches, in memory) and a second
adapter written here (attn_q / attn_v, opened file-backed, so a page-in re-reads its file).
"""

from __future__ import annotations

import json
import queue

import gguf
import numpy as np
import pytest
import torch

from loraplane.adapter_scales import AdapterScales
from loraplane.response_format import ResponseFormat
from worker.config import Batching, PrefixCachePolicy, WorkerConfig
from worker.lora.adapter import load_lora_adapter, open_lora_adapter
from worker.lora.adapter_set import EMPTY_SET, AdapterSet
from worker.runtime.context import Model, UBatch
from worker.runtime.grammar import apply_masks, mask_words
from worker.runtime.model import load_model
from worker.runtime.sampling import Sampler, SamplingParams, greedy_rows, penalize_rows, prompt_logprobs
from worker.serving.engine import WorkerEngine
from worker.serving.request import ErrorEvent, FinishedEvent, TokenEvent

PROMPT = [1, 450, 4996, 17354, 1701, 29916]
"""A BOS-led prompt of the tiny MoE model's vocabulary (the goldens' first prompt, cut)."""


def _qv_adapter(path, seed: int = 7):
    """A rank-4, alpha-8 LoRA GGUF on ``blk.{0,1}.attn_q.weight`` and ``blk.1.attn_v.weight`` of
    the tiny MoE model (n_embd 64; q 64 rows, v 32): F32 A ~ N(0, 1/64), B ~ N(0, 0.1²)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_key_value("general.type", "adapter", gguf.GGUFValueType.STRING)
    w.add_key_value("adapter.type", "lora", gguf.GGUFValueType.STRING)
    w.add_key_value("adapter.lora.alpha", 8.0, gguf.GGUFValueType.FLOAT32)
    for name, d in (("blk.0.attn_q.weight", 64), ("blk.1.attn_q.weight", 64), ("blk.1.attn_v.weight", 32)):
        w.add_tensor(name + ".lora_a", (rng.standard_normal((4, 64)) / 8).astype(np.float32))
        w.add_tensor(name + ".lora_b", (rng.standard_normal((d, 4)) * 0.1).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _model(fixtures_dir, adapter_path, device: str):
    """The tiny MoE model on ``device`` with one adapter slot and two adapters registered:
    0 = the fixture's (in memory), 1 = ``adapter_path`` (file-backed)."""
    base = load_model(fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf", device=device)
    model = Model(base, max_loras=1, max_lora_rank=8)
    fixture = load_lora_adapter(
        fixtures_dir / "tiny_moe" / "moe_lora.gguf",
        base_arch=base.arch,
        base_tensors=base.tensor_ne,
        device_for=base.device_of,
        dtype=base.dtype,
    )
    filed = open_lora_adapter(adapter_path, base_arch=base.arch, base_tensors=base.tensor_ne, device_for=base.device_of)
    model.adapters.add(0, fixture)
    model.adapters.add(1, filed)
    return model, (fixture, filed)


@pytest.fixture(scope="module")
def models(fixtures_dir, tmp_path_factory):
    path = _qv_adapter(tmp_path_factory.mktemp("device") / "qv.gguf")
    return {dev: _model(fixtures_dir, path, dev) for dev in ("cpu:0", "cpu")}


def _prefill(ctx, seq: int = 0) -> torch.Tensor:
    ctx.kv.seq_rm(seq)
    n = len(PROMPT)
    return ctx.decode(UBatch(PROMPT, list(range(n)), [seq] * n, [True] * n)).logits


def _run(model, ads) -> dict[str, torch.Tensor]:
    """Logits of the prompt with no adapter, adapter 0, adapter 1 (pages 0 out of the one slot
    and 1 in from its file) and adapter 0 again (paged back in)."""
    ctx = model.new_context(n_ctx_seq=32)
    out = {}
    for key, sets in (
        ("base", EMPTY_SET),
        ("fixture", AdapterSet.of({0: (ads[0], 1.0)})),
        ("filed", AdapterSet.of({1: (ads[1], 0.5)})),
        ("fixture-again", AdapterSet.of({0: (ads[0], 1.0)})),
    ):
        ctx.set_adapters(sets)
        out[key] = _prefill(ctx)
    ctx.close()
    return out


def test_cpu0_is_the_device_cpu_tensors_report(models):
    model, ads = models["cpu:0"]
    base = model.base
    assert base.device == torch.device("cpu") and str(base.device) == "cpu"
    for name, w in base.weights.items():
        for part in w if isinstance(w, list) else [w]:
            assert part.device == base.device, name
    assert all(f.device == base.device for f in base.fused.values())
    for pair in ads[0].pairs.values():  # in memory: A and B where the base tensor is
        assert pair.lora_a.device == pair.lora_b.device == base.device


def test_forward_adapters_and_paging_on_cpu0_equal_cpu(models):
    (m0, ads0), (m1, ads1) = models["cpu:0"], models["cpu"]
    a, b = _run(m0, ads0), _run(m1, ads1)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert a["base"].shape == (len(PROMPT), 32000) and float(a["base"].std()) > 0.5
    # the adapters were applied (each moves the logits) and paging back gives the same logits
    assert float((a["fixture"] - a["base"]).abs().max()) > 1e-2
    assert float((a["filed"] - a["base"]).abs().max()) > 1e-2
    assert torch.equal(a["fixture-again"], a["fixture"])
    pool = m0.adapters.pool
    assert pool.stats.page_ins >= 3 and pool.stats.evictions >= 2  # one slot: every switch paged
    for w in pool.weights.values():
        assert w.a.device == w.bt.device == w.factor.device == m0.base.device
    for side in pool.side[0].values():
        assert side.lora_a.device == m0.base.device


def test_prefix_snapshot_on_cpu0_continues_like_a_fresh_prefill(models):
    model, _ = models["cpu:0"]
    ctx = model.new_context(n_ctx_seq=32, n_seq=2)
    ctx.set_adapters(EMPTY_SET)
    full = _prefill(ctx, seq=0)
    snap = ctx.kv.export(0, len(PROMPT) - 1)
    assert all(t.device == model.base.device for t in snap.k + snap.v)
    ctx.kv.import_(1, snap)
    last = ctx.decode(UBatch(PROMPT[-1:], [len(PROMPT) - 1], [1], [True])).logits
    assert float((last[0] - full[-1]).abs().max()) <= 1e-4  # decode attention vs the prompt's
    ctx.close()


def _draws(row: torch.Tensor) -> list[int]:
    """Three seeded top-k draws from one logits row."""
    return [Sampler(SamplingParams(temperature=1.0, top_k=40, seed=s)).sample(row).token_id for s in (1, 2, 3)]


def test_sampling_penalties_and_grammar_mask_on_cpu0_logits(models):
    (m0, _), (m1, _) = models["cpu:0"], models["cpu"]
    c0, c1 = m0.new_context(n_ctx_seq=32), m1.new_context(n_ctx_seq=32)
    c0.set_adapters(EMPTY_SET)
    c1.set_adapters(EMPTY_SET)
    logits, ref = _prefill(c0), _prefill(c1)
    c0.close()
    c1.close()
    assert logits.device == m0.base.device
    # greedy: the argmax, its log-prob from the row's log_softmax
    logp, ids = greedy_rows(logits, [len(PROMPT) - 1])
    want = int(torch.argmax(ref[-1]))
    assert ids == [want]
    tok = Sampler(SamplingParams(logprobs=2)).sample(logits[-1], logp=logp[0], argmax=ids[0])
    assert tok.token_id == want
    assert tok.logprob == pytest.approx(float(torch.log_softmax(ref[-1], -1)[want]), abs=1e-5)
    # seeded draws: the same tokens from cpu:0 logits as from cpu logits
    assert _draws(logits[-1]) == _draws(ref[-1])
    # penalties: the argmax token, repeated in the output, is pushed down by the frequency penalty
    pen = penalize_rows(logits, [len(PROMPT) - 1], [SamplingParams(frequency_penalty=2.0)], [PROMPT], [[want] * 3])
    assert float(pen[0, want]) == pytest.approx(float(ref[-1, want]) - 6.0, abs=1e-5)
    assert prompt_logprobs(logits[:-1], PROMPT[1:]) == prompt_logprobs(ref[:-1], PROMPT[1:])
    # a grammar-masked step: only the allowed tokens survive, the best of them is chosen
    allowed = [29871, 1576, 450]
    masks = torch.zeros((1, mask_words(logits.shape[-1])), dtype=torch.int32)
    for t in allowed:
        masks[0, t // 32] |= 1 << (t % 32)
    row = logits[-1:].clone()
    apply_masks(row, [0], masks)
    assert torch.isinf(row[0]).sum() == logits.shape[-1] - len(allowed)
    best = max(allowed, key=lambda t: float(ref[-1, t]))
    assert Sampler(SamplingParams()).sample(row[0]).token_id == best


@pytest.mark.parametrize(
    ("dtype", "tol"),
    [("f16", 0.02), ("bf16", 0.15)],  # the fast tier's bf16 check (Gemma in bf16 is slow: test_runtime)
)
def test_16_bit_compute_on_cpu_with_an_adapter_stays_close_to_f32(models, fixtures_dir, dtype, tol):
    """``--dtype f16`` (and bf16) on the CPU: weights, KV cache and adapter slots in that dtype,
    logits f32; with the fixture adapter paged in, the argmax is f32's where f32's top-2 margin
    is clear (> 0.2) and the log-prob of f32's choice moves by less than ``tol`` (bf16: the bound
    of ``test_runtime.test_bf16_close_to_f32``; f16, 3 more mantissa bits, 8x tighter)."""
    (m32, _), path = models["cpu"], fixtures_dir / "tiny_moe" / "moe_lora.gguf"
    base = load_model(fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf", device="cpu:0", dtype=dtype)
    m16 = Model(base, max_loras=1, max_lora_rank=8)
    m16.adapters.add(
        0,
        load_lora_adapter(
            path, base_arch="llama", base_tensors=base.tensor_ne, device_for=base.device_of, dtype=base.dtype
        ),
    )
    out = {}
    for key, model in (("16", m16), ("32", m32)):
        # the reference keeps an f32 cache (the default under f32 compute is llama.cpp's f16)
        ctx = model.new_context(n_ctx_seq=32, kv_dtype="auto" if key == "16" else "f32")
        ctx.set_adapters(AdapterSet.of({0: (model.adapters.by_id[0], 1.0)}))
        out[key] = torch.log_softmax(_prefill(ctx), -1)
        assert ctx.kv.k[0].dtype == model.base.dtype
        ctx.close()
    assert out["16"].dtype == torch.float32
    assert all(w.a.dtype == base.dtype for w in m16.adapters.pool.weights.values())
    a, b = out["32"], out["16"]
    top2 = torch.topk(a, 2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.2
    assert clear.sum() >= 3 and torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])
    picked = a.argmax(-1, keepdim=True)
    assert float((a.gather(1, picked) - b.gather(1, picked)).abs().max()) < tol


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def _generate(engine: WorkerEngine, rid: str, params: SamplingParams, entries: list) -> tuple[list[int], str]:
    """One request through the engine's scheduler: its token ids and its finished text.

    Raises:
        AssertionError: it ended with an error event.
    """
    q: queue.Queue = queue.Queue()
    engine.submit(
        request_id=rid,
        prompt_tokens=PROMPT,
        prompt_text=None,
        params=params,
        adapters=AdapterScales(entries),
        emit=q.put,
    )
    ids = []
    while True:
        ev = q.get(timeout=120)
        assert not isinstance(ev, ErrorEvent), ev
        if isinstance(ev, TokenEvent):
            ids.append(ev.token_id)
        if isinstance(ev, FinishedEvent):
            return ids, ev.text


@pytest.mark.slow  # two worker engines of the tiny MoE model, start-up and ~50 steps (~2 s)
def test_engine_on_cpu0_serves_like_cpu(fixtures_dir):
    """A worker engine started with ``device="cpu:0"`` (the path ``--device cpu:0`` takes):
    a greedy, a penalized and a JSON-constrained request with the fixture adapter, the same
    tokens as with ``device="cpu"``."""
    fmt = ResponseFormat("json_schema", schema=json.dumps(SCHEMA))
    specs = [
        ("greedy", SamplingParams(max_tokens=6, ignore_eos=True), [(0, 1.0)]),
        ("penalized", SamplingParams(max_tokens=6, ignore_eos=True, presence_penalty=1.5, seed=3), []),
        ("json", SamplingParams(max_tokens=40, response_format=fmt), [(0, 0.5)]),
    ]
    runs = {}
    for dev in ("cpu:0", "cpu"):
        e = WorkerEngine(
            WorkerConfig(
                model_path=str(fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"),
                n_seqs=3,
                batching=Batching.MIXED,
                prefix_cache=PrefixCachePolicy.KEYED,
                device=dev,
                n_ctx_seq=128,
                grammar_warmup=False,
            )
        )
        try:
            assert e.model.base.device == torch.device("cpu")
            e.load_adapter(0, path=str(fixtures_dir / "tiny_moe" / "moe_lora.gguf"))
            runs[dev] = {rid: _generate(e, rid, params, entries) for rid, params, entries in specs}
        finally:
            e.close()
    for rid, _, _ in specs:
        assert runs["cpu:0"][rid] == runs["cpu"][rid], rid
    ids, text = runs["cpu:0"]["greedy"]
    assert len(ids) == 6
    doc = json.loads(runs["cpu:0"]["json"][1])
    assert set(doc) == {"ok", "n"} and isinstance(doc["ok"], bool)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="gpu tier: needs a CUDA GPU, this machine has none")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "auto"])
def test_cuda_spellings_run_the_forward_pass_with_an_adapter(models, fixtures_dir, tmp_path, spec):
    """On a GPU every spelling of it loads, pages an adapter in and decodes (before the device was
    resolved once, the first matmul refused ``cuda:0`` inputs for a weight on ``cuda``); every
    weight, slot buffer and KV tensor is on the resolved ``cuda:N``; the greedy tokens are the
    CPU's where the CPU's top-2 margin is wide (> 1 nat: the GPU multiplies bf16 weights)."""
    model, ads = _model(fixtures_dir, _qv_adapter(tmp_path / "qv.gguf"), spec)
    dev = model.base.device
    assert dev == torch.device("cuda", torch.cuda.current_device())
    ctx = model.new_context(n_ctx_seq=32)
    ctx.set_adapters(AdapterSet.of({1: (ads[1], 1.0)}))
    logits = _prefill(ctx)
    for w in model.base.weights.values():
        assert all(part.device == dev for part in (w if isinstance(w, list) else [w]))
    assert all(w.a.device == dev for w in model.adapters.pool.weights.values())
    assert ctx.kv.k[0].device == dev and logits.device == dev and bool(torch.isfinite(logits).all())
    ctx.close()
    cpu_model, cpu_ads = models["cpu"]
    cctx = cpu_model.new_context(n_ctx_seq=32)
    cctx.set_adapters(AdapterSet.of({1: (cpu_ads[1], 1.0)}))
    ref = _prefill(cctx)
    cctx.close()
    top2 = torch.topk(ref, 2, dim=-1).values
    wide = (top2[:, 0] - top2[:, 1]) > 1.0
    assert torch.equal(logits.cpu().argmax(-1)[wide], ref.argmax(-1)[wide])


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="gpu tier: needs two CUDA GPUs to pick the second")
def test_cuda_1_puts_the_model_on_the_second_gpu(fixtures_dir, tmp_path):
    """``--device cuda:1``: weights and KV on GPU 1, which also becomes the current device."""
    before = torch.cuda.current_device()
    try:
        model, _ = _model(fixtures_dir, _qv_adapter(tmp_path / "qv.gguf"), "cuda:1")
        assert model.base.device == torch.device("cuda", 1) and torch.cuda.current_device() == 1
        ctx = model.new_context(n_ctx_seq=32)
        ctx.set_adapters(EMPTY_SET)
        assert _prefill(ctx).device == torch.device("cuda", 1)
        ctx.close()
    finally:
        torch.cuda.set_device(before)  # the load made GPU 1 current for this whole process
