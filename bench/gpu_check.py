"""Two stages of ``scripts/gpu_check.sh``: what the machine is, and the warm-up of the GPU
engine's Triton kernels.

``python -m bench.gpu_check env`` prints the versions the run depends on, the GPU and the
attention backend (`environment`); exit status 1 when torch sees no CUDA device or an import
fails. ``python -m bench.gpu_check warmup`` calls each Triton kernel of ``worker.gpu.kernels``
on a synthetic shape's sizes for each dtype (`DTYPES`) and decode batch (`ROWS`), times the
first call and the second (`Warmed`), and checks each result against the kernel's torch
reference within `TOLERANCE`; exit status 1 when a case fails.

The stages of the GPU check: docs/gpu.md, "The GPU check"; details: ``bench/README.md``,
"Details per tool".
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
TOLERANCE = {"f32": 1e-3, "bf16": 5e-2, "f16": 5e-2}
"""Largest relative error a warm-up case may show: f32 products are IEEE f32 against an f64
reference; 16-bit outputs are rounded once to 8 (bf16) or 11 (f16) mantissa bits."""
ROWS = (1, 16, 64)
"""Decode batches warmed: those of the bench's step table (``SYNTHETIC_BATCHES``)."""
PACKAGES = ("torch", "triton", "numpy", "grpcio", "protobuf", "fastapi", "pydantic", "llguidance", "flashinfer-python")
IMPORTS = (
    "worker.runtime.model",
    "worker.gpu.graph_runner",
    "worker.gpu.paged_kv",
    "worker.gpu.sampling",
    "control_plane.server",
)
BLOCK_SIZE = 16  # positions per KV page in the warm-up's caches
SLOTS, RANK = 4, 16  # adapter slots and rank of the warm-up's LoRA pool (the bench's adapters are rank 16)
CTX = 33  # keys per decode row: the bench's 32-token contexts plus the new token
TABLE_BLOCKS = 64  # block-table capacity per row (1 024 positions): enough for split-K on a GPU


def environment() -> tuple[list[tuple[str, str]], list[str]]:
    """``([(label, value)], [problems])`` of the ``env`` stage; a problem is a reason to fail."""
    lines: list[tuple[str, str]] = [("python", f"{platform.python_version()} ({sys.executable})")]
    problems: list[str] = []
    for name in PACKAGES:
        try:
            lines.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            lines.append((name, "not installed"))
    lines.append(("torch CUDA", str(torch.version.cuda)))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(
                (
                    f"cuda:{i}",
                    f"{p.name}, compute capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB, "
                    f"{p.multi_processor_count} multiprocessors",
                )
            )
        from worker.gpu.kernels.flashinfer_backend import select_backend

        lines.append(("attention backend", select_backend(torch.device("cuda"))))
    else:
        problems.append("torch sees no CUDA device (torch.cuda.is_available() is False): the gpu tier would only skip")
    for mod in IMPORTS:
        try:
            importlib.import_module(mod)
            lines.append((f"import {mod}", "ok"))
        except Exception as exc:  # noqa: BLE001 - every failed import is reported, then the stage fails
            lines.append((f"import {mod}", f"FAILED: {type(exc).__name__}: {exc}"))
            problems.append(f"cannot import {mod}: {type(exc).__name__}: {exc}")
    return lines, problems


@dataclass(frozen=True)
class Warmed:
    """One warm-up case: ``kernel`` at ``dtype`` on ``rows`` decode rows; ``first_s`` the first
    call (compile or cache load, then the run), ``again_s`` the second, ``rel_err`` the relative
    error against the torch reference, ``error`` the exception's text when the call raised."""

    kernel: str
    dtype: str
    rows: int
    first_s: float = float("nan")
    again_s: float = float("nan")
    rel_err: float = float("nan")
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.rel_err <= TOLERANCE[self.dtype]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, torch.Tensor]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    scale = float(ref.double().abs().max())
    return float((out.double() - ref.double()).abs().max()) / max(scale, 1e-30)


