"""Where a decode step's time goes: per-block wall time of in-process B-row decode steps.

``python -m bench.step_profile [--model GGUF] [--batch 16] [--ctx 64] [--steps 10] [--lora]``

Runs ``WorkerContext.decode`` steps of ``batch`` sequences (each at ``ctx`` tokens of context,
logits for every row) followed by the scheduler's greedy sampling, on a thread of its own as the
worker's scheduler does (``--main-thread`` to run on the main thread), with a timer around each
block of the graph: the packed matmuls (``QuantLinear.matmul``; the LM head apart from the
layers), the shared activation quantization (``quantize_activations``), the LoRA branches
(``GraphContext._add_lora``), decode attention with its KV writes (``attn_decode_batch``),
RMS norms (``build_norm``), rope (``apply_rope``), the FFN activation, and sampling
(``greedy_rows`` + ``Sampler.sample``). ``other`` is the step minus the timed blocks: the
remaining torch glue (residual adds, reshapes, embedding lookup, bias) and Python. Prints
ms per step, median [min–max] over the steps, with the CPU flags and kernel path.
``--lora``: every row uses one synthetic rank-8 adapter on all linear weights.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the worker's default, before torch loads

import torch  # noqa: E402

from bench.engine import EngineBench  # noqa: E402
from bench.machine import kernels_used  # noqa: E402
from bench.stats import Figure, fmt_fig  # noqa: E402
from bench.synth import linear_targets, write_adapter  # noqa: E402
from worker.runtime import graph, sampling  # noqa: E402
from worker.runtime.kernels import QuantLinear, cpu_flags, cpu_model  # noqa: E402
from worker.runtime.model import default_model_path, load_model  # noqa: E402

BLOCKS = (
    "matmul layers",
    "matmul LM head",
    "quantize shared x",
    "LoRA",
    "attention + KV write",
    "norms",
    "rope",
    "FFN act",
    "sampling",
)
LM_HEAD = {"token_embd.weight", "output.weight"}


class Timers:
    """Wall-clock accumulators per block for the current step (thread-agnostic: the profiled
    step runs on one thread)."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, block: str | Callable[..., str]) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc[block(*args) if callable(block) else block] += time.perf_counter() - t0

        setattr(owner, name, timed)


def profile(model: str, *, batch: int, ctx: int, steps: int, lora: bool, main_thread: bool) -> dict[str, Figure]:
    """Per-block ms/step of ``steps`` decode steps (after 2 warm-up steps); see the module docstring."""
    base = load_model(model)
    t = Timers()
    t.wrap(QuantLinear, "matmul", lambda self, *a: "matmul LM head" if self.name in LM_HEAD else "matmul layers")
    t.wrap(graph, "quantize_activations", "quantize shared x")
    t.wrap(graph.GraphContext, "_add_lora", "LoRA")
    t.wrap(graph, "attn_decode_batch", "attention + KV write")
    t.wrap(graph.GraphContext, "build_norm", "norms")
    t.wrap(graph, "apply_rope", "rope")
    t.wrap(graph, "_act", "FFN act")
    t.wrap(sampling, "greedy_rows", "sampling")
    t.wrap(sampling.Sampler, "sample", "sampling")
    per: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        adapter = write_adapter(
            Path(tmp) / "r8.gguf", arch=base.arch, targets=linear_targets(base.tensor_ne), seed=1, rank=8
        )
        eb = EngineBench.create(base, adapter, n_ctx_seq=ctx + steps + 8, seed=1234)
        eb.prefill_sequences(batch, ctx)
        variant = "lora" if lora else "base"

        def run() -> None:
            eb.decode_steps(variant, batch, 2, ctx, rep=999)  # warm-up
            for i in range(steps):
                t.acc.clear()
                _, t_all = eb.decode_steps(variant, batch, 1, ctx, rep=i)
                timed = 0.0
                for b in BLOCKS:
                    per[b].append(t.acc.get(b, 0.0) * 1e3)
                    timed += t.acc.get(b, 0.0)
                per["other (torch glue, Python)"].append((t_all - timed) * 1e3)
                per["whole step incl. sampling"].append(t_all * 1e3)

        if main_thread:
            run()
        else:
            th = threading.Thread(target=run, name="step-profile")
            th.start()
            th.join()
    return {k: Figure.of(v) for k, v in per.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lora", action="store_true", help="every row with one rank-8 adapter on all linear weights")
    ap.add_argument("--main-thread", action="store_true", help="run the steps on the main thread")
    args = ap.parse_args(argv)
    model = args.model or str(default_model_path())
    flags = " ".join(sorted(cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "amx_int8", "amx_tile"}))
    print(
        f"cpu: {cpu_model()}; flags: {flags}; {kernels_used('packed', 'cpu')['summary']}; "
        f"torch threads {torch.get_num_threads()}"
    )
    print(
        f"model {Path(model).name}, B={args.batch}, context {args.ctx}, {args.steps} steps"
        f"{', one rank-8 adapter on every row' if args.lora else ''}, "
        f"{'main thread' if args.main_thread else 'own thread (as the scheduler)'}; ms per step, median [min-max]"
    )
    res = profile(model, batch=args.batch, ctx=args.ctx, steps=args.steps, lora=args.lora, main_thread=args.main_thread)
    for k, f in res.items():
        print(f"  {k:32s} {fmt_fig(f)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
