"""Scenario 1 (engine decode, in-process) and the measurements scenario 5 needs.

Drives ``worker.runtime.context.WorkerContext.decode`` directly — no gRPC, no scheduler — so the
figures are the model's own cost: prompt processing (one ubatch of ``pp_tokens`` rows, logits
for the last row only) and decode steps at batch 1, 8, 16 and 32 (one row per sequence, logits
for every row, as the scheduler asks), on the base model and with one rank-8 adapter on every
linear weight. Each decode step is also timed with the scheduler's greedy sampling after it
(``greedy_rows`` over the batch, then ``Sampler.sample`` per row with its log-prob):
``step_sampled_ms``, the in-process step the serving scheduler's step interval is compared
with. Repetitions alternate base and LoRA so machine noise hits both alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.profiles import Profile
from bench.stats import Figure, ratio
from worker.lora.adapter import load_lora_adapter
from worker.lora.adapter_set import EMPTY_SET, AdapterSet
from worker.runtime.context import Model
from worker.runtime.context_base import AdapterContext, UBatch
from worker.runtime.model import LoadedModel
from worker.runtime.sampling import Sampler, SamplingParams, greedy_rows, greedy_top

TOKEN_LO, TOKEN_HI = 1000, 200_000  # ordinary vocabulary ids (no special tokens)
N_BATCH = 512  # rows per ubatch when prefilling several sequences
PP_SEQ = 10_000  # KV sequence of the prompt-processing figure (decode uses 0..B-1)
STEP_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-step")
"""The one thread the in-process decode steps run on (the worker's scheduler thread's kind)."""


def token_hi(n_vocab: int) -> int:
    """Upper bound (exclusive) of the random prompt ids for a vocabulary of ``n_vocab`` tokens:
    200 000 or the first 95 % of the ids, whichever is lower — special and control tokens sit
    at the end of BPE vocabularies (Qwen: 151 643+, Llama 3: 128 000+), never among these."""
    return min(TOKEN_HI, int(n_vocab * 0.95))


def random_tokens(rng: np.random.Generator, n: int, *, bos: int | None = None, hi: int = TOKEN_HI) -> list[int]:
    """``n`` ids drawn uniformly from ``[TOKEN_LO, hi)``, the first replaced by ``bos`` when given."""
    toks = rng.integers(TOKEN_LO, hi, size=n).tolist()
    if bos is not None and n > 0:
        toks[0] = bos
    return [int(t) for t in toks]


def with_bos(bos: int | None, toks: list[int]) -> list[int]:
    """``[bos] + toks``, or ``toks`` for a model that adds no BOS (Qwen)."""
    return ([bos] if bos is not None else []) + toks


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class EngineBench:
    """One loaded model, one context, one registered synthetic adapter."""

    base: LoadedModel
    ctx: AdapterContext
    sets: dict[str, AdapterSet]
    adapter_bytes: int
    seed: int
    adapter_rank: int = 8

    @classmethod
    def create(cls, base: LoadedModel, adapter_path, *, n_ctx_seq: int, seed: int, n_seq: int = 1) -> EngineBench:
        model = Model(base)
        # n_seq: the decode sequences plus the prompt-processing one (the GPU engine's KV rows are fixed)
        ctx = model.new_context(n_ctx_seq=n_ctx_seq, n_seq=n_seq + 1)
        adapter = load_lora_adapter(
            adapter_path, base_arch=base.arch, base_tensors=base.tensor_ne, device_for=base.device_of, dtype=base.dtype
        )
        model.adapters.add(0, adapter)
        sets = {"base": EMPTY_SET, "lora": AdapterSet.of({0: (adapter, 1.0)})}
        return cls(base, ctx, sets, adapter.size_bytes, seed, adapter.ranks[0])

    @property
    def bos(self) -> int | None:
        tok = self.base.tokenizer
        return tok.bos_id if tok.add_bos else None

    @property
    def hi(self) -> int:
        return token_hi(self.base.n_vocab)

    def prompt_processing(self, variant: str, n: int, rep: int) -> float:
        """Seconds for one ``n``-row ubatch of a fresh sequence."""
        rng = np.random.default_rng((self.seed, 1, rep))
        toks = random_tokens(rng, n, bos=self.bos, hi=self.hi)
        self.ctx.set_adapters(self.sets[variant])
        self.ctx.kv.seq_rm(PP_SEQ)
        ub = UBatch(toks, list(range(n)), [PP_SEQ] * n, [False] * (n - 1) + [True])
        _sync(self.base.device)
        t0 = time.perf_counter()
        self.ctx.decode(ub)
        _sync(self.base.device)
        dt = time.perf_counter() - t0
        self.ctx.kv.seq_rm(PP_SEQ)
        return dt

    def prefill_sequences(self, n_seqs: int, n_ctx: int) -> None:
        """Give sequences ``0..n_seqs-1`` a context of ``n_ctx`` tokens (base set)."""
        rng = np.random.default_rng((self.seed, 2))
        self.ctx.set_adapters(self.sets["base"])
        per = max(1, N_BATCH // n_ctx)
        for s0 in range(0, n_seqs, per):
            seqs = list(range(s0, min(n_seqs, s0 + per)))
            toks, pos, ids = [], [], []
            for s in seqs:
                self.ctx.kv.seq_rm(s)
                toks += random_tokens(rng, n_ctx, bos=self.bos, hi=self.hi)
                pos += list(range(n_ctx))
                ids += [s] * n_ctx
            self.ctx.decode(UBatch(toks, pos, ids, [False] * len(toks)))

    def decode_steps(self, variant: str, batch: int, steps: int, n_ctx: int, rep: int) -> tuple[float, float]:
        """``steps`` decode steps of ``batch`` sequences (each back at ``n_ctx``), each followed by
        the scheduler's greedy sampling of every row (``StepRunner.run``: one batched
        ``greedy_rows`` for B > 1, then ``Sampler.sample`` per row). Returns ``(seconds of the
        decodes, seconds of decodes + sampling)``.

        Run on a thread of its own (:data:`STEP_THREAD`), as the worker runs its steps on the
        scheduler thread, not the main thread: on the main thread torch's element-wise ops fan
        out to libgomp's team (a futex wake-up per op under ``OMP_WAIT_POLICY=PASSIVE``), which
        measured a Gemma 3 B=16 step at 82–85 ms against 62–67 ms on the scheduler thread."""
        return STEP_THREAD.submit(self._decode_steps, variant, batch, steps, n_ctx, rep).result()

    def _decode_steps(self, variant: str, batch: int, steps: int, n_ctx: int, rep: int) -> tuple[float, float]:
        rng = np.random.default_rng((self.seed, 3, batch, rep))
        self.ctx.set_adapters(self.sets[variant])
        for s in range(batch):
            self.ctx.kv.seq_rm(s, n_ctx)
        seqs = list(range(batch))
        samplers = [Sampler(SamplingParams(max_tokens=steps)) for _ in seqs]
        t_decode = t_all = 0.0
        for i in range(steps):
            toks = random_tokens(rng, batch, hi=self.hi)
            _sync(self.base.device)
            t0 = time.perf_counter()
            res = self.ctx.decode(UBatch(toks, [n_ctx + i] * batch, seqs, [True] * batch))
            _sync(self.base.device)
            t1 = time.perf_counter()
            rows = list(range(len(res.out_rows)))  # every row is an output row, in batch order
            if batch > 1:
                logp, top = greedy_rows(res.logits, rows, greedy_top(samplers))
                for j, r in enumerate(rows):
                    samplers[j].sample(res.logits[r], logp=logp[j], argmax=top[j])
            else:
                samplers[0].sample(res.logits[0])
            t2 = time.perf_counter()
            t_decode += t1 - t0
            t_all += t2 - t0
        return t_decode, t_all


def run_engine(
    base: LoadedModel, adapter_path: Path, profile: Profile, *, seed: int, log: Callable[[str], None]
) -> dict:
    """Scenario 1. Returns JSON-ready results (see ``bench.report.engine_rows``)."""
    p = profile
    max_b = max(p.decode_batches)
    n_ctx_seq = max(p.pp_tokens, p.decode_ctx + p.decode_steps) + 8
    eb = EngineBench.create(base, adapter_path, n_ctx_seq=n_ctx_seq, seed=seed, n_seq=max_b)
    variants = ("base", "lora")
    log(f"engine: warm-up (dtype {str(base.dtype).removeprefix('torch.')}, device {base.device})")
    eb.prefill_sequences(max_b, p.decode_ctx)
    for v in variants:  # warm-up, excluded: plan build, allocator, first-call kernels
        eb.prompt_processing(v, min(64, p.pp_tokens), rep=999)
        for b in p.decode_batches:
            eb.decode_steps(v, b, 1, p.decode_ctx, rep=999)
    pp: dict[str, list[float]] = {v: [] for v in variants}
    dec: dict[str, dict[int, list[float]]] = {v: {b: [] for b in p.decode_batches} for v in variants}
    dec_s: dict[str, dict[int, list[float]]] = {v: {b: [] for b in p.decode_batches} for v in variants}
    for rep in range(p.reps):
        for v in variants:
            dt = eb.prompt_processing(v, p.pp_tokens, rep)
            pp[v].append(dt)
            log(f"engine: rep {rep + 1}/{p.reps} {v}: pp{p.pp_tokens} {p.pp_tokens / dt:.1f} tok/s")
        for b in p.decode_batches:
            for v in variants:
                t_dec, t_all = eb.decode_steps(v, b, p.decode_steps, p.decode_ctx, rep)
                dec[v][b].append(t_dec)
                dec_s[v][b].append(t_all)
            log(
                f"engine: rep {rep + 1}/{p.reps} decode B={b}: "
                f"base {dec['base'][b][-1] / p.decode_steps * 1e3:.0f} ms/step "
                f"({dec_s['base'][b][-1] / p.decode_steps * 1e3:.0f} with sampling), "
                f"lora {dec['lora'][b][-1] / p.decode_steps * 1e3:.0f} ms/step"
            )
    out: dict = {
        "dtype": str(base.dtype).removeprefix("torch."),
        "device": str(base.device),
        "torch_threads": torch.get_num_threads(),
        "adapter_rank": eb.adapter_rank,
        "adapter_bytes": eb.adapter_bytes,
        "pp_tokens": p.pp_tokens,
        "decode_steps": p.decode_steps,
        "decode_ctx": p.decode_ctx,
        "variants": {},
    }
    for v in variants:
        out["variants"][v] = {
            "pp_tok_s": Figure.of([p.pp_tokens / t for t in pp[v]], "tok/s").to_json(),
            "decode": {
                str(b): {
                    "tok_s": Figure.of([b * p.decode_steps / t for t in dec[v][b]], "tok/s").to_json(),
                    "step_ms": Figure.of([t / p.decode_steps * 1e3 for t in dec[v][b]], "ms").to_json(),
                    "step_sampled_ms": Figure.of([t / p.decode_steps * 1e3 for t in dec_s[v][b]], "ms").to_json(),
                }
                for b in p.decode_batches
            },
        }
    base_v, lora_v = out["variants"]["base"], out["variants"]["lora"]
    out["lora_overhead"] = {
        "pp": ratio(base_v["pp_tok_s"]["median"], lora_v["pp_tok_s"]["median"]),
        **{
            f"decode_b{b}": ratio(
                base_v["decode"][str(b)]["tok_s"]["median"], lora_v["decode"][str(b)]["tok_s"]["median"]
            )
            for b in p.decode_batches
        },
    }
    eb.ctx.close()
    return out


def measure_bandwidth(mib: int, reps: int, device: torch.device) -> dict:
    """Copy bandwidth: ``dst.copy_(src)`` of a ``mib`` MiB f32 tensor, read + write bytes."""
    n = mib * (1 << 20) // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: page faults, first touch
    _sync(device)
    times = []
    for _ in range(max(3, reps)):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    moved = 2 * n * 4
    del src, dst
    return {
        "bytes_moved": moved,
        "tensor_mib": mib,
        "gb_s": Figure.of([moved / t / 1e9 for t in times], "GB/s").to_json(),
    }
