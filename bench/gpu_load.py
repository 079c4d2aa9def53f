"""How long a worker takes to put a GGUF's weights on the device (``device-dense`` form), against
the start-up target (`START_UP_TARGET_S`), and how fast the torch dequantization ops run per
GGUF type.

``python -m bench.gpu_load throughput`` dequantizes one tensor per type chunk by chunk as the
loader does (`throughput`), counting the ops and bytes moved per value with a torch dispatch
mode (`_Traffic`) and estimating a GPU's time from `GPU_COPY_GBS` and `LAUNCH_US`;
``python -m bench.gpu_load load`` times the loader's phases (read, upload, dequantize + fused
projections, ``load_model``) over a real GGUF or random tensors of a model shape (`SHAPES`,
`shape_tensors`, `random_record`).

Flags and figures: ``bench/README.md`` ("Weights on the GPU", "Details per tool").
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from torch.utils._python_dispatch import TorchDispatchMode

from loraplane.formats.gguf.reader import TensorRecord, read_gguf
from worker.gpu.dequant import CHUNK_ELEMS, DEVICE_DEQUANT_TYPES, PLAIN_DTYPES, Uploader, dequantize_rows
from worker.runtime.model import load_device_dense, load_model

START_UP_TARGET_S = 30.0
GPU_COPY_GBS = 4300.0
"""The H200's measured copy rate (GB/s, read + write) from the issue that asked for this engine."""
LAUNCH_US = 5.0
"""Per-launch cost assumed in the GPU estimate (eager torch ops, microseconds)."""

SHAPES = {
    "qwen2.5-1.5b": {"n_layer": 28, "n_embd": 1536, "n_q": 1536, "n_kv": 256, "n_ff": 8960, "n_vocab": 151936},
    "llama-3-8b": {"n_layer": 32, "n_embd": 4096, "n_q": 4096, "n_kv": 1024, "n_ff": 14336, "n_vocab": 128256},
}
"""Model shapes by name: layers, width, q / k-v projection rows, FFN width, vocabulary."""

F16_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}
"""Byte offsets of each block type's f16 scales, set to finite values in random blocks."""


def shape_tensors(shape: str, n_layer: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """(name, ggml ``ne``) of every tensor of a qwen2-like model of ``shape`` (tied output)."""
    s = SHAPES[shape]
    e, q, kv, ff = s["n_embd"], s["n_q"], s["n_kv"], s["n_ff"]
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (e, s["n_vocab"]))]
    for il in range(s["n_layer"] if n_layer is None else n_layer):
        b = f"blk.{il}."
        out += [(b + "attn_norm.weight", (e,)), (b + "attn_q.weight", (e, q)), (b + "attn_q.bias", (q,))]
        out += [(b + "attn_k.weight", (e, kv)), (b + "attn_k.bias", (kv,))]
        out += [(b + "attn_v.weight", (e, kv)), (b + "attn_v.bias", (kv,)), (b + "attn_output.weight", (q, e))]
        out += [(b + "ffn_norm.weight", (e,)), (b + "ffn_gate.weight", (e, ff)), (b + "ffn_up.weight", (e, ff))]
        out += [(b + "ffn_down.weight", (ff, e))]
    return out + [("output_norm.weight", (e,))]


