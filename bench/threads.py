"""In-process A/B of the C kernels' threading backends, switched between repetitions.

``python -m bench.threads [--batches 1,16] [--reps 15] [--what mm,dec] [--hog] [--conds ...]``

One process, ``OMP_WAIT_POLICY=PASSIVE`` (torch's ops on libgomp), the base model (Gemma 3
270M); each repetition runs every condition back to back (``library.set_threads`` between them),
so a shared machine's load hits all alike. Conditions are ``omp`` (OpenMP, PASSIVE) and
``pool:S/B`` (our pool, ``LORAPLANE_KERNEL_SPIN_US=S``, ``LORAPLANE_KERNEL_SPIN_BACKOFF_MS=B``).
Measured per batch size B:

- ``mm``: every layer's linear weights (not the output projection) multiplied once, B rows;
- ``dec``: one whole decode step of B sequences at context 32 (``WorkerContext.decode``):
  norms, rope, attention and elementwise ops on libgomp between our kernels — whether the two
  thread pools alive in one process hurt each other.

``--hog`` adds a busy process pinned to core 0 for the whole run. OpenMP ACTIVE cannot be
switched in-process (libgomp reads the policy once): ``python -m bench.kernels --contention``
compares it in child processes. Prints median [min-max] ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp

import numpy as np  # noqa: E402
import torch  # noqa: E402

from loraplane.formats.gguf.reader import read_gguf  # noqa: E402
from worker.runtime.kernels import library, pack_tensor, resolve_path  # noqa: E402

CTX = 32


def _cond(name: str) -> tuple[str, int, int]:
    if name == "omp":
        return ("omp", 0, 0)
    spin, backoff = name.removeprefix("pool:").split("/")
    return ("pool", int(spin), int(backoff))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.threads", description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--what", default="mm,dec")
    ap.add_argument("--hog", action="store_true", help="a busy process pinned to core 0 during the run")
    ap.add_argument("--conds", default="omp,pool:0/0,pool:5/100,pool:20/100,pool:50/100,pool:50/0")
    args = ap.parse_args(argv)
    from worker.lora.adapter_set import EMPTY_SET
    from worker.runtime.context import Model
    from worker.runtime.context_base import UBatch
    from worker.runtime.model import default_model_path, load_model

    batches = [int(b) for b in args.batches.split(",")]
    conds = {c: _cond(c) for c in args.conds.split(",")}
    path = resolve_path()
    model = str(default_model_path())
    gf = read_gguf(model)
    mms = [(pack_tensor(r), r.ne[0]) for n, r in gf.tensors.items() if len(r.ne) == 2 and n != "token_embd.weight"]
    base = load_model(model)
    nseq = max(batches)
    ctx = Model(base).new_context(n_ctx_seq=CTX + 8, n_seq=nseq)
    ctx.set_adapters(EMPTY_SET)
    rng = np.random.default_rng(0)
    ctx.decode(
        UBatch(
            rng.integers(1000, 200_000, size=nseq * CTX).tolist(),
            [p for _ in range(nseq) for p in range(CTX)],
            [s for s in range(nseq) for _ in range(CTX)],
            [False] * (nseq * CTX),
        )
    )

    def mm(b: int) -> float:
        xs = {k: torch.randn(b, k) for k in {k for _, k in mms}}
        t0 = time.perf_counter()
        for ql, k in mms:
            ql.matmul(xs[k], path=path)
        return (time.perf_counter() - t0) * 1e3

    def dec(b: int) -> float:
        for s in range(b):
            ctx.kv.seq_rm(s, CTX)
        ub = UBatch(rng.integers(1000, 200_000, size=b).tolist(), [CTX] * b, list(range(b)), [True] * b)
        t0 = time.perf_counter()
        ctx.decode(ub)
        return (time.perf_counter() - t0) * 1e3

    fns = {"mm": mm, "dec": dec}
    what = args.what.split(",")
    hog = None
    if args.hog:
        spin = "import os\nos.sched_setaffinity(0, {0})\nwhile True: pass"
        hog = subprocess.Popen([sys.executable, "-c", spin])
    saved = library.threads_config()
    try:
        res: dict[tuple, list[float]] = {(w, b, c): [] for w in what for b in batches for c in conds}
        for cfg in conds.values():  # warm-up
            library.set_threads(*cfg)
            for w in what:
                for b in batches:
                    fns[w](b)
        for _ in range(args.reps):
            for w in what:
                for b in batches:
                    for c, cfg in conds.items():
                        library.set_threads(*cfg)
                        res[(w, b, c)].append(fns[w](b))
    finally:
        library.set_threads(*saved)
        if hog is not None:
            hog.kill()
            hog.wait()
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(
        f"torch threads {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, "
        f"{'busy process on core 0' if hog else 'no neighbour'}, {args.reps} reps interleaved, "
        f"load average at end {load}; ms median [min-max]"
    )
    for w in what:
        for b in batches:
            row = "  ".join(
                f"{c} {statistics.median(ts):.1f} [{min(ts):.1f}-{max(ts):.1f}]"
                for (ww, bb, c), ts in res.items()
                if ww == w and bb == b
            )
            print(f"  {w:3s} B={b:<3d} {row}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
