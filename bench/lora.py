"""Multi-LoRA cost: dense masked product vs gathered (BGMV kernel) vs per-slot segments (torch).

``python -m bench.lora [--reps 7] [--ks 1,4,16,64] [--model PATH] [--no-step]``:
`run_products` times the three products on the base model's LoRA shapes with slot buffers laid
out as ``worker.lora.pool`` stores them (decode: B=16 rows; prefill: a 512-row ubatch in 4
segments), for each number K of used slots; `run_step` times a whole in-process decode step at
K=0 and K=16 with the graph's LoRA mode ``dense`` and ``auto``, in wall and CPU time.

The set-up and figures: ``bench/README.md``, "Details per tool"; results:
``worker/runtime/kernels/README.md``, "Multi-LoRA".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch (bench.kernels, kernels README)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.synth import AdapterFactory, linear_targets  # noqa: E402
from worker.runtime.kernels import cpu_model, resolve_path  # noqa: E402
from worker.runtime.kernels.lora import lora_bgmv, lora_dense, lora_pairs, lora_sgmv_torch  # noqa: E402

RANK = 8


def _fmt(ts: list[float]) -> str:
    return f"{statistics.median(ts):8.2f} [{min(ts):.2f}–{max(ts):.2f}]"


def _slot_buffers(targets: list[tuple[str, int, int]], K: int, seed: int) -> list[tuple]:
    """Per weight: (k, d, a (K, R, k), bt (K, R, d), rank int32 (K,), factor f32 (K,))."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _, k, d in targets:
        a = torch.randn(K, RANK, k, generator=g) / k**0.5
        bt = torch.randn(K, RANK, d, generator=g) * 0.02
        out.append((k, d, a, bt, torch.full((K,), RANK, dtype=torch.int32), torch.full((K,), 2.0)))
    return out


