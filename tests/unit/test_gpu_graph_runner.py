"""The bucketed graph runner of the GPU engine on the CPU with capture off (and with a stand-in
graph that replays by re-running its step, for the capture bookkeeping): bucket choice and
padding values, static buffers that keep their storage, counters, the eager fallbacks, and a
toy model on the paged KV cache with device sampling whose decode steps through the runner
equal one-sequence-at-a-time steps as sequences come and go. The ``gpu`` tier repeats the
toy model with real CUDA graphs against eager."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
import torch

from worker.gpu.graph_runner import GraphRunner, HostStep, StepInputs, capture_sizes
from worker.gpu.paged_kv import PagedKVCache
from worker.gpu.sampling import SamplingPlan, SamplingRows, SamplingState, SamplingTensors, fetch, unpack
from worker.runtime.sampling import SamplingParams

CPU = torch.device("cpu")
N_VOCAB, MAX_LORAS, MAX_BLOCKS = 40, 2, 8


class RerunGraph:
    """Stands in for a CUDA graph: capture runs the step once and keeps its outputs; a replay
    runs it again and writes the results into those outputs (a replay's effect)."""

    def __init__(self):
        self.fn = None
        self.out: dict[str, torch.Tensor] = {}

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self):
        for name, t in self.fn().items():
            self.out[name].copy_(t)


class Recorder:
    """A step function that keeps a copy of what it was given and returns row ids."""

    def __init__(self):
        self.calls: list[StepInputs] = []
        self.ptrs: list[int] = []

    def __call__(self, inp: StepInputs) -> dict[str, torch.Tensor]:
        self.ptrs.append(inp.token_ids.data_ptr())
        self.calls.append(
            StepInputs(
                **{f.name: getattr(inp, f.name).clone() for f in fields(StepInputs) if f.name != "sampling"},
                sampling=None
                if inp.sampling is None
                else SamplingTensors(
                    **{f.name: getattr(inp.sampling, f.name).clone() for f in fields(SamplingTensors)}
                ),
            )
        )
        return {"rows": inp.token_ids * 10 + inp.positions}


def _runner(forward, *, capture=False, sizes=None, factory=None, max_slots=8) -> GraphRunner:
    state = SamplingState(max_seqs=max_slots, n_vocab=N_VOCAB, device=CPU, penalties=False)
    return GraphRunner(
        forward,
        max_slots=max_slots,
        max_loras=MAX_LORAS,
        max_blocks_per_seq=MAX_BLOCKS,
        device=CPU,
        capture=capture,
        sampling=state,
        sizes=sizes,
        warmup_runs=2,
        graph_factory=factory,
    )


def _decode_step(n: int, first_token: int = 1) -> HostStep:
    ids = np.arange(first_token, first_token + n, dtype=np.int64)
    return HostStep.decode(
        token_ids=ids,
        positions=ids + 100,
        slot_mapping=ids + 200,
        lora_scales=np.full((n, MAX_LORAS), 0.5, np.float32),
        block_tables=np.tile(np.arange(1, MAX_BLOCKS + 1, dtype=np.int32), (n, 1)),
        seq_lens=np.full(n, 7, np.int32),
        sampling=SamplingRows.from_params([SamplingParams(temperature=0.5, top_p=0.9)] * n, list(range(n))),
    )


