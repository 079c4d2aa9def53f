"""Decode step time against context length, in-process: C attention kernel vs the torch path.

``python -m bench.decode_context [--context 100,3000] [--batches 1,16] [--steps 3] [--reps 5]``

Drives ``WorkerContext.decode`` directly (no gRPC, no scheduler; ``bench.engine.EngineBench``)
on the base model (default: the embedded Gemma 3 270M): every sequence holds ``n_ctx`` tokens
(one sequence prefilled, the others imported from its KV snapshot), then ``steps`` decode
steps of ``B`` sequences, one row each. Each repetition runs both decode-attention paths
(``LORAPLANE_ATTN=torch``: gather + f64 SDPA, ``c``: ``worker/runtime/kernels/csrc/attn.cpp``)
back to back, so machine noise hits both alike. Also times the attention alone:
``worker.runtime.graph.attn_decode_batch`` for every layer (K/V store included) at the same shapes.

Prints per (path, B, context): step ms (median [min–max]) and ITL(max ctx)/ITL(min ctx); the
attention-alone ms. :func:`run_context` returns the same figures as JSON-ready dicts, for
other scenarios to call.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from functools import partial

# libgomp reads OMP_WAIT_POLICY once, when torch loads it (worker/runtime/kernels/README.md)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.engine import EngineBench  # noqa: E402
from bench.stats import Figure, fmt_fig  # noqa: E402
from worker.lora.adapter_set import EMPTY_SET  # noqa: E402
from worker.runtime.context import Model  # noqa: E402
from worker.runtime.graph import DecodeRows, attn_decode_batch  # noqa: E402
from worker.runtime.kv_cache import KVCache
from worker.runtime.model import LoadedModel  # noqa: E402

ATTN_MODES = ("torch", "c")


def _with_attn(mode: str, fn: Callable[[], float]) -> float:
    old = os.environ.get("LORAPLANE_ATTN")
    os.environ["LORAPLANE_ATTN"] = mode
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop("LORAPLANE_ATTN", None)
        else:
            os.environ["LORAPLANE_ATTN"] = old


def _fill(eb: EngineBench, n_seqs: int, n_ctx: int) -> None:
    """Sequences ``0..n_seqs-1`` hold the same ``n_ctx`` random tokens (one prefill, then KV
    snapshot imports)."""
    eb.prefill_sequences(1, n_ctx)
    snap = eb.ctx.kv.export(0, n_ctx)
    for s in range(1, n_seqs):
        eb.ctx.kv.import_(s, snap)


@torch.inference_mode()
def _steps(eb: EngineBench, batch: int, steps: int, n_ctx: int, rep: int) -> float:
    """Seconds of ``steps`` decode steps of ``batch`` sequences, sampling included."""
    return eb.decode_steps("base", batch, steps, n_ctx, rep)[1]


def _attention_alone(eb: EngineBench, batch: int, n_ctx: int, rng: np.random.Generator) -> float:
    """Seconds for ``attn_decode_batch`` over every layer (one decode step's attention, the
    K/V store included) for sequences ``0..batch-1`` at position ``n_ctx``."""
    ctx, hp = eb.ctx, eb.base.hparams
    kv = ctx.kv
    if not isinstance(kv, KVCache):
        raise TypeError("the attention-alone figure times the CPU engine's KV cache (WorkerContext)")
    kv_rows = [kv.row_of[s] for s in range(batch)]
    for s in range(batch):
        kv.seq_rm(s, n_ctx)
        kv.begin_append(s, n_ctx, 1)
    first = kv_rows[0]
    dec = DecodeRows(
        rows=torch.arange(batch),
        cache_rows=torch.tensor(kv_rows),
        pos=torch.full((batch,), n_ctx),
        pos_min=n_ctx,
        pos_max=n_ctx,
        key_pos=torch.arange(kv.n_ctx_seq),
        contiguous_from=first if kv_rows == list(range(first, first + batch)) else None,
    )
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    dt = eb.base.dtype
    q = torch.randn(batch, hp.n_head, hp.n_embd_head_k, generator=g).to(dt)
    k = torch.randn(batch, hp.n_head_kv, hp.n_embd_head_k, generator=g).to(dt)
    v = torch.randn(batch, hp.n_head_kv, hp.n_embd_head_v, generator=g).to(dt)
    is_swa = getattr(hp, "is_swa", None)
    scale = 1.0 / float(hp.n_embd_head_k) ** 0.5
    t0 = time.perf_counter()
    for il in range(hp.n_layer):
        n_swa = hp.n_swa if is_swa is not None and is_swa(il) else 0
        attn_decode_batch(kv, il, q, k, v, dec, scale, n_swa, 0.0)
    return time.perf_counter() - t0


def run_context(
    base: LoadedModel,
    *,
    contexts: tuple[int, ...] = (100, 3000),
    batches: tuple[int, ...] = (1, 16),
    steps: int = 3,
    reps: int = 5,
    seed: int = 1234,
    modes: tuple[str, ...] = ATTN_MODES,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> dict:
    """Decode step time and attention-alone time per (mode, B, context).

    Returns ``{"step_ms": {mode: {B: {ctx: Figure json}}}, "attn_ms": (same),
    "itl_ratio": {mode: {B: median step ms at max(contexts) / at min(contexts)}}}``.
    """
    model = Model(base)
    ctx = model.new_context(n_ctx_seq=max(contexts) + steps + 8, n_seq=max(batches))
    eb = EngineBench(base, ctx, {"base": EMPTY_SET}, 0, seed)
    step: dict = {m: {b: {c: [] for c in contexts} for b in batches} for m in modes}
    attn: dict = {m: {b: {c: [] for c in contexts} for b in batches} for m in modes}
    rng = np.random.default_rng(seed)
    try:
        for c in contexts:
            log(f"decode_context: filling {max(batches)} sequences with {c} tokens")
            _fill(eb, max(batches), c)
            for b in batches:
                for m in modes:  # warm-up
                    _with_attn(m, partial(_steps, eb, b, 1, c, 999))
                for rep in range(reps):
                    for m in modes:
                        t = _with_attn(m, partial(_steps, eb, b, steps, c, rep))
                        step[m][b][c].append(t / steps * 1e3)
                        attn[m][b][c].append(_with_attn(m, partial(_attention_alone, eb, b, c, rng)) * 1e3)
                    log(
                        f"decode_context: ctx {c} B={b} rep {rep + 1}/{reps}: "
                        + ", ".join(
                            f"{m} {step[m][b][c][-1]:.1f} ms/step (attn {attn[m][b][c][-1]:.1f})" for m in modes
                        )
                    )
                for s in range(b):
                    eb.ctx.kv.seq_rm(s, c)
    finally:
        ctx.close()
    lo, hi = min(contexts), max(contexts)
    return {
        "model": str(base.path),
        "dtype": str(base.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "steps": steps,
        "step_ms": {
            m: {b: {c: Figure.of(v, "ms").to_json() for c, v in d.items()} for b, d in x.items()}
            for m, x in step.items()
        },
        "attn_ms": {
            m: {b: {c: Figure.of(v, "ms").to_json() for c, v in d.items()} for b, d in x.items()}
            for m, x in attn.items()
        },
        "itl_ratio": {
            m: {b: Figure.of(step[m][b][hi]).median / Figure.of(step[m][b][lo]).median for b in batches} for m in modes
        },
    }


def _print(res: dict, contexts: tuple[int, ...], batches: tuple[int, ...]) -> None:
    lo, hi = min(contexts), max(contexts)
    print(f"model {res['model']} ({res['dtype']}, {res['torch_threads']} threads, {res['steps']} steps per sample)")
    print("| attention | B | context | step ms | attention alone ms |")
    print("|---|---|---|---|---|")
    for m, x in res["step_ms"].items():
        for b in batches:
            for c in contexts:
                f, a = x[b][c], res["attn_ms"][m][b][c]
                print(
                    f"| {m} | {b} | {c} | {fmt_fig(Figure(f['median'], f['min'], f['max'], f['n']))} "
                    f"| {fmt_fig(Figure(a['median'], a['min'], a['max'], a['n']))} |"
                )
    for m, x in res["itl_ratio"].items():
        print(f"{m}: ITL({hi})/ITL({lo}) " + ", ".join(f"B={b} {r:.2f}" for b, r in x.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_context", description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", default="100,3000", help="context lengths, comma-separated (default 100,3000)")
    ap.add_argument("--batches", default="1,16", help="decode batch sizes (default 1,16)")
    ap.add_argument("--steps", type=int, default=3, help="decode steps per sample (default 3)")
    ap.add_argument("--reps", type=int, default=5, help="samples per figure (default 5)")
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--modes", default="torch,c", help="attention paths to compare (default torch,c)")
    args = ap.parse_args(argv)
    from worker.runtime.model import default_model_path, load_model

    contexts = tuple(int(x) for x in args.context.split(","))
    batches = tuple(int(x) for x in args.batches.split(","))
    base = load_model(args.model or default_model_path(), dtype=args.dtype, device="cpu")
    res = run_context(
        base,
        contexts=contexts,
        batches=batches,
        steps=args.steps,
        reps=args.reps,
        modes=tuple(args.modes.split(",")),
    )
    _print(res, contexts, batches)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