def random_record(name: str, ne: tuple[int, ...], t: T, rng: np.random.Generator) -> TensorRecord:
    """A tensor of random raw bytes in type ``t`` (finite values: f16 scale fields and F16 /
    BF16 values with a bounded exponent), in the reader's byte-row form."""
    rows, k = math.prod(ne[1:]) if len(ne) > 1 else 1, ne[0]
    block, size = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (rows, k // block * size), dtype=np.uint8)
    if t in (T.F16, T.BF16):
        u = raw.view(np.uint16)
        u &= 0xBFFF if t == T.F16 else 0xBEFF  # exponent below the top: |x| < 2 (f16), < 2^64 (bf16)
        u |= 0x0400 if t == T.F16 else 0x0080  # and above the bottom: no subnormals
    elif t == T.F32:
        raw = rng.standard_normal((rows, k), dtype=np.float32).view(np.uint8)
    else:
        blocks = raw.reshape(-1, size)
        for at in F16_FIELDS[t]:
            blocks[:, at : at + 2] = rng.uniform(-1, 1, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    return TensorRecord(name, t, ne, raw)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


class _Traffic(TorchDispatchMode):
    """Counts the aten ops run and the bytes their tensor inputs and outputs hold (views count
    as none): what a memory-bound op moves."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        ins = [a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        outs = [o for o in (out if isinstance(out, tuple | list) else [out]) if isinstance(o, torch.Tensor)]
        self.ops += 1
        # an in-place op's output is its first input: each distinct tensor counts once
        seen = {(t.data_ptr(), t.numel(), t.dtype): t.numel() * t.element_size() for t in ins + outs}
        self.bytes += sum(seen.values())
        return out


def _dequant_chunks(raw: torch.Tensor, out: torch.Tensor, t: T, k: int) -> None:
    """``out`` ``(rows, k)`` = the dequantized ``raw`` ``(rows, row_bytes)``, chunk by chunk as
    ``dequantize_tensor`` does (its upload left out: the bytes are already on the device)."""
    step = max(1, CHUNK_ELEMS // k)
    plain = PLAIN_DTYPES.get(t)
    for r0 in range(0, raw.shape[0], step):
        chunk = raw[r0 : r0 + step]
        out[r0 : r0 + step].copy_(chunk.view(plain) if plain is not None else dequantize_rows(chunk, t, k))


def throughput(device: torch.device, mib: int, reps: int, dtype: torch.dtype) -> None:
    k = 1536
    n_shape = sum(math.prod(ne) for _, ne in shape_tensors("qwen2.5-1.5b") if len(ne) == 2)
    print(f"device {device}, output {dtype}, ~{mib} MiB of output per type, median of {reps}")
    print(f"{'type':6s} {'out GB/s':>9s} {'GGUF GB/s':>9s} {'ops/chunk':>9s} {'B/value':>8s} {'1.5B GPU est s':>14s}")
    rng = np.random.default_rng(0)
    for t in sorted(DEVICE_DEQUANT_TYPES, key=lambda t: t.name):
        if t == T.F32:
            continue
        rows = max(1, mib * 2**20 // (k * torch.finfo(dtype).bits // 8))
        rec = random_record("w", (k, rows), t, rng)
        raw = torch.from_numpy(np.asarray(rec.raw)).to(device)
        out = torch.empty((rows, k), dtype=dtype, device=device)
        run = functools.partial(_dequant_chunks, raw, out, t, k)
        run()  # warm-up (CUDA: allocator, kernels)
        secs = statistics.median(_timed(run, device) for _ in range(reps))
        chunk_rows = min(rows, max(1, CHUNK_ELEMS // k))
        with _Traffic() as tr:  # one chunk's ops and bytes
            _dequant_chunks(raw[:chunk_rows], out[:chunk_rows], t, k)
        per_value = tr.bytes / (chunk_rows * k)
        est = n_shape * per_value / (GPU_COPY_GBS * 1e9) + tr.ops * math.ceil(n_shape / CHUNK_ELEMS) * LAUNCH_US * 1e-6
        print(
            f"{t.name:6s} {out.numel() * out.element_size() / secs / 1e9:9.2f} {rec.n_bytes / secs / 1e9:9.2f} "
            f"{tr.ops:9d} {per_value:8.1f} {est:14.2f}"
        )
    print(
        f"(1.5B shape: {n_shape / 1e9:.2f} G matrix values; GPU estimate at {GPU_COPY_GBS:.0f} GB/s, {LAUNCH_US} µs/op)"
    )


def _records(args: argparse.Namespace) -> tuple[dict[str, TensorRecord], int, str]:
    if args.gguf:
        gf = read_gguf(args.gguf)
        return dict(gf.tensors), int(gf.get(f"{gf.arch}.block_count", 0)), str(args.gguf)
    rng = np.random.default_rng(0)
    t = T[args.type]
    specs = shape_tensors(args.shape, args.layers)
    recs = {n: random_record(n, ne, t if len(ne) == 2 else T.F32, rng) for n, ne in specs}
    n_layer = args.layers if args.layers is not None else SHAPES[args.shape]["n_layer"]
    return recs, n_layer, f"{args.shape} ({n_layer} layers, {t.name} matrices, random, in memory)"


def load(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
    recs, n_layer, what = _records(args)
    total = sum(r.n_bytes for r in recs.values())
    print(f"{what}: {len(recs)} tensors, {total / 1e9:.2f} GB; device {device}, matrices {args.dtype}")
    rows: list[tuple[str, list[float], int]] = []
    host = np.empty(max(r.n_bytes for r in recs.values()), dtype=np.uint8)

    def read() -> None:
        for r in recs.values():
            np.copyto(host[: r.n_bytes], np.ascontiguousarray(r.raw).view(np.uint8).reshape(-1))

    def upload() -> None:
        up = Uploader(device)
        for r in recs.values():
            up.upload(np.ascontiguousarray(r.raw).view(np.uint8).reshape(-1))

    held_bytes = 0

    def dense() -> None:
        nonlocal held_bytes
        held, _ = load_device_dense(recs, n_layer, device, dtype)
        held_bytes = sum(w.numel() * w.element_size() for w in held.values())

    for name, fn in (("read", read), ("upload", upload), ("load", dense)):
        times = []
        for _ in range(args.reps):
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            times.append(_timed(fn, device))
        rows.append((name, times, total))
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        print(f"device memory peak during load {peak / 1e9:.2f} GB: weights held {held_bytes / 1e9:.2f} GB", end="")
        print(f" + {(peak - held_bytes) / 2**20:.0f} MiB (one chunk's bytes and f32 intermediates)")
    if args.gguf:
        rows.append(
            ("load_model", [_timed(lambda: load_model(args.gguf, device=args.device, dtype=args.dtype), device)], total)
        )
    head = f"{'phase':10s} {'median s':>9s} {'min s':>7s} {'max s':>7s} {'GB/s':>7s}"
    print(f"{head}  per repetition (start-up target {START_UP_TARGET_S:.0f} s, graphs included)")
    for name, times, nbytes in rows:
        med = statistics.median(times)
        print(
            f"{name:10s} {med:9.3f} {min(times):7.3f} {max(times):7.3f} {nbytes / med / 1e9:7.2f}  "
            + " ".join(f"{t:.3f}" for t in times)
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_load", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    tp = sub.add_parser("throughput", help="dequantization GB/s per GGUF type, raw bytes already on the device")
    tp.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    tp.add_argument("--mib", type=int, default=64)
    tp.add_argument("--reps", type=int, default=5)
    tp.add_argument("--dtype", choices=["bf16", "f16"], default="bf16")
    lp = sub.add_parser("load", help="the loader's weight pass, phase by phase")
    src = lp.add_mutually_exclusive_group()
    src.add_argument("--gguf", type=Path, help="a GGUF file (read from its mapping)")
    src.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    lp.add_argument("--type", default="F16", choices=sorted(t.name for t in DEVICE_DEQUANT_TYPES))
    lp.add_argument("--layers", type=int, help="fewer layers than the shape's (a quick run)")
    lp.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    lp.add_argument("--dtype", choices=["bf16", "f16", "f32"], default="bf16")
    lp.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    if args.cmd == "throughput":
        throughput(
            torch.device(args.device), args.mib, args.reps, torch.bfloat16 if args.dtype == "bf16" else torch.float16
        )
    else:
        load(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