def _lora_case(n: int, k: int, d: int, dtype: torch.dtype, device: torch.device, g: torch.Generator):
    """``(call, reference)`` of ``add_lora`` on ``n`` rows, each with one of the pool's slots."""
    from worker.gpu.kernels.lora import add_lora, lora_reference

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(device=device, dtype=dtype)

    x, y = rnd(n, k, std=1.0), rnd(n, d, std=1.0)
    a, bt = rnd(SLOTS, RANK, k, std=k**-0.5), rnd(SLOTS, RANK, d, std=RANK**-0.5)
    factor = torch.full((SLOTS,), 2.0, device=device)
    row_slot = torch.zeros(n, SLOTS, device=device)
    row_slot[torch.arange(n), torch.arange(n) % SLOTS] = 1.0
    rank = torch.full((SLOTS,), RANK, dtype=torch.int32, device=device)
    return (
        lambda: add_lora(x, y.clone(), a, bt, factor, row_slot, rank=rank),
        lambda: lora_reference(x, y, a, bt, factor, row_slot, rank=rank),
    )


def _paged(rows: int, h_kv: int, hd: int, dtype: torch.dtype, device: torch.device, g: torch.Generator):
    """Caches holding ``CTX`` random keys per row in ``TABLE_BLOCKS``-wide tables (row ``b`` owns
    pages ``1 + b·TABLE_BLOCKS …``; page 0 is the engine's null page): ``(k, v, tables, lens)``."""
    n_pages = 1 + rows * TABLE_BLOCKS
    k_cache = torch.randn(n_pages, BLOCK_SIZE, h_kv, hd, generator=g).to(device=device, dtype=dtype)
    v_cache = torch.randn(n_pages, BLOCK_SIZE, h_kv, hd, generator=g).to(device=device, dtype=dtype)
    tables = (1 + torch.arange(rows * TABLE_BLOCKS, dtype=torch.int32)).view(rows, TABLE_BLOCKS).to(device)
    lens = torch.full((rows,), CTX, dtype=torch.int32, device=device)
    return k_cache, v_cache, tables, lens


