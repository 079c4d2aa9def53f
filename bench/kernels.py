"""Microbenchmark of the quantized matmul kernels on the real base model's weights.

``python -m bench.kernels [--reps 7] [--batches 1,16] [--model PATH]`` times, per distinct
(type, shape) of the model's linear weights and batch size, our C kernels (int16 and int8
activations, the AVX2 path beside AVX-512) against f32 MKL and fbgemm fp16 (`run`), then one
decode step's summed matmuls (`run_step`). Modes: ``--contention`` compares the threading
backends (`CONDITIONS`) with and without a busy neighbour; ``--amx`` the AMX tiles against
``vpdpbusd`` / ``vpdpwssd`` (`run_amx`, `run_amx_step`); ``--sampling`` the fused sampling
kernel against torch (`run_sampling`); ``--act-policy`` the per-weight activation precision
(`run_act_policy`).

What each mode measures and how: ``bench/README.md``, "Details per tool"; results and their
reading: ``worker/runtime/kernels/README.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections import defaultdict

# libgomp reads OMP_WAIT_POLICY once, when torch loads it: set before the import below.
# PASSIVE is the recommended default (see --contention and worker/runtime/kernels/README.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.machine import FLAGS  # noqa: E402
from loraplane.formats.gguf.reader import dequantize, read_gguf  # noqa: E402
from worker.runtime.kernels import cpu_flags, cpu_model, pack_tensor, resolve_act, resolve_path, supported  # noqa: E402
from worker.runtime.kernels.library import library_path  # noqa: E402

SHOW_FLAGS = FLAGS  # the flags every bench table prints (bench.machine)


def _times(fn, reps: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _bandwidth(reps: int) -> tuple[float, float]:
    """(copy GB/s counting read + write, read-only GB/s) on 256 MiB."""
    n = 64 << 20
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy = statistics.median(_times(lambda: dst.copy_(src), reps))
    read = statistics.median(_times(lambda: src.sum(), reps))
    return 2 * n * 4 / copy / 1e6, n * 4 / read / 1e6


def _fmt(ts: list[float]) -> str:
    return f"{statistics.median(ts):8.2f} ({min(ts):.2f}-{max(ts):.2f})"


def _methods(rec, path: str, with_baselines: bool):
    """name -> (callable(x), weight bytes read)."""
    ql = pack_tensor(rec)
    out = {
        "ours": (lambda x: ql.matmul(x, path=path, act="i16"), ql.nbytes),
        "ours-i8": (lambda x: ql.matmul(x, path=path, act="i8"), ql.nbytes),
    }
    if path == "avx512" and supported("avx2"):
        out["ours-avx2"] = (lambda x: ql.matmul(x, path="avx2", act="i16"), ql.nbytes)
        out["ours-avx2-i8"] = (lambda x: ql.matmul(x, path="avx2", act="i8"), ql.nbytes)
    if with_baselines:
        w = torch.from_numpy(np.array(dequantize(rec.name, rec), dtype=np.float32))
        out["f32"] = (lambda x: x @ w.T, w.nbytes)
        if hasattr(torch, "fbgemm_pack_gemm_matrix_fp16"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                packed = torch.fbgemm_pack_gemm_matrix_fp16(w)
            zb = torch.zeros(w.shape[0])
            out["fbgemm-fp16"] = (lambda x: torch.fbgemm_linear_fp16_weight(x, packed, zb), w.numel() * 2)
    return out


def run(model: str, reps: int, batches: list[int], baselines: bool = True, quiet: bool = False) -> dict:
    """Time every distinct linear weight; returns {(method, B): summed step ms}."""
    path = resolve_path()
    gf = read_gguf(model)
    groups: dict[tuple, list[str]] = defaultdict(list)
    for name, rec in gf.tensors.items():
        if len(rec.ne) == 2:
            groups[(rec.ggml_type.name, rec.ne)].append(name)
    step: dict[tuple[str, int], float] = defaultdict(float)
    if not quiet:
        print(
            f"{'weight':34s} {'type':5s} {'d x k':>13s} {'B':>3s} {'method':12s} "
            f"{'median ms (min-max)':>24s} {'GB/s':>6s}"
        )
    for (tname, ne), names in sorted(groups.items(), key=lambda kv: -np.prod(kv[0][1])):
        rec = gf.tensors[names[0]]
        count = len(names)
        meths = _methods(rec, path, baselines)
        for b in batches:
            x = torch.randn(b, ne[0])
            for m, (fn, nbytes) in meths.items():
                ts = _times(lambda fn=fn, x=x: fn(x), reps)
                med = statistics.median(ts)
                step[(m, b)] += med * count
                if not quiet:
                    label = names[0] if count == 1 else f"{names[0]} (x{count})"
                    print(
                        f"{label:34s} {tname:5s} {ne[1]:>6d}x{ne[0]:<6d} {b:>3d} {m:12s} {_fmt(ts):>24s} "
                        f"{nbytes / med / 1e6:6.1f}"
                    )
        del meths
    return step


def run_step(model: str, reps: int, batches: list[int], baselines: bool = True) -> dict:
    """One decode step's matmuls in model order (every layer's weights, then the output
    projection), weights streamed from memory as in a real step: {(method, B): [ms per rep]}."""
    path = resolve_path()
    gf = read_gguf(model)
    recs = [r for n, r in gf.tensors.items() if len(r.ne) == 2 and n != "token_embd.weight"]
    recs.append(gf.tensors["token_embd.weight"])  # tied output projection, last
    meths: dict[str, list] = defaultdict(list)
    for rec in recs:
        for m, (fn, _) in _methods(rec, path, baselines).items():
            meths[m].append((fn, rec.ne[0]))
    out = {}
    for b in batches:
        xs = {k: torch.randn(b, k) for k in {ne for _, ne in meths["ours"]}}
        for m, fns in meths.items():
            out[(m, b)] = _times(lambda fns=fns, xs=xs: [fn(xs[k]) for fn, k in fns], reps)
    return out


# --contention conditions: (label, environment of the child process); "pool S/B" is our pool
# with LORAPLANE_KERNEL_SPIN_US=S and LORAPLANE_KERNEL_SPIN_BACKOFF_MS=B
CONDITIONS = [
    ("omp PASSIVE", {"LORAPLANE_KERNEL_THREADS": "omp", "OMP_WAIT_POLICY": "PASSIVE"}),
    ("omp ACTIVE", {"LORAPLANE_KERNEL_THREADS": "omp", "OMP_WAIT_POLICY": "ACTIVE"}),
    *(
        (
            f"pool {spin}/{backoff}",
            {
                "LORAPLANE_KERNEL_THREADS": "pool",
                "LORAPLANE_KERNEL_SPIN_US": str(spin),
                "LORAPLANE_KERNEL_SPIN_BACKOFF_MS": str(backoff),
                "OMP_WAIT_POLICY": "PASSIVE",
            },
        )
        for spin, backoff in ((0, 0), (20, 100), (50, 100))
    ),
]
DECODE_CTX = 32  # KV positions each sequence holds before the measured decode step


def _contention_child(args) -> int:
    """Child of ``--contention``: load, warm up, print ``ready``; then for each stdin line ``R``
    time R reps of (a) one decode step's matmuls (:func:`run_step`, ``ours``) and (b) one whole
    in-process decode step (``WorkerContext.decode``, base model, torch ops on libgomp) at each
    batch size, and print ``{"mm<B>": [ms...], "dec<B>": [ms...]}`` as one JSON line."""
    import json

    from worker.lora.adapter_set import EMPTY_SET
    from worker.runtime.context import Model
    from worker.runtime.context_base import UBatch
    from worker.runtime.model import load_model

    batches = [int(b) for b in args.batches.split(",")]
    path = resolve_path()
    gf = read_gguf(args.model)
    recs = [r for n, r in gf.tensors.items() if len(r.ne) == 2 and n != "token_embd.weight"]
    recs.append(gf.tensors["token_embd.weight"])
    mms = [(pack_tensor(r), r.ne[0]) for r in recs]
    xs = {b: {k: torch.randn(b, k) for k in {k for _, k in mms}} for b in batches}
    base = load_model(args.model)
    ctx = Model(base).new_context(n_ctx_seq=DECODE_CTX + 8, n_seq=max(batches))
    ctx.set_adapters(EMPTY_SET)
    nseq = max(batches)
    rng = np.random.default_rng(0)
    toks = rng.integers(1000, 200_000, size=nseq * DECODE_CTX).tolist()
    pos = [p for _ in range(nseq) for p in range(DECODE_CTX)]
    ids = [s for s in range(nseq) for _ in range(DECODE_CTX)]
    ctx.decode(UBatch(toks, pos, ids, [False] * len(toks)))

    def mm_step(b: int) -> None:
        for ql, k in mms:
            ql.matmul(xs[b][k], path=path)

    def dec_step(b: int) -> None:
        for s in range(b):
            ctx.kv.seq_rm(s, DECODE_CTX)
        ctx.decode(UBatch(rng.integers(1000, 200_000, size=b).tolist(), [DECODE_CTX] * b, list(range(b)), [True] * b))

    def timed(fn, b: int) -> float:
        t0 = time.perf_counter()
        fn(b)
        return (time.perf_counter() - t0) * 1e3

    for b in batches:
        mm_step(b)
        dec_step(b)
    print("ready", flush=True)
    for line in sys.stdin:
        reps = int(line)
        out: dict[str, list[float]] = {}
        for b in batches:
            out[f"mm{b}"] = [timed(mm_step, b) for _ in range(reps)]
            out[f"dec{b}"] = [timed(dec_step, b) for _ in range(reps)]
        print(json.dumps(out), flush=True)
    return 0


def _contention(args) -> None:
    """Every condition of :data:`CONDITIONS`, alone and with a busy process pinned to core 0,
    interleaved: one child process per condition stays loaded and is stopped (SIGSTOP) while
    the others run, so each round measures every condition back to back under the same load."""
    import json
    import signal

    batches = [int(b) for b in args.batches.split(",")]
    rounds, per = args.rounds, 2
    print(
        f"\nthread behaviour, interleaved: {rounds} rounds x {per} reps per condition and neighbour state; "
        "mm = one decode step's matmuls (ours), dec = one whole decode step in-process (base model), ms"
    )
    spin = [sys.executable, "-c", "import os\nos.sched_setaffinity(0, {0})\nwhile True: pass"]
    hog = subprocess.Popen(spin)
    os.kill(hog.pid, signal.SIGSTOP)
    children = []
    try:
        wanted = args.conditions.split(",") if args.conditions else [c for c, _ in CONDITIONS]
        for label, extra in CONDITIONS:
            if label not in wanted:
                continue
            env = dict(os.environ, **extra)
            cmd = [sys.executable, "-m", "bench.kernels", "--contention-child", "--batches", args.batches]
            cmd += ["--model", args.model]
            ch = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert ch.stdin is not None and ch.stdout is not None  # both piped
            line = ch.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"{label}: child did not start ({line!r})")
            os.kill(ch.pid, signal.SIGSTOP)
            children.append((label, ch))
        res: dict[tuple[str, bool], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in range(rounds):
            for busy in (r % 2 == 0, r % 2 == 1):
                os.kill(hog.pid, signal.SIGCONT if busy else signal.SIGSTOP)
                order = children[r % len(children) :] + children[: r % len(children)]
                for label, ch in order:
                    assert ch.stdin is not None and ch.stdout is not None
                    os.kill(ch.pid, signal.SIGCONT)
                    ch.stdin.write(f"{per}\n")
                    ch.stdin.flush()
                    got = json.loads(ch.stdout.readline())
                    os.kill(ch.pid, signal.SIGSTOP)
                    for key, ts in got.items():
                        res[(label, busy)][key] += ts
            print(f"  round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
        keys = [f"{kind}{b}" for kind in ("mm", "dec") for b in batches]
        print(f"  {'condition':14s} {'neighbour':10s} " + " ".join(f"{k:>22s}" for k in keys))
        for busy in (False, True):
            for label, _ in children:
                row = " ".join(f"{_fmt(res[(label, busy)][k]).strip():>22s}" for k in keys)
                print(f"  {label:14s} {'busy core0' if busy else 'none':10s} {row}")
    finally:
        for _, ch in children:
            ch.kill()
            os.kill(ch.pid, signal.SIGCONT)
            ch.wait()
        hog.kill()
        os.kill(hog.pid, signal.SIGCONT)
        hog.wait()


AMX_SHAPES = (  # (label, GGUF, tensor name): the LM heads and Gemma's layer shapes
    ("gemma LM head", "gemma", "token_embd.weight"),
    ("qwen LM head", "qwen", "output.weight"),
    ("gemma ffn_gate", "gemma", "blk.0.ffn_gate.weight"),
    ("gemma ffn_down", "gemma", "blk.2.ffn_down.weight"),
    ("gemma ffn_down", "gemma", "blk.0.ffn_down.weight"),
)


def _cpu_ghz() -> float:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("cpu MHz"):
                    return float(line.split(":", 1)[1]) / 1e3
    except (OSError, ValueError):
        pass
    return float("nan")


def run_amx(model: str, reps: int, batches: list[int], acts: tuple[str, ...] = ("i8", "i16")) -> None:
    """avx512 vs amx matmul per activation precision, side by side (see the module docstring):
    i8 ``vpdpbusd`` vs tiles (``csrc/qmm_amx.cpp``), i16 ``vpdpwssd`` vs tiles on the byte
    split (``csrc/qmm16_amx.cpp``; bs-16 weights run ``vpdpwssd`` in both)."""
    from pathlib import Path

    if not supported("amx") or not supported("avx512"):
        from worker.runtime.kernels.cpu import amx_unavailable_reason

        print(f"amx: unavailable here ({amx_unavailable_reason()}); nothing to compare")
        return
    nt = torch.get_num_threads()
    ghz = _cpu_ghz()
    core_peak = 1024 * ghz * 1e9  # AMX int8 MAC/s of one core
    qwen = Path.home() / ".cache/loraplane/qwen2.5-coder-0.5b-instruct.gguf"
    files = {"gemma": read_gguf(model), "qwen": read_gguf(qwen) if qwen.exists() else None}
    for act in acts:
        print(
            f"{act} matmul, avx512 vs amx (tiles), {nt} threads, {reps} reps interleaved; "
            f"AMX int8 peak {core_peak / 1e12:.2f} TMAC/s per core (1024 MAC/cycle x {ghz:.2f} GHz"
            + ("" if act == "i8" else "; an int16 MAC takes 4 int8 tile MACs: % peak counts those")
            + ")"
        )
        print(
            "wall ms median (min-max); cpu ms = median process CPU time per call (all threads; on a\n"
            "shared machine the wall time includes time-slices lost to other processes, the CPU time\n"
            "does not); speedup and GMAC per CPU-second from the CPU time, % of one core's AMX peak"
        )
        print(
            f"{'weight':16s} {'type':5s} {'d x k':>13s} {'B':>4s} {'avx512 wall ms':>26s} {'cpu ms':>8s} "
            f"{'amx wall ms':>26s} {'cpu ms':>8s} {'speedup':>7s} {'amx GMAC/cpu-s':>14s} {'% peak':>6s}"
        )
        tile_macs = 1 if act == "i8" else 4
        for label, which, name in AMX_SHAPES:
            gf = files[which]
            if gf is None:
                print(f"{label:16s} (skipped: {qwen} not found)")
                continue
            rec = gf.tensors[name]
            ql = pack_tensor(rec)
            k, d = int(rec.ne[0]), int(rec.ne[1])
            for b in batches:
                x = torch.randn(b, k)
                ts: dict[str, list[float]] = {"avx512": [], "amx": []}
                cs: dict[str, list[float]] = {"avx512": [], "amx": []}
                for p in ts:
                    ql.matmul(x, path=p, act=act)  # warm-up
                for _ in range(reps):
                    for p in ts:
                        c0, t0 = time.process_time(), time.perf_counter()
                        ql.matmul(x, path=p, act=act)
                        ts[p].append((time.perf_counter() - t0) * 1e3)
                        cs[p].append((time.process_time() - c0) * 1e3)
                cpu_v, cpu_a = statistics.median(cs["avx512"]), statistics.median(cs["amx"])
                macs = b * d * k / (cpu_a / 1e3)  # per CPU-second (the CPU time sums the threads)
                print(
                    f"{label:16s} {rec.ggml_type.name:5s} {d:>6d}x{k:<6d} {b:>4d} {_fmt(ts['avx512']):>26s} "
                    f"{cpu_v:8.2f} {_fmt(ts['amx']):>26s} {cpu_a:8.2f} {cpu_v / cpu_a:6.2f}x {macs / 1e9:14.1f} "
                    f"{100 * tile_macs * macs / core_peak:5.1f}%"
                )
            del ql


def run_amx_step(model: str, reps: int, batches: list[int], steps: int = 4, n_ctx: int = 64) -> None:
    """Whole decode steps (``WorkerContext.decode``, B sequences at a context of ``n_ctx``,
    logits for every row, the default activation policy) with ``LORAPLANE_KERNELS`` = avx512 and
    amx, the reps interleaved in one process; median ms per step (min-max)."""
    from worker.runtime.context import Model
    from worker.runtime.context_base import UBatch
    from worker.runtime.model import load_model

    if not supported("amx") or not supported("avx512"):
        return
    base = load_model(model, dtype="f32", device="cpu")
    nb = max(batches)
    ctx = Model(base).new_context(n_ctx_seq=n_ctx + steps + 8, n_seq=nb)
    rng = np.random.default_rng(0)
    ctx.decode(
        UBatch(
            [int(t) for t in rng.integers(1000, 100_000, nb * n_ctx)],
            [p for _ in range(nb) for p in range(n_ctx)],
            [s for s in range(nb) for _ in range(n_ctx)],
            [False] * (nb * n_ctx),
        )
    )
    old = os.environ.get("LORAPLANE_KERNELS")
    print(
        f"decode step, {base.arch}, {steps} steps per rep, {torch.get_num_threads()} threads; "
        "median ms per step (min-max):"
    )
    try:
        for b in batches:
            ts: dict[str, list[float]] = {"avx512": [], "amx": []}
            for _ in range(reps + 1):
                for p in ts:
                    os.environ["LORAPLANE_KERNELS"] = p
                    for s in range(b):
                        ctx.kv.seq_rm(s, n_ctx)
                    t0 = time.perf_counter()
                    for i in range(steps):
                        toks = [int(t) for t in rng.integers(1000, 100_000, b)]
                        ctx.decode(UBatch(toks, [n_ctx + i] * b, list(range(b)), [True] * b))
                    ts[p].append((time.perf_counter() - t0) * 1e3 / steps)
            print(f"  B={b:<3d} avx512 {_fmt(ts['avx512'][1:]).strip()}  amx {_fmt(ts['amx'][1:]).strip()}")
    finally:
        if old is None:
            os.environ.pop("LORAPLANE_KERNELS", None)
        else:
            os.environ["LORAPLANE_KERNELS"] = old
        ctx.close()


def run_sampling(reps: int) -> None:
    """Greedy sampling of B rows as the scheduler does it (B > 1: ``greedy_rows`` then
    ``Sampler.sample`` per row; B = 1: ``Sampler.sample``), torch path vs the fused kernel
    (``LORAPLANE_KERNELS`` switched per call), methods interleaved per repetition; prints median
    [min-max] ms."""
    from worker.runtime.sampling import Sampler, SamplingParams, greedy_rows

    paths = ["torch"] + [p for p in ("avx512", "avx2") if supported(p)]
    before = os.environ.get("LORAPLANE_KERNELS")
    print(f"greedy sampling (logprobs 0), torch threads {torch.get_num_threads()}, ms median [min-max]:")
    try:
        for v in (262144, 151936):
            for b in (16, 1):
                x = torch.randn(b, v, generator=torch.Generator().manual_seed(v + b)) * 4
                samplers = [Sampler(SamplingParams()) for _ in range(b)]

                def step(x: torch.Tensor = x, samplers: list[Sampler] = samplers) -> list[int]:
                    if len(samplers) == 1:
                        return [samplers[0].sample(x[0]).token_id]
                    pre, tok = greedy_rows(x, list(range(len(samplers))))
                    return [s.sample(x[i], logp=pre[i], argmax=tok[i]).token_id for i, s in enumerate(samplers)]

                ts: dict[str, list[float]] = {p: [] for p in paths}
                ids = {}
                for _ in range(reps + 1):  # the first round is a warm-up
                    for p in paths:
                        os.environ["LORAPLANE_KERNELS"] = p
                        t0 = time.perf_counter()
                        ids[p] = step()
                        ts[p].append((time.perf_counter() - t0) * 1e3)
                assert all(ids[p] == ids["torch"] for p in paths), "greedy ids differ"
                row = "  ".join(
                    f"{p if p == 'torch' else 'fused-' + p} "
                    f"{statistics.median(t[1:]):.2f} [{min(t[1:]):.2f}-{max(t[1:]):.2f}]"
                    for p, t in ts.items()
                )
                print(f"  V={v:<6d} B={b:<2d} {row}")
    finally:
        if before is None:
            os.environ.pop("LORAPLANE_KERNELS", None)
        else:
            os.environ["LORAPLANE_KERNELS"] = before


ACT_SETTINGS: dict[str, tuple[str | None, str | None, int | None]] = {
    "all-i16": ("i16", None, None),
    "head-i16": (None, "i16", None),
    "policy": (None, None, None),
    "no-rescore": (None, None, 0),
    "all-i8": ("i8", None, None),
}
"""label -> (``$LORAPLANE_KERNEL_ACT`` or None: unset, the LM head's ``act`` or None: its own,
the head's ``rescore`` or None: its own). ``policy`` is the model as loaded (each weight's
``act``, the head's re-score); ``head-i16`` the same with the head at int16 (the default before
the heads took int8); ``no-rescore`` the policy without the head's int16 re-score."""