def test_capture_sizes_and_buckets():
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert capture_sizes(200) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 200)
    assert capture_sizes(1) == (1,) and capture_sizes(3) == (1, 2, 3) and capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    with pytest.raises(ValueError, match="max_slots must be >= 1"):
        capture_sizes(0)
    r = _runner(Recorder())
    assert [r.bucket_for(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        _runner(Recorder(), capture=True)
    with pytest.raises(ValueError, match=r"buckets must lie in 1..8"):
        _runner(Recorder(), sizes=(4, 16))


def test_a_decode_step_is_padded_to_its_bucket_through_static_buffers():
    rec = Recorder()
    r = _runner(rec)
    out = r.run(_decode_step(3))
    got = rec.calls[-1]
    assert got.n_seqs == 4  # bucket 4
    assert got.token_ids.tolist() == [1, 2, 3, 0]
    assert got.positions.tolist() == [101, 102, 103, 0]
    assert got.slot_mapping.tolist() == [201, 202, 203, 0]  # the pad row writes the null block
    assert got.lora_scales.tolist() == [[0.5, 0.5]] * 3 + [[0.0, 0.0]]
    assert got.block_tables[3].tolist() == [0] * MAX_BLOCKS and got.block_tables[0].tolist() == list(range(1, 9))
    assert got.seq_lens.tolist() == [7, 7, 7, 1]
    assert got.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    s = got.sampling
    assert s.temperature.tolist() == [0.5, 0.5, 0.5, 0.0] and s.seq_ids.tolist() == [0, 1, 2, 8]  # scratch row 8
    assert s.top_p[3] == 1.0 and s.repetition[3] == 1.0 and (s.masks == -1).all()
    assert out["rows"].tolist() == [111, 122, 133]  # cut to the step's rows
    # a smaller step next: the stale fourth row is padded again, the storage is the same
    r.run(_decode_step(2, first_token=5))
    assert rec.calls[-1].token_ids.tolist() == [5, 6]
    r.run(_decode_step(3, first_token=7))
    assert rec.calls[-1].token_ids.tolist() == [7, 8, 9, 0]
    assert set(rec.ptrs) == {r.static.token_ids.data_ptr()}
    assert r.stats.cuda_graph_replays == 0 and r.stats.cuda_graph_eager_fallbacks == 3


def test_prefills_and_oversized_steps_run_eager_on_their_own_tensors():
    rec = Recorder()
    r = _runner(rec, sizes=(1, 2, 4))
    out = r.run(_decode_step(6))  # past the largest bucket
    assert rec.calls[-1].n_seqs == 6 and rec.ptrs[-1] != r.static.token_ids.data_ptr()
    assert out["rows"].shape == (6,)
    prefill = HostStep(
        token_ids=np.array([4, 5, 6, 7, 8], np.int64),
        positions=np.array([0, 1, 2, 0, 1], np.int64),
        slot_mapping=np.arange(5, dtype=np.int64) + 4,
        lora_scales=np.zeros((5, MAX_LORAS), np.float32),
        query_start_loc=np.array([0, 3, 5], np.int32),
        block_tables=np.array([[1] + [0] * 7, [2] + [0] * 7], np.int32),
        seq_lens=np.array([3, 2], np.int32),
        sampling=SamplingRows.from_params([SamplingParams()] * 2, [0, 1]),
    )
    assert not prefill.is_decode
    r.run(prefill)
    assert rec.calls[-1].query_start_loc.tolist() == [0, 3, 5] and rec.calls[-1].n_tokens == 5
    assert r.stats.cuda_graph_eager_fallbacks == 2 and r.stats.cuda_graphs_captured == 0
    with pytest.raises(ValueError, match="carry sampling rows"):
        r.run(
            HostStep.decode(
                **{k: v for k, v in vars(_decode_step(1)).items() if k not in ("sampling", "query_start_loc")}
            )
        )


def test_capture_goes_largest_first_after_warmups_and_replays_count():
    rec = Recorder()
    r = _runner(rec, capture=True, factory=RerunGraph)
    r.capture_all()
    sizes = r.sizes
    assert r.stats.cuda_graphs_captured == len(sizes) == 4
    # per bucket: 2 warm-up runs and the capture's run, largest bucket first
    assert [c.n_seqs for c in rec.calls] == [n for n in reversed(sizes) for _ in range(3)]
    assert all((c.seq_lens == 1).all() and (c.token_ids == 0).all() for c in rec.calls)  # padded inputs
    out = r.run(_decode_step(3))
    assert out["rows"].tolist() == [111, 122, 133]
    first = out["rows"].data_ptr()
    out = r.run(_decode_step(3, first_token=4))
    assert out["rows"].tolist() == [144, 155, 166] and out["rows"].data_ptr() == first  # static outputs
    r.run(_decode_step(8))
    assert r.stats.cuda_graph_replays == 3 and r.stats.cuda_graph_eager_fallbacks == 0


# ------------------------------------------------------------------ a toy model on pages


class ToyModel:
    """One attention layer over the paged KV cache, a per-slot LoRA-like logit bias, and device
    sampling, with shapes that never depend on values (what capture needs)."""

    def __init__(self, cache: PagedKVCache, state: SamplingState, device: torch.device):
        g = torch.Generator().manual_seed(0)
        h, d = cache.n_head_kv, cache.head_dim_k
        self.cache, self.state, self.h, self.d = cache, state, h, d
        self.embd = torch.randn(N_VOCAB, h * d, generator=g).to(device)
        self.wq, self.wk, self.wv = (torch.randn(h * d, h * d, generator=g).to(device) / 3 for _ in range(3))
        self.out = torch.randn(h * d, N_VOCAB, generator=g).to(device)
        self.lora_bias = torch.randn(MAX_LORAS, N_VOCAB, generator=g).to(device)

    def forward(self, inp: StepInputs) -> dict[str, torch.Tensor]:
        t = inp.n_tokens
        x = self.embd[inp.token_ids] + inp.positions.unsqueeze(1).float() * 0.01
        q = (x @ self.wq).view(t, self.h, self.d)
        self.cache.write(
            0, inp.slot_mapping, (x @ self.wk).view(t, self.h, self.d), (x @ self.wv).view(t, self.h, self.d)
        )
        seq = torch.bucketize(torch.arange(t, device=x.device), inp.query_start_loc[1:].long(), right=True)
        k = self.cache.k[0][inp.block_tables.long()].flatten(1, 2)  # (S, blocks * block_size, h, d)
        v = self.cache.v[0][inp.block_tables.long()].flatten(1, 2)
        pos = torch.arange(k.shape[1], device=x.device)
        mask = pos.unsqueeze(0) <= inp.positions.unsqueeze(1)  # causal, per token
        scores = torch.einsum("thd,tphd->thp", q, k[seq]) / self.d**0.5
        att = torch.softmax(scores.masked_fill(~mask.unsqueeze(1), float("-inf")), dim=-1)
        y = torch.einsum("thp,tphd->thd", att, v[seq]).flatten(1)
        logits = y @ self.out + inp.lora_scales @ self.lora_bias
        last = logits[inp.query_start_loc[1:].long() - 1]
        packed = self._sample(last, inp.sampling)
        return {"logits": last, "packed": packed}

    def _sample(self, logits: torch.Tensor, rows: SamplingTensors | None) -> torch.Tensor:
        from worker.gpu.sampling import sample

        assert rows is not None
        return sample(logits, rows, self.state, SamplingPlan.full(n_logprobs=2))


PARAMS = [
    SamplingParams(logprobs=2),
    SamplingParams(temperature=0.9, top_k=8),
    SamplingParams(temperature=0.7, top_p=0.8, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(frequency_penalty=0.5, presence_penalty=0.2),
]


class Engine:
    """A cache, a sampling state and the toy model, driven step by step like a scheduler."""

    def __init__(self, device: torch.device, max_seqs: int = 6):
        self.cache = PagedKVCache(
            n_layer=1,
            n_head_kv=2,
            head_dim_k=4,
            head_dim_v=4,
            block_size=4,
            n_blocks=40,
            max_seqs=max_seqs,
            n_ctx_seq=4 * MAX_BLOCKS,
            dtype=torch.float32,
            device=device,
        )
        self.state = SamplingState(max_seqs=max_seqs, n_vocab=N_VOCAB, device=device)
        self.model = ToyModel(self.cache, self.state, device)
        self.last: dict[int, int] = {}  # seq → its last token

    def start(self, seq: int, prompt: list[int]) -> HostStep:
        self.cache.free(seq)
        self.state.start(seq, seed=1000 + seq, prompt=prompt)
        slots = self.cache.allocate(seq, len(prompt))
        self.cache.sync()
        tables, lens = self.cache.table_rows([seq])
        return HostStep(
            token_ids=np.array(prompt, np.int64),
            positions=np.arange(len(prompt), dtype=np.int64),
            slot_mapping=slots,
            lora_scales=np.tile(self._scales(seq), (len(prompt), 1)),
            query_start_loc=np.array([0, len(prompt)], np.int32),
            block_tables=tables,
            seq_lens=lens,
            sampling=SamplingRows.from_params([PARAMS[seq % len(PARAMS)]], [seq]),
        )

    def decode(self, seqs: list[int]) -> HostStep:
        slots = np.concatenate([self.cache.append(s) for s in seqs])
        self.cache.sync()
        tables, lens = self.cache.table_rows(seqs)
        return HostStep.decode(
            token_ids=np.array([self.last[s] for s in seqs], np.int64),
            positions=lens.astype(np.int64) - 1,
            slot_mapping=slots,
            lora_scales=np.stack([self._scales(s) for s in seqs]),
            block_tables=tables,
            seq_lens=lens,
            sampling=SamplingRows.from_params([PARAMS[s % len(PARAMS)] for s in seqs], seqs),
        )

    @staticmethod
    def _scales(seq: int) -> np.ndarray:
        return np.array([seq % 2, 0.5 * (seq % 3)], np.float32)

    def take(self, seqs: list[int], out: dict[str, torch.Tensor]) -> list[tuple[int, float]]:
        sampled = unpack(fetch(out["packed"]), [2] * len(seqs))
        for s, tok in zip(seqs, sampled, strict=True):
            self.last[s] = tok.token_id
        return [(t.token_id, t.logprob) for t in sampled]


# which sequences decode at each step: sequences finish (free) and new ones start in between
SCHEDULE = [[0, 1], [0, 1, 2], [2, 1, 0], [1, 2], [1, 2, 3, 4], [4, 3, 1], [3, 4, 5, 1, 2], [5, 2]]
PROMPTS = {s: [(7 * s + j) % N_VOCAB for j in range(3 + 2 * s)] for s in range(6)}


def _serve(device: torch.device, capture: bool, factory=None) -> tuple[list, GraphRunner]:
    """The schedule through a runner: prefills when a sequence first appears, decode steps
    otherwise; returns every step's ``(token, log-prob)`` per row and the runner."""
    e = Engine(device)
    runner = GraphRunner(
        e.model.forward,
        max_slots=4,  # the schedule's 5-row step runs eager
        max_loras=MAX_LORAS,
        max_blocks_per_seq=MAX_BLOCKS,
        device=device,
        capture=capture,
        sampling=e.state,
        graph_factory=factory,
    )
    runner.capture_all()
    results = []
    started: set[int] = set()
    for i, seqs in enumerate(SCHEDULE):
        if i == 5:
            e.cache.free(0)  # sequence 0 finished: its blocks come back
        for s in seqs:
            if s not in started:
                started.add(s)
                results.append(e.take([s], runner.run(e.start(s, PROMPTS[s]))))
        results.append(e.take(seqs, runner.run(e.decode(seqs))))
    return results, runner


def _serve_one_at_a_time() -> list:
    """The same schedule with every sequence stepped alone, eager, without a runner."""
    e = Engine(CPU)

    def run(step: HostStep):
        dev = {f.name: torch.from_numpy(getattr(step, f.name)) for f in fields(HostStep) if f.name != "sampling"}
        return e.model.forward(StepInputs(**dev, sampling=SamplingTensors.from_rows(step.sampling, N_VOCAB, CPU)))

    results = []
    started: set[int] = set()
    for i, seqs in enumerate(SCHEDULE):
        if i == 5:
            e.cache.free(0)
        for s in seqs:
            if s not in started:
                started.add(s)
                results.append(e.take([s], run(e.start(s, PROMPTS[s]))))
        step_rows = [e.take([s], run(e.decode([s])))[0] for s in seqs]
        results.append(step_rows)
    return results


def _assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for step_a, step_b in zip(a, b, strict=True):
        assert [t for t, _ in step_a] == [t for t, _ in step_b]
        np.testing.assert_allclose([lp for _, lp in step_a], [lp for _, lp in step_b], rtol=0, atol=1e-5)


def test_toy_model_steps_through_the_runner_equal_one_sequence_at_a_time():
    reference = _serve_one_at_a_time()
    eager, runner = _serve(CPU, capture=False)
    _assert_same(eager, reference)
    assert runner.stats.cuda_graph_eager_fallbacks == len(SCHEDULE) + 6 and runner.stats.cuda_graph_replays == 0
    replayed, runner = _serve(CPU, capture=True, factory=RerunGraph)
    _assert_same(replayed, reference)
    assert runner.stats.cuda_graph_replays == len(SCHEDULE) - 1  # the 5-row step is past the largest bucket
    assert runner.stats.cuda_graph_eager_fallbacks == 6 + 1  # six prefills and that step


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the gpu tier needs a CUDA device (none here)")
def test_cuda_graph_replay_equals_eager_on_the_device():
    cuda = torch.device("cuda")
    eager, _ = _serve(cuda, capture=False)
    replayed, runner = _serve(cuda, capture=True)
    _assert_same(replayed, eager)
    assert runner.stats.cuda_graphs_captured == len(capture_sizes(4))
    assert runner.stats.cuda_graph_replays == len(SCHEDULE) - 1