def _row_slot(n: int, K: int, segments: int | None) -> torch.Tensor:
    rs = torch.zeros(n, K)
    for i in range(n):
        s = i % K if segments is None else (i * segments // n) * K // segments
        rs[i, s] = 1.0
    return rs


def _methods(bufs: list[tuple], xs: dict, ys: dict, rs: torch.Tensor, K: int) -> dict:
    """The three methods over every weight's branch for one ubatch (x by k, y by d)."""

    def dense() -> None:
        for k, d, a, bt, _, f in bufs:
            lora_dense(xs[k], ys[d], a, bt, f, rs)

    def gathered() -> None:
        pairs = lora_pairs(rs)  # once per ubatch, as in the graph
        for k, d, a, bt, r, f in bufs:
            lora_bgmv(xs[k], ys[d].clone(), a, bt, r, f, pairs)

    def segments() -> None:
        pairs = lora_pairs(rs)
        rl = [RANK] * K
        for k, d, a, bt, _, f in bufs:
            lora_sgmv_torch(xs[k], ys[d], a, bt, rl, f, pairs)

    return {"dense": dense, "gathered": gathered, "segments": segments}


def run_products(model_tensors: dict, ks: list[int], reps: int) -> None:
    targets = linear_targets(model_tensors)
    print(
        f"\n## LoRA products, rank {RANK} on {len(targets)} weights (all layers' q/k/v/o/gate/up/down), "
        f"summed ms per ubatch, median [min–max] over {reps}"
    )
    print(f"path {resolve_path()}, threads {torch.get_num_threads()}\n")
    print("| K | ubatch | dense | gathered (BGMV kernel) | segments (torch) |")
    print("|---|---|---|---|---|")
    for K in ks:
        bufs = _slot_buffers(targets, K, seed=K)
        for label, n, seg in (("decode B=16", 16, None), ("prefill 512 (4 segments)", 512, 4)):
            rs = _row_slot(n, K, seg)
            xs = {k: torch.randn(n, k) for k in {b[0] for b in bufs}}
            ys = {d: torch.randn(n, d) for d in {b[1] for b in bufs}}

            fns = _methods(bufs, xs, ys, rs, K)
            times: dict[str, list[float]] = {m: [] for m in fns}
            for fn in fns.values():
                fn()  # warm-up
            for _ in range(reps):
                for m, fn in fns.items():  # interleaved: the machine's load hits all alike
                    t0 = time.perf_counter()
                    fn()
                    times[m].append((time.perf_counter() - t0) * 1e3)
            print(
                f"| {K} | {label} | {_fmt(times['dense'])} | {_fmt(times['gathered'])} | {_fmt(times['segments'])} |",
                flush=True,
            )


def run_step(model_path: str | None, K: int, reps: int, steps: int) -> None:
    from worker.lora.adapter import load_lora_adapter
    from worker.lora.adapter_set import EMPTY_SET, AdapterSet
    from worker.runtime import graph
    from worker.runtime.context import Model, UBatch
    from worker.runtime.model import load_model

    base = load_model(model_path)
    model = Model(base, max_loras=max(K, 1), max_lora_rank=16)
    B, n_ctx = 16, 64
    ctx = model.new_context(n_ctx_seq=n_ctx + steps + 8, n_seq=B)
    with tempfile.TemporaryDirectory() as tmp:
        fac = AdapterFactory(Path(tmp), arch=base.arch, base_tensors=base.tensor_ne, base_seed=1234, rank=RANK)
        adapters = []
        for i, p in enumerate(fac.paths(K)):
            a = load_lora_adapter(
                p, base_arch=base.arch, base_tensors=base.tensor_ne, device_for=base.device_of, dtype=base.dtype
            )
            model.adapters.add(i, a)
            adapters.append(a)
    sets = [AdapterSet.of({i: (a, 1.0)}) for i, a in enumerate(adapters)]
    rng = np.random.default_rng(7)
    hi = min(base.n_vocab, 32000)
    ctx.set_adapters(EMPTY_SET)
    toks, pos, ids = [], [], []
    for s in range(B):
        toks += rng.integers(10, hi, n_ctx).tolist()
        pos += list(range(n_ctx))
        ids += [s] * n_ctx
    for c0 in range(0, len(toks), 512):
        ctx.decode(
            UBatch(toks[c0 : c0 + 512], pos[c0 : c0 + 512], ids[c0 : c0 + 512], [False] * len(toks[c0 : c0 + 512]))
        )

    def step_ms(variant: str) -> tuple[float, float]:
        graph.LORA_MODE = "dense" if variant == "dense" else "auto"
        if variant == "K=0":
            ctx.set_adapters(EMPTY_SET)
            set_index = [0] * B
        else:
            ctx.set_adapters(sets)
            set_index = [i % K for i in range(B)]
        for s in range(B):
            ctx.kv.seq_rm(s, n_ctx)
        t0, c0 = time.perf_counter(), time.process_time()
        for j in range(steps):
            ctx.decode(UBatch(rng.integers(10, hi, B).tolist(), [n_ctx + j] * B, list(range(B)), [True] * B, set_index))
        return (time.perf_counter() - t0) * 1e3 / steps, (time.process_time() - c0) * 1e3 / steps

    variants = ("K=0", "dense", "gathered")
    for v in variants:
        step_ms(v)  # warm-up
    t: dict[str, list[float]] = {v: [] for v in variants}
    c: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(reps):
        for v in variants:
            wall, cpu_ms = step_ms(v)
            t[v].append(wall)
            c[v].append(cpu_ms)
    graph.LORA_MODE = "auto"
    print(
        f"\n## Whole decode step, {Path(str(base.path)).name}, B={B} at {n_ctx} tokens of context, "
        f"{steps} steps per repetition, median [min–max] over {reps} (variants interleaved)\n"
    )
    print(
        "wall = elapsed ms/step; cpu = process CPU ms/step (all threads; less sensitive to other "
        "processes taking the cores). Overhead = (K=16 − K=0) / K=0 within each repetition.\n"
    )
    print("| variant | wall ms/step | overhead (wall) | cpu ms/step | overhead (cpu) |")
    print("|---|---|---|---|---|")
    for v in variants:
        label = "K=0" if v == "K=0" else f"K={K} {v}"
        cells = []
        for m in (t, c):
            ov = [100.0 * (m[v][i] - m["K=0"][i]) / m["K=0"][i] for i in range(reps)]
            cells += [_fmt(m[v]), "" if v == "K=0" else f"{statistics.median(ov):.1f} % [{min(ov):.1f}–{max(ov):.1f}]"]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--ks", default="1,4,16,64")
    ap.add_argument("--no-products", action="store_true")
    ap.add_argument("--no-step", action="store_true")
    ap.add_argument("--step-reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="decode steps per repetition")
    args = ap.parse_args(argv)
    print(f"# bench.lora — {cpu_model()}, torch {torch.__version__}, {' '.join(sys.argv[1:])}")
    if not args.no_products:
        from worker.runtime.model import load_model

        run_products(load_model(args.model).tensor_ne, [int(k) for k in args.ks.split(",")], args.reps)
    if not args.no_step:
        run_step(args.model, 16, args.step_reps, args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