def _with_act(setting: tuple[str | None, str | None, int | None], fn, head):
    """Run ``fn()`` under ``setting`` (an ``ACT_SETTINGS`` value), restoring the head after."""
    env, act, rescore = setting
    saved = head.act, head.rescore
    if act is not None:
        head.act = act
    if rescore is not None:
        head.rescore = rescore
    old = os.environ.pop("LORAPLANE_KERNEL_ACT", None)
    if env is not None:
        os.environ["LORAPLANE_KERNEL_ACT"] = env
    try:
        return fn()
    finally:
        head.act, head.rescore = saved
        os.environ.pop("LORAPLANE_KERNEL_ACT", None)
        if old is not None:
            os.environ["LORAPLANE_KERNEL_ACT"] = old


def run_act_policy(model: str, reps: int, batches: list[int], steps: int = 4, n_ctx: int = 64) -> None:
    """LM head matmul and whole decode steps under each ``ACT_SETTINGS`` entry, reps interleaved."""
    from worker.runtime.context import Model
    from worker.runtime.context_base import UBatch
    from worker.runtime.kernels import QuantLinear
    from worker.runtime.model import LM_HEAD_NAMES, load_model

    base = load_model(model, dtype="f32", device="cpu")
    head_name = next(n for n in LM_HEAD_NAMES if n in base.weights)
    head = base.weights[head_name]
    assert isinstance(head, QuantLinear), f"{head_name} is not a packed weight"
    acts = {n: w.act for n, w in base.weights.items() if hasattr(w, "act") and w.act != "i16"}
    print(f"model {base.arch}; LM head {head_name} {head.ggml_type.name} {head.d}x{head.k}; weights not i16: {acts}")
    print(f"the LM head as loaded: {head.act}, re-scoring each row's top {head.rescore} with i16")
    print(f"LM head matmul, median ms (min-max) over {reps} interleaved reps:")
    for b in batches:
        x = torch.randn(b, head.k)
        ts: dict[str, list[float]] = {k: [] for k in ACT_SETTINGS}
        for _ in range(reps + 1):
            for label, setting in ACT_SETTINGS.items():
                ts[label] += _with_act(setting, lambda x=x: _times(lambda: head.matmul(x), 1), head)
        row = "  ".join(f"{k} {_fmt(v[1:]).strip()}" for k, v in ts.items())
        print(f"  B={b:<3d} {row}")
    ctx = Model(base).new_context(n_ctx_seq=n_ctx + steps + 8, n_seq=max(batches))
    rng = np.random.default_rng(0)
    nb = max(batches)
    ctx.decode(  # a context of n_ctx tokens for every sequence
        UBatch(
            [int(t) for t in rng.integers(1000, 100_000, nb * n_ctx)],
            [p for _ in range(nb) for p in range(n_ctx)],
            [s for s in range(nb) for _ in range(n_ctx)],
            [False] * (nb * n_ctx),
        )
    )
    print(f"decode step ({steps} steps per rep, logits for every row), median ms per step (min-max):")
    for b in batches:
        ts = {k: [] for k in ACT_SETTINGS}
        for _ in range(reps + 1):
            for label, setting in ACT_SETTINGS.items():
                for s in range(b):
                    ctx.kv.seq_rm(s, n_ctx)

                def go(b=b):
                    t0 = time.perf_counter()
                    for i in range(steps):
                        toks = [int(t) for t in rng.integers(1000, 100_000, b)]
                        ctx.decode(UBatch(toks, [n_ctx + i] * b, list(range(b)), [True] * b))
                    return (time.perf_counter() - t0) * 1e3 / steps

                ts[label].append(_with_act(setting, go, head))
        row = "  ".join(f"{k} {_fmt(v[1:]).strip()}" for k, v in ts.items())
        print(f"  B={b:<3d} {row}")
    ctx.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--no-baselines", action="store_true", help="time only our kernels")
    ap.add_argument("--amx", action="store_true", help="only the avx512 vs amx comparison (int8 and int16)")
    ap.add_argument("--acts", default="i8,i16", help="--amx: activation precisions to compare")
    ap.add_argument("--step-batches", default="16", help="--amx: decode-step batch sizes, avx512 vs amx ('' none)")
    ap.add_argument("--contention", action="store_true", help="also compare the threading backends under load")
    ap.add_argument("--rounds", type=int, default=6, help="--contention: interleaved rounds")
    ap.add_argument("--contention-only", action="store_true", help="run only the --contention comparison")
    ap.add_argument(
        "--conditions", default=None, help="--contention: comma-separated labels of CONDITIONS to run (default all)"
    )
    ap.add_argument("--act-policy", action="store_true", help="LM head + decode step: act policy vs all-i16/all-i8")
    ap.add_argument("--step-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--contention-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sampling", action="store_true", help="only greedy sampling: torch vs the fused kernel")
    args = ap.parse_args(argv)
    if args.sampling:
        run_sampling(args.reps)
        return 0
    if args.model is None:
        from worker.runtime.model import default_model_path

        args.model = str(default_model_path())
    batches = [int(b) for b in args.batches.split(",")]
    if args.amx:
        print(f"cpu: {cpu_model()}; {os.cpu_count()} cpus; load average {os.getloadavg()[0]:.1f}")
        run_amx(args.model, args.reps, batches, tuple(args.acts.split(",")))
        if args.step_batches:
            run_amx_step(args.model, args.reps, [int(b) for b in args.step_batches.split(",")])
        return 0
    if args.contention_child:
        return _contention_child(args)
    if args.contention_only:
        _contention(args)
        return 0
    if args.step_only:
        step = run_step(args.model, args.reps, batches, baselines=False)
        print("  ".join(f"{m} {_fmt(ts).strip()}" for (m, b), ts in step.items()))
        return 0
    flags = cpu_flags()
    path = resolve_path()
    print(
        f"cpu: {cpu_model()}; {os.cpu_count()} cpus; torch threads {torch.get_num_threads()}; "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}"
    )
    print("flags: " + " ".join(f"{f}={'y' if f in flags else 'n'}" for f in SHOW_FLAGS))
    print(
        f"kernel path: {path} ({library_path(path).name if path != 'torch' else 'torch fallback'}); "
        f"activations: {resolve_act() if os.environ.get('LORAPLANE_KERNEL_ACT') else 'per weight (i16, LM head i8)'}"
    )
    gf = read_gguf(args.model)
    gguf_bytes = sum(r.n_bytes for r in gf.tensors.values())
    lin = [r for r in gf.tensors.values() if len(r.ne) == 2]
    packed = sum(pack_tensor(r).nbytes for r in lin)
    lin_bytes = sum(r.n_bytes for r in lin)
    other = gguf_bytes - lin_bytes
    print(
        f"weights: GGUF tensor bytes {gguf_bytes / 2**20:.1f} MiB (linear {lin_bytes / 2**20:.1f}); "
        f"held packed {(packed + other) / 2**20:.1f} MiB = {(packed + other) / gguf_bytes:.2f}x "
        f"(linear {packed / 2**20:.1f} MiB = {packed / lin_bytes:.2f}x)"
    )
    if args.act_policy:
        run_act_policy(args.model, args.reps, batches)
        return 0
    copy_bw, read_bw = _bandwidth(args.reps)
    print(f"bandwidth: copy {copy_bw:.1f} GB/s (read + write), read-only {read_bw:.1f} GB/s\n")
    step = run(args.model, args.reps, batches, baselines=not args.no_baselines)
    print("\ndecode step from the table above (sum of medians x tensor count; small weights are cache-hot there), ms:")
    for b in batches:
        row = "  ".join(f"{m} {v:.1f}" for (m, bb), v in step.items() if bb == b)
        print(f"  B={b:<3d} {row}")
    print(
        "decode step measured: every linear weight in model order, then the output projection "
        "(weights streamed from memory), median ms (min-max):"
    )
    real = run_step(args.model, args.reps, batches, baselines=not args.no_baselines)
    for b in batches:
        row = "  ".join(f"{m} {_fmt(ts).strip()}" for (m, bb), ts in real.items() if bb == b)
        print(f"  B={b:<3d} {row}")
    print(
        f"  memory-bound time of the GGUF's tensor bytes at read-only bandwidth: "
        f"{gguf_bytes / read_bw / 1e6:.1f} ms; of our packed bytes: {(packed + other) / read_bw / 1e6:.1f} ms"
    )
    if args.contention:
        _contention(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
