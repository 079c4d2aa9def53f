"""Microbenchmark of the quantized matmul kernels on the real base model's weights.

``python -m bench.kernels [--reps 7] [--batches 1,16] [--model PATH] [--contention]``

Prints the CPU flags and the kernel path taken, then for each distinct (type, shape) of the
Gemma 3 270M GGUF's linear weights, and the 262144 x 640 Q8_0 output projection, at each batch
size: median and min-max milliseconds over ``--reps`` runs of

- ``ours``        the C kernel on the selected path, int16 activations (the default),
- ``ours-i8``     the same with int8 activations (``LORAPLANE_KERNEL_ACT=i8``),
- ``ours-avx2`` / ``ours-avx2-i8``  the AVX2 path beside them on AVX-512 CPUs,
- ``f32``         the current ``x @ W.T`` on the f32 dequantized weight (MKL),
- ``fbgemm-fp16`` ``torch.fbgemm_linear_fp16_weight`` on fp16-packed weights, if torch has it,

measured side by side in one run, with the GB/s of weight bytes each achieves against the
measured copy (read + write) and read-only bandwidths; then one decode step's summed matmul
time (every linear weight of the 18 layers + the output projection) per method and batch.

``--act-policy`` instead compares the activation-precision policy of ``worker.runtime.model.assign_acts``
(int8 activations for the LM head only) with all-i16 (``LORAPLANE_KERNEL_ACT=i16``, the former
default) and all-i8, side by side in one process with the repetitions interleaved: the loaded
model's LM head matmul, and whole decode steps (``WorkerContext.decode``, B sequences at a
context of 64, logits for every row) at each batch size.

``--contention`` re-runs the step sum in child processes with ``OMP_WAIT_POLICY`` active vs
passive, alone and with a competing busy process pinned to a core, to pick the default.
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
from worker.gguf.reader import dequantize, read_gguf  # noqa: E402
from worker.runtime.kernels import cpu_flags, cpu_model, pack_tensor, resolve_act, resolve_path, supported  # noqa: E402
from worker.runtime.kernels.build import library_path  # noqa: E402

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


def _contention(args) -> None:
    """Step sum at B=16 under OMP_WAIT_POLICY active/passive, alone and with a busy neighbour."""
    print("\nthread behaviour (measured decode step, ours, B=1 and B=16, median ms (min-max)):")
    spin = [sys.executable, "-c", "import os\nos.sched_setaffinity(0, {0})\nwhile True: pass"]
    for busy in (False, True):
        hog = subprocess.Popen(spin) if busy else None
        try:
            for policy in ("active", "passive"):
                env = dict(os.environ, OMP_WAIT_POLICY=policy)
                cmd = [
                    sys.executable,
                    "-m",
                    "bench.kernels",
                    "--step-only",
                    "--reps",
                    str(args.reps),
                    "--batches",
                    args.batches,
                    "--model",
                    args.model,
                ]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                print(
                    f"  OMP_WAIT_POLICY={policy:8s} {'with a busy process on core 0' if busy else 'alone':32s} "
                    f"{out.strip()}"
                )
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()


ACT_SETTINGS = {"all-i16": "i16", "policy": None, "rescore": None, "all-i8": "i8"}
"""label -> ``LORAPLANE_KERNEL_ACT`` (None: unset). ``rescore``: the policy with the LM head's
``QuantLinear.rescore`` set (its top candidates per row recomputed with int16)."""


def _with_act(setting: str | None, fn, head=None, rescore: int = 0):
    """Run ``fn()`` with ``$LORAPLANE_KERNEL_ACT`` set to ``setting`` (None: unset, the policy)
    and ``head.rescore`` set to ``rescore``."""
    if head is not None:
        head.rescore = rescore
    old = os.environ.pop("LORAPLANE_KERNEL_ACT", None)
    if setting is not None:
        os.environ["LORAPLANE_KERNEL_ACT"] = setting
    try:
        return fn()
    finally:
        os.environ.pop("LORAPLANE_KERNEL_ACT", None)
        if old is not None:
            os.environ["LORAPLANE_KERNEL_ACT"] = old


def run_act_policy(
    model: str, reps: int, batches: list[int], steps: int = 4, n_ctx: int = 64, rescore: int = 32
) -> None:
    """LM head matmul and whole decode steps under each ``ACT_SETTINGS`` entry, reps interleaved."""
    from worker.runtime.context import Model, UBatch
    from worker.runtime.kernels import QuantLinear
    from worker.runtime.model import LM_HEAD_NAMES, load_model

    base = load_model(model, dtype="f32", device="cpu")
    head_name = next(n for n in LM_HEAD_NAMES if n in base.weights)
    head = base.weights[head_name]
    assert isinstance(head, QuantLinear), f"{head_name} is not a packed weight"
    acts = {n: w.act for n, w in base.weights.items() if hasattr(w, "act") and w.act != "i16"}
    print(f"model {base.arch}; LM head {head_name} {head.ggml_type.name} {head.d}x{head.k}; weights not i16: {acts}")
    print(f"rescore: the LM head's top {rescore} per row recomputed with i16")
    print(f"LM head matmul, median ms (min-max) over {reps} interleaved reps:")
    for b in batches:
        x = torch.randn(b, head.k)
        ts: dict[str, list[float]] = {k: [] for k in ACT_SETTINGS}
        for _ in range(reps + 1):
            for label, setting in ACT_SETTINGS.items():
                rs = rescore if label == "rescore" else 0
                ts[label] += _with_act(setting, lambda x=x: _times(lambda: head.matmul(x), 1), head, rs)
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

                ts[label].append(_with_act(setting, go, head, rescore if label == "rescore" else 0))
        row = "  ".join(f"{k} {_fmt(v[1:]).strip()}" for k, v in ts.items())
        print(f"  B={b:<3d} {row}")
    ctx.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--no-baselines", action="store_true", help="time only our kernels")
    ap.add_argument("--contention", action="store_true", help="also measure OMP_WAIT_POLICY under load")
    ap.add_argument("--act-policy", action="store_true", help="LM head + decode step: act policy vs all-i16/all-i8")
    ap.add_argument("--rescore", type=int, default=32, help="--act-policy: candidates re-scored per row")
    ap.add_argument("--step-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.model is None:
        from worker.runtime.model import default_model_path

        args.model = str(default_model_path())
    batches = [int(b) for b in args.batches.split(",")]
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
        run_act_policy(args.model, args.reps, batches, rescore=args.rescore)
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
