"""Scenario 9: the compute and memory bounds of a B=16 decode step, beside the measured step.

`run_bounds` counts the step's multiply-accumulates from the model's weights (`step_macs`),
measures this CPU's peak int8 MAC rate per instruction family (`build_peak_binary` compiles
``bench/csrc/peak_int8.cpp``; `measure_peak` runs it in a child process per ISA of
`available_isas`) and the copy bandwidth, and sets the larger bound beside the in-process B=16
step (target `TARGET_RATIO`); `add_served_step` adds the serving worker's step interval.

What is counted, why the best repetition, the target: ``bench/README.md`` (scenario 9, and
"Details per tool").
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.engine import EngineBench, measure_bandwidth
from bench.profiles import Profile
from bench.roofline import gguf_tensor_bytes, weight_bytes_per_step
from bench.stats import Figure, ratio
from worker.runtime.kernels import cpu_flags
from worker.runtime.model import LoadedModel

SOURCE = Path(__file__).resolve().parent / "csrc" / "peak_int8.cpp"
CXX_FLAGS = ["-O2", "-std=c++17", "-pthread"]
TARGET_RATIO = 3.0  # the target: B=16 step ≤ 3 × the bound (2 × before)

# isa -> (instruction as printed, MACs per instruction, /proc/cpuinfo flags it needs)
ISAS: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "amx": ("AMX tdpbusd (tile 16×16 int32 += 16×64 u8 · 64×16 s8)", 16 * 16 * 64, ("amx_tile", "amx_int8")),
    "avx512vnni": ("AVX-512 VNNI vpdpbusd zmm", 64, ("avx512f", "avx512bw", "avx512_vnni")),
    "avxvnni": ("AVX-VNNI vpdpbusd ymm", 32, ("avx2", "avx_vnni")),
    "avx2": ("AVX2 vpmaddubsw + vpmaddwd + vpaddd ymm", 32, ("avx2",)),
}

# HOOK for the scheduler's measured decode step: when the worker reports its step interval in
# ``WorkerStats`` under this field (milliseconds), ``bench.serving._stats_json`` copies it into
# the serving scenario's ``worker_stats`` and :func:`add_served_step` puts it beside the
# in-process step and the bound. Rename here if the field lands under another name.
STEP_INTERVAL_FIELD = "step_interval_p50_ms"


def build_dir() -> Path:
    """Where the peak-rate binary is cached: ``$LORAPLANE_BENCH_BUILD_DIR`` or
    ``~/.cache/loraplane/bench-build``."""
    env = os.environ.get("LORAPLANE_BENCH_BUILD_DIR")
    return Path(env) if env else Path.home() / ".cache" / "loraplane" / "bench-build"


def build_peak_binary() -> Path:
    """Compile ``csrc/peak_int8.cpp`` (g++, no ``-m`` flags: each routine carries its own
    target attribute) once per source/flags hash; returns the executable's path.

    Raises:
        RuntimeError: no C++ compiler, or the compile failed (its output in the message).
    """
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (need g++ >= 11 on PATH, or set CXX)")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cxx, *CXX_FLAGS]).encode()).hexdigest()[:12]
    out = build_dir() / f"peak_int8-{key}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        exe = Path(tmp) / out.name
        proc = subprocess.run([cxx, *CXX_FLAGS, "-o", str(exe), str(SOURCE)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed:\n{proc.stderr[-3000:]}")
        os.replace(exe, out)  # atomic: a concurrent build finds either nothing or the whole file
    return out


def available_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The peak-rate routines this CPU can run, fastest family first."""
    flags = cpu_flags() if flags is None else flags
    return [isa for isa, (_, _, need) in ISAS.items() if all(f in flags for f in need)]


