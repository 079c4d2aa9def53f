"""The decode step against its memory bound, with where the time goes (``loraplane bench
--synthetic``; recorded as ``step`` beside scenario 1).

`run_device_step` runs `StepBench` in-process for every batch size and adapter mix
(`mixes_for`: base, one adapter, N distinct): per (B, mix) the step's wall time, its memory
bound (weights, KV bytes by `kv_bytes_per_position`, adapters, over the measured copy rate),
the step thread's host time, and on CUDA the kernels, launches and GPU busy time of one
profiled step (`kernel_stats`).

Every figure's definition: ``bench/README.md``, "Details per tool"; docs/gpu.md (table 1b).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from bench.engine import STEP_THREAD, _sync, random_tokens, token_hi
from bench.profiles import Profile
from bench.roofline import weight_bytes_per_step
from bench.stats import Figure, ratio
from bench.synth import AdapterFactory
from worker.lora.adapter import LoraAdapter, load_lora_adapter
from worker.lora.adapter_set import EMPTY_SET, AdapterSet
from worker.runtime.context import AdapterContext, Model, UBatch
from worker.runtime.model import LoadedModel

COPY_MIB_CUDA = 1024
"""Size of the tensor whose device-to-device copy gives the copy rate on CUDA (1 GiB)."""
LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cudaLaunchCooperativeKernel",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
    "cuGraphLaunch",
)
"""Host API calls that start work on the GPU: one per kernel, or one per replayed CUDA graph."""
WARMUP_STEPS = 2


@dataclass(frozen=True)
class TraceEvent:
    """One profiler event, as `kernel_stats` reads it: on the device or not, name, µs range."""

    on_device: bool
    name: str
    start_us: float
    end_us: float


def kernel_stats(events: Iterable[TraceEvent]) -> dict:
    """Counts and busy time of one profiled step.

    Returns:
        ``kernels``: device events that are kernels (not ``Memcpy``/``Memset``); ``copies``:
        device memcpy/memset events; ``launches``: host calls of `LAUNCH_CALLS`;
        ``graph_launches``: those that replay a CUDA graph; ``busy_us``: length of the union of
        the device events' intervals (overlapping kernels on several streams count once).
    """
    kernels = copies = launches = graphs = 0
    spans: list[tuple[float, float]] = []
    for e in events:
        if e.on_device:
            if e.name.startswith(("Memcpy", "Memset")):
                copies += 1
            else:
                kernels += 1
            spans.append((e.start_us, e.end_us))
        elif e.name in LAUNCH_CALLS:
            launches += 1
            graphs += "Graph" in e.name
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    return {"kernels": kernels, "copies": copies, "launches": launches, "graph_launches": graphs, "busy_us": busy}


def _profile_step(run: Callable[[], object], device: torch.device) -> dict:
    """`kernel_stats` of one call of ``run`` under ``torch.profiler`` (CPU + CUDA activities)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        _sync(device)
    return kernel_stats(
        TraceEvent(e.device_type == DeviceType.CUDA, e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
    )


@dataclass(frozen=True)
class Mix:
    """An adapter mix: its label, the adapter ids per row (cycled), distinct adapters."""

    label: str
    ids: tuple[int, ...]

    def sets(self, adapters: dict[int, LoraAdapter]) -> tuple[AdapterSet, ...]:
        if not self.ids:
            return (EMPTY_SET,)
        return tuple(AdapterSet.of({i: (adapters[i], 1.0)}) for i in self.ids)

    def set_index(self, batch: int) -> list[int] | None:
        return [r % len(self.ids) for r in range(batch)] if len(self.ids) > 1 else None


def mixes_for(batch: int, distinct: Sequence[int]) -> list[Mix]:
    """The adapter mixes measured at batch ``batch``: base, one adapter, and each ``N`` of
    ``distinct`` with ``1 < N ≤ batch``."""
    out = [Mix("base", ()), Mix("1 adapter", (0,))]
    out += [Mix(f"{n} distinct", tuple(range(n))) for n in distinct if 1 < n <= batch]
    return out


def kv_bytes_per_position(ctx: AdapterContext) -> int:
    """Bytes of K and V one position holds over all layers (``n_layer · n_head_kv · (dk + dv) ·
    element size`` of the context's KV cache)."""
    kv = ctx.kv
    elem = torch.empty((), dtype=kv.dtype).element_size()
    return kv.n_layer * kv.n_head_kv * (kv.n_embd_head_k + kv.n_embd_head_v) * elem


class StepBench:
    """One model, one context with room for the largest batch, ``max(distinct)`` adapters."""

    def __init__(self, base: LoadedModel, factory: AdapterFactory, profile: Profile, *, n_adapters: int, seed: int):
        self.base = base
        self.profile = profile
        self.seed = seed
        # every run of steps starts again from decode_ctx (seq_rm truncates)
        n_ctx_seq = profile.decode_ctx + max(WARMUP_STEPS, profile.decode_steps) + 8
        self.model = Model(base, max_loras=max(16, n_adapters))
        self.ctx = self.model.new_context(n_ctx_seq=n_ctx_seq, n_seq=max(profile.decode_batches))
        self.adapters: dict[int, LoraAdapter] = {}
        for i in range(n_adapters):
            a = load_lora_adapter(
                factory.path(i),
                base_arch=base.arch,
                base_tensors=base.tensor_ne,
                device_for=base.device_of,
                dtype=base.dtype,
            )
            self.model.adapters.add(i, a)
            self.adapters[i] = a
        self.hi = token_hi(base.n_vocab)

    def close(self) -> None:
        self.ctx.close()

    def prefill(self, n_seqs: int) -> None:
        """Give sequences ``0..n_seqs-1`` ``decode_ctx`` tokens of context (base model)."""
        rng = np.random.default_rng((self.seed, 20))
        n = self.profile.decode_ctx
        self.ctx.set_adapters(EMPTY_SET)
        per = max(1, 512 // n)
        for s0 in range(0, n_seqs, per):
            seqs = list(range(s0, min(n_seqs, s0 + per)))
            toks, pos, ids = [], [], []
            for s in seqs:
                self.ctx.kv.seq_rm(s)
                toks += random_tokens(rng, n, hi=self.hi)
                pos += list(range(n))
                ids += [s] * n
            self.ctx.decode(UBatch(toks, pos, ids, [False] * len(toks)))

    def _ubatch(self, rng: np.random.Generator, batch: int, pos: int, mix: Mix) -> UBatch:
        toks = random_tokens(rng, batch, hi=self.hi)
        return UBatch(toks, [pos] * batch, list(range(batch)), [True] * batch, mix.set_index(batch))

    def steps(self, batch: int, mix: Mix, n: int, rep: int) -> list[tuple[float, float]]:
        """``n`` decode steps from ``decode_ctx``: ``(wall s, host CPU s)`` per step."""
        return STEP_THREAD.submit(self._steps, batch, mix, n, rep).result()

    def _steps(self, batch: int, mix: Mix, n: int, rep: int) -> list[tuple[float, float]]:
        rng = np.random.default_rng((self.seed, 21, batch, rep))
        ctx, dev, n_ctx = self.ctx, self.base.device, self.profile.decode_ctx
        ctx.set_adapters(mix.sets(self.adapters))
        for s in range(batch):
            ctx.kv.seq_rm(s, n_ctx)
        out = []
        for i in range(n):
            ub = self._ubatch(rng, batch, n_ctx + i, mix)
            _sync(dev)
            t0, h0 = time.perf_counter(), time.thread_time()
            ctx.decode(ub)
            h1 = time.thread_time()
            _sync(dev)
            out.append((time.perf_counter() - t0, h1 - h0))
        return out

    def profiled_step(self, batch: int, mix: Mix) -> dict:
        """`kernel_stats` of one more step (run after `steps`, at ``decode_ctx``)."""

        def run() -> dict:
            rng = np.random.default_rng((self.seed, 22, batch))
            self.ctx.set_adapters(mix.sets(self.adapters))
            for s in range(batch):
                self.ctx.kv.seq_rm(s, self.profile.decode_ctx)
            ub = self._ubatch(rng, batch, self.profile.decode_ctx, mix)
            return _profile_step(lambda: self.ctx.decode(ub), self.base.device)

        return STEP_THREAD.submit(run).result()


def run_device_step(
    base: LoadedModel,
    factory: AdapterFactory,
    profile: Profile,
    *,
    distinct: Sequence[int],
    seed: int,
    bandwidth: dict,
    log: Callable[[str], None],
) -> dict:
    """Every (batch, adapter mix) of the module docstring. Returns JSON-ready results
    (`bench.report.step_section` renders them); ``bandwidth`` is
    `bench.engine.measure_bandwidth`'s."""
    p = profile
    n_adapters = max([1, *(n for n in distinct if n <= max(p.decode_batches))])
    sb = StepBench(base, factory, p, n_adapters=n_adapters, seed=seed)
    try:
        sb.prefill(max(p.decode_batches))
        rate = bandwidth["gb_s"]["median"] * 1e9
        kv_pos = kv_bytes_per_position(sb.ctx)
        weights = weight_bytes_per_step(base)
        attended = p.decode_ctx + (p.decode_steps + 1) / 2  # context + the new token, mean over the steps
        on_cuda = base.device.type == "cuda"
        rows: list[dict] = []
        for batch in p.decode_batches:
            for mix in mixes_for(batch, distinct):
                sb.steps(batch, mix, WARMUP_STEPS, rep=999)  # warm-up (plans, allocator, first kernels)
                wall, host = [], []
                for rep in range(p.reps):
                    st = sb.steps(batch, mix, p.decode_steps, rep)
                    wall.append(sum(w for w, _ in st) / len(st))
                    host.append(sum(h for _, h in st) / len(st))
                a_bytes = sum(sb.adapters[i].size_bytes for i in set(mix.ids))
                kv = int(batch * attended * kv_pos)
                bound_s = (weights + kv + a_bytes) / rate
                step = Figure.of([w * 1e3 for w in wall], "ms")
                row = {
                    "batch": batch,
                    "mix": mix.label,
                    "n_adapters": len(mix.ids),
                    "step_ms": step.to_json(),
                    "tok_s": Figure.of([batch / w for w in wall], "tok/s").to_json(),
                    "host_ms": Figure.of([h * 1e3 for h in host], "ms").to_json(),
                    "bytes": {"weights": weights, "kv": kv, "adapters": a_bytes, "total": weights + kv + a_bytes},
                    "bound_ms": bound_s * 1e3,
                    "step_over_bound": ratio(step.median, bound_s * 1e3),
                    "profile": None,
                }
                if on_cuda:
                    prof = sb.profiled_step(batch, mix)
                    prof["busy_ms"] = prof.pop("busy_us") / 1e3
                    prof["busy_frac"] = ratio(prof["busy_ms"], step.median)
                    row["profile"] = prof
                rows.append(row)
                log(
                    f"step: B={batch} {mix.label}: {step.median:.2f} ms (bound {bound_s * 1e3:.3f} ms, "
                    f"host {row['host_ms']['median']:.2f} ms"
                    + (f", {row['profile']['kernels']} kernels" if row["profile"] else "")
                    + ")"
                )
        return {
            "device": str(base.device),
            "dtype": str(base.dtype).removeprefix("torch."),
            "model": base.path.name,
            "decode_ctx": p.decode_ctx,
            "decode_steps": p.decode_steps,
            "attended_positions": attended,
            "bandwidth": bandwidth,
            "weight_bytes_per_step": weights,
            "kv_bytes_per_position": kv_pos,
            "adapter_bytes": sb.adapters[0].size_bytes,
            "adapter_rank": sb.adapters[0].ranks[0],
            "rows": rows,
        }
    finally:
        sb.close()