def _kv_write_case(n: int, h_kv: int, hd: int, dtype: torch.dtype, device: torch.device, g: torch.Generator):
    """``(call, reference)`` writing one new token per row at position ``CTX - 1`` of its pages."""
    from worker.gpu.kernels.attention import kv_write, kv_write_reference

    k_cache, v_cache, tables, _ = _paged(n, h_kv, hd, dtype, device, g)
    k = torch.randn(n, h_kv, hd, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(n, h_kv, hd, generator=g).to(device=device, dtype=dtype)
    pos = CTX - 1
    slots = (tables[:, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE).contiguous()

    def run(write) -> torch.Tensor:
        kc, vc = k_cache.clone(), v_cache.clone()
        write(kc, vc, slots, k, v)
        return torch.stack([kc, vc])

    return lambda: run(kv_write), lambda: run(kv_write_reference)


def _decode_case(n: int, h: int, h_kv: int, hd: int, dtype: torch.dtype, device: torch.device, g: torch.Generator):
    """``(call, reference)`` of paged decode attention, one query per row over ``CTX`` keys."""
    from worker.gpu.kernels.attention import decode_attention_reference, paged_decode_attention

    k_cache, v_cache, tables, lens = _paged(n, h_kv, hd, dtype, device, g)
    q = torch.randn(n, h, hd, generator=g).to(device=device, dtype=dtype)
    scale = hd**-0.5
    return (
        lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale=scale),
        lambda: decode_attention_reference(q, k_cache, v_cache, tables, lens, scale=scale),
    )


def warm_up(
    device: torch.device,
    *,
    shape: str = "qwen2.5-1.5b",
    tiny: bool = False,
    dtypes: tuple[str, ...] = ("bf16", "f32", "f16"),
    rows: tuple[int, ...] = ROWS,
    log: Callable[[str], None] = print,
) -> list[Warmed]:
    """Run every warm-up case on ``device`` (a CUDA device, or the CPU under Triton's interpreter)
    with the sizes of synthetic shape ``shape`` (its ``--tiny`` sizes when ``tiny``); one
    :class:`Warmed` per (kernel, dtype, rows), logged as it finishes. A case that raises is
    recorded with its error and the others still run.

    Raises:
        KeyError: an unknown shape or dtype name.
    """
    from bench.synthetic import SHAPES

    dims = SHAPES[shape].tiny if tiny else SHAPES[shape].dims
    q_width = dims.n_head * dims.head_dim
    g = torch.Generator().manual_seed(0)
    results: list[Warmed] = []
    for name in dtypes:
        dt = DTYPES[name]
        for n in rows:
            cases: list[tuple[str, Callable[[], tuple[Callable, Callable]]]] = [
                ("lora attn_q", partial(_lora_case, n, dims.n_embd, q_width, dt, device, g)),
                ("lora ffn_down", partial(_lora_case, n, dims.n_ff, dims.n_embd, dt, device, g)),
                ("kv_write", partial(_kv_write_case, n, dims.n_head_kv, dims.head_dim, dt, device, g)),
                (
                    "decode attention",
                    partial(_decode_case, n, dims.n_head, dims.n_head_kv, dims.head_dim, dt, device, g),
                ),
            ]
            for kernel, make in cases:
                try:
                    call, reference = make()
                    first, out = _timed(call, device)
                    again, out = _timed(call, device)
                    w = Warmed(kernel, name, n, first, again, _rel_err(out, reference()))
                except Exception as exc:  # noqa: BLE001 - one failing kernel must not hide the others
                    w = Warmed(kernel, name, n, error=f"{type(exc).__name__}: {exc}")
                results.append(w)
                status = "ok" if w.ok else f"FAILED ({w.error or f'relative error > {TOLERANCE[name]:g}'})"
                log(
                    f"  {kernel:<17} {name:>4} rows {n:>3}: first {w.first_s:8.3f} s, again {w.again_s * 1e3:9.3f} ms, "
                    f"rel. error {w.rel_err:.2e}  {status}"
                )
    return results


def _env_main() -> int:
    lines, problems = environment()
    width = max(len(label) for label, _ in lines)
    for label, value in lines:
        print(f"{label:<{width}}  {value}")
    for p in problems:
        print(f"env: {p}", file=sys.stderr)
    return 1 if problems else 0


def _warmup_main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        print(f"warmup: unknown dtype(s) {', '.join(unknown)} (expected {', '.join(DTYPES)})", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("warmup: torch sees no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    results = warm_up(device, shape=args.shape, tiny=args.tiny, dtypes=dtypes)
    compile_s = sum(w.first_s - w.again_s for w in results if not w.error)
    failed = [w for w in results if not w.ok]
    print(
        f"warmup: {len(results)} cases in {time.perf_counter() - t0:.1f} s, of which first-call overhead "
        f"(compile or cache load) {compile_s:.1f} s; {len(failed)} failed"
    )
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="versions, the GPU, imports (exit 1 without CUDA)")
    w = sub.add_parser("warmup", help="compile and check the Triton kernels on a shape's sizes")
    w.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu with TRITON_INTERPRET=1")
    w.add_argument("--shape", default="qwen2.5-1.5b", help="synthetic shape whose sizes are used")
    w.add_argument("--tiny", action="store_true", help="the shape's --tiny sizes (the CPU interpreter)")
    w.add_argument("--dtypes", default="bf16,f32,f16", help="compute dtypes, comma-separated")
    args = ap.parse_args(argv)
    return _env_main() if args.command == "env" else _warmup_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