def _run_peak(exe: Path, isa: str, threads: int, iters: int) -> tuple[int, float]:
    proc = subprocess.run([str(exe), isa, str(threads), str(iters)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"exit status {proc.returncode}: {proc.stderr.strip()[:300]}")
    macs, secs = proc.stdout.split()
    return int(macs), float(secs)


def measure_peak(exe: Path, isa: str, *, threads: int, run_s: float, reps: int) -> dict:
    """Peak MAC rate of one routine on ``threads`` threads: ``reps`` runs of about ``run_s``
    seconds each (iterations calibrated by a first short run). Returns
    ``{"instruction", "macs_per_instruction", "gmac_s": Figure, "best_gmac_s", "iters"}`` or
    ``{"instruction", "error"}`` when the routine fails (e.g. AMX refused by the kernel)."""
    instr, per, _ = ISAS[isa]
    try:
        iters = 20_000
        while True:  # calibrate: grow until one run takes ≥ 20 ms
            _, secs = _run_peak(exe, isa, threads, iters)
            if secs >= 0.02 or iters >= 1 << 34:
                break
            iters *= 8
        iters = max(1, int(iters * run_s / secs))
        rates = []
        for _ in range(reps):
            macs, secs = _run_peak(exe, isa, threads, iters)
            rates.append(macs / secs / 1e9)
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
        return {"instruction": instr, "macs_per_instruction": per, "error": str(exc)}
    return {
        "instruction": instr,
        "macs_per_instruction": per,
        "gmac_s": Figure.of(rates, "GMAC/s").to_json(),
        "best_gmac_s": max(rates),
        "iters": iters,
    }


def step_macs(base: LoadedModel, batch: int) -> dict:
    """Multiply-accumulates of one decode step of ``batch`` rows in the linear layers and the
    LM head (ggml ``ne``: ``ne0`` inputs × ``ne1`` outputs per weight, one MAC each per row)."""
    ne = base.tensor_ne
    linear = {n: s for n, s in ne.items() if n.startswith("blk.") and n.endswith(".weight") and len(s) == 2}
    head = "output.weight" if "output.weight" in ne else "token_embd.weight"
    per_row = sum(s[0] * s[1] for s in linear.values()) + ne[head][0] * ne[head][1]
    return {
        "linear_weights": len(linear),
        "lm_head": head,
        "macs_per_row": per_row,
        "lm_head_macs_per_row": ne[head][0] * ne[head][1],
        "macs_per_step": per_row * batch,
    }


def run_bounds(
    base: LoadedModel, adapter_path: Path, profile: Profile, *, seed: int, log: Callable[[str], None]
) -> dict:
    """Scenario 9 (see the module docstring). Returns JSON-ready results."""
    p = profile
    b = p.bounds_batch
    threads = torch.get_num_threads()
    exe = build_peak_binary()
    isas = available_isas()
    peaks: dict[str, dict] = {}
    for isa in isas:
        peaks[isa] = measure_peak(exe, isa, threads=threads, run_s=p.bounds_run_s, reps=max(3, p.reps))
        pk = peaks[isa]
        log(
            f"bounds: {isa} on {threads} threads: "
            + (f"{pk['gmac_s']['median']:.1f} GMAC/s" if "error" not in pk else f"failed ({pk['error']})")
        )
    macs = step_macs(base, b)
    for pk in peaks.values():
        if "error" not in pk:
            pk["compute_bound_ms"] = macs["macs_per_step"] / (pk["best_gmac_s"] * 1e9) * 1e3
    ok = [isa for isa in isas if "error" not in peaks[isa]]
    fastest = max(ok, key=lambda i: peaks[i]["best_gmac_s"]) if ok else None

    bw = measure_bandwidth(p.bw_mib, max(9, p.reps), base.device)
    best_bw = bw["gb_s"]["max"] * 1e9
    gguf_step, held_step = gguf_tensor_bytes(base, per_step=True), weight_bytes_per_step(base)
    mem_ms, mem_held_ms = gguf_step / best_bw * 1e3, held_step / best_bw * 1e3
    compute_ms = peaks[fastest]["compute_bound_ms"] if fastest else float("nan")

    def bound_at(bytes_s: float) -> float:
        """The B=b bound in ms at a copy bandwidth of ``bytes_s`` bytes/s."""
        mem = gguf_step / bytes_s * 1e3
        return max(compute_ms, mem) if fastest else mem

    bound_ms = bound_at(best_bw)
    log(
        f"bounds: B={b} step {macs['macs_per_step'] / 1e9:.2f} GMAC, compute bound {compute_ms:.2f} ms "
        f"({fastest}), memory bound {mem_ms:.2f} ms ({gguf_step / 2**20:.1f} MiB at {best_bw / 1e9:.1f} GB/s)"
    )

    # the in-process B=b step including sampling, as scenario 1 measures its decode steps
    eb = EngineBench.create(base, adapter_path, n_ctx_seq=p.decode_ctx + p.decode_steps + 8, seed=seed, n_seq=b)
    try:
        eb.prefill_sequences(b, p.decode_ctx)
        eb.decode_steps("base", b, 1, p.decode_ctx, rep=999)  # warm-up, excluded
        t0 = time.perf_counter()
        steps, paired_bounds = [], []
        for rep in range(p.reps):
            # the copy bandwidth again just before each repetition: on a shared host both swing
            # together over tens of seconds, so each repetition also gets the bound of its moment
            paired_bounds.append(bound_at(measure_bandwidth(p.bw_mib, 3, base.device)["gb_s"]["max"] * 1e9))
            steps.append(eb.decode_steps("base", b, p.decode_steps, p.decode_ctx, rep)[1] / p.decode_steps)
        took = time.perf_counter() - t0
        log(f"bounds: in-process B={b} step incl. sampling {min(steps) * 1e3:.1f} ms (best of {p.reps}, {took:.1f} s)")
    finally:
        eb.ctx.close()
    step = Figure.of([s * 1e3 for s in steps], "ms").to_json()
    return {
        "batch": b,
        "threads": threads,
        "decode_ctx": p.decode_ctx,
        "decode_steps": p.decode_steps,
        "dtype": str(base.dtype).removeprefix("torch."),
        "weights": base.weight_form,
        **macs,
        "peaks": peaks,
        "fastest": fastest,
        "compute_bound_ms": compute_ms if fastest else None,
        "bandwidth": bw,
        "gguf_bytes_per_step": gguf_step,
        "weight_bytes_per_step": held_step,
        "memory_bound_ms": mem_ms,
        "memory_bound_held_ms": mem_held_ms,
        "bound_ms": bound_ms,
        "bound_kind": "compute" if fastest and compute_ms >= mem_ms else "memory",
        "step_ms": step,
        "step_over_bound": ratio(step["median"], bound_ms),
        "step_best_over_bound": ratio(step["min"], bound_ms),
        "paired_bound_ms": Figure.of(paired_bounds, "ms").to_json(),
        "paired_step_over_bound": Figure.of(
            [s * 1e3 / pb for s, pb in zip(steps, paired_bounds, strict=True)], "x"
        ).to_json(),
        "target_step_over_bound": TARGET_RATIO,
    }


def add_served_step(out: dict, serving: dict | None) -> dict:
    """Add the worker's measured decode step interval (the :data:`STEP_INTERVAL_FIELD` hook)
    from the serving scenario's mixed worker, when it reports one; unchanged otherwise."""
    out = dict(out)
    ws = ((serving or {}).get("worker_stats") or {}).get("mixed") or {}
    ms = ws.get(STEP_INTERVAL_FIELD)
    if ms:
        out["served_step_ms"] = float(ms)
        out["served_step_over_bound"] = ratio(float(ms), out["bound_ms"])
    return out
