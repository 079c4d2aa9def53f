"""Fair admission at the worker (``--fairness vtc``) against first come, first served.

Two standalone workers (`Worker`, ``--fairness off`` and ``vtc``) driven over their ``Decode``
RPC by closed loops of four tenants, one heavy (`HEAVY`, `LIGHT`); `run_load` runs the three
runs (off, vtc, and the reference ``alone``) and records each call's events (`Call`, `Run`);
`service_curve`, `service_at` and `backlog_intervals` measure each tenant's service and the
largest difference between backlogged tenants against VTC's bound. The checks print PASS or
FAIL.

The load, the service measure, the bound and the checks: ``bench/README.md`` (``bench.fairness``
and "Details per tool"); the rule itself: docs/fairness.md.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.machine import load_avg, machine_info, machine_line
from bench.servers import free_port
from bench.stats import percentile
from loraplane.env import ENV_WORKER_SECRET
from loraplane.limits import GRPC_MESSAGE_OPTIONS
from loraplane.process import IMPORT_ROOT, child_pythonpath, stop_process
from loraplane.v1 import common_pb2, worker_pb2, worker_pb2_grpc

GAP_S = 0.25  # a closed loop's turnaround counted as still backlogged (module docstring)
TOKEN_LO = 1000  # random prompt ids are drawn from [TOKEN_LO, min(200 000, 95 % of the vocabulary))
HEAVY = "heavy"
LIGHT = ("light-1", "light-2", "light-3")


# ---- the worker ----------------------------------------------------------------------------------


class Worker:
    """A standalone ``loraplane worker`` subprocess on a free loopback port (no control plane,
    no worker secret), its log in ``log``."""

    def __init__(self, args: argparse.Namespace, fairness: str, log: Path):
        self.addr = f"127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "clients.cli", "worker", "--addr", self.addr]
        cmd += ["--slots", str(args.slots), "--fairness", fairness, "--device", args.device]
        cmd += ["--dtype", args.dtype, "--weights", args.weights, "--queue-limit", "256", "--drain-timeout", "0"]
        cmd += [
            "--fairness-prompt-weight",
            str(args.prompt_weight),
            "--fairness-output-weight",
            str(args.output_weight),
        ]
        cmd += ["--n-ctx", str(args.prompt_tokens + args.max_tokens + 16)]
        if args.model:
            cmd += ["--model", args.model]
        env = dict(os.environ)
        env["PYTHONPATH"] = child_pythonpath(env)
        env.pop(ENV_WORKER_SECRET, None)
        self.log = log
        self._fh = open(log, "ab")
        self.proc = subprocess.Popen(
            cmd, cwd=IMPORT_ROOT, env=env, stdout=self._fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        self.channel = grpc.insecure_channel(self.addr, options=GRPC_MESSAGE_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        """Until the worker's health is SERVING. Raises RuntimeError if it exits or times out."""
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the worker exited with code {self.proc.returncode} (log: {self.log})")
            try:
                if (
                    health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker was not serving after {timeout_s:.0f}s (log: {self.log})")
            time.sleep(0.25)

    def stats(self) -> worker_pb2.WorkerStats:
        return self.stub.Stats(common_pb2.Empty(), timeout=30)

    def stop(self) -> None:
        self.channel.close()
        stop_process(self.proc)
        self._fh.close()


def prompt_ids(model: str | None) -> tuple[int, int | None]:
    """The model's random prompt id range's upper bound (exclusive: 200 000 or 95 % of the
    vocabulary, whichever is lower; special tokens sit at the end) and its BOS id (None: none)."""
    import gguf

    from worker.runtime.model import default_model_path

    fields = gguf.GGUFReader(model or str(default_model_path())).fields
    hi = min(200_000, int(len(fields["tokenizer.ggml.tokens"].data) * 0.95))
    bos = fields.get("tokenizer.ggml.bos_token_id")
    return hi, None if bos is None else int(bos.parts[bos.data[0]][0])


# ---- one run: closed loops ----------------------------------------------------------------------


@dataclass
class Call:
    """One request as the client saw it (monotonic seconds)."""

    tenant: str
    stream: int
    sent: float
    prompt_tokens: int = 0
    started: float | None = None
    tokens: list[float] = field(default_factory=list)
    ended: float | None = None
    error: str = ""


@dataclass
class Run:
    """The calls of one run and its measured window ``[t0, t1]``."""

    label: str
    calls: list[Call]
    t0: float
    t1: float
    streams: dict[str, int]


def run_load(
    stub: worker_pb2_grpc.WorkerStub, streams: dict[str, int], args: argparse.Namespace, label: str, seed: int
) -> Run:
    """Closed loops: ``streams[tenant]`` threads per tenant, each sending one request at a
    time (one Decode call each) until ``--duration`` has passed, then waiting for what is in
    flight (``--drain`` s at most, then cancelling)."""
    hi, bos = args.prompt_ids
    calls: list[Call] = []
    lock = threading.Lock()
    open_calls: set = set()
    start = time.monotonic()
    stop_at = start + args.duration

    def loop(tenant: str, k: int, rng: np.random.Generator) -> None:
        n = 0
        while time.monotonic() < stop_at:
            n += 1
            prompt = rng.integers(TOKEN_LO, hi, size=args.prompt_tokens).tolist()
            if bos is not None:
                prompt[0] = bos
            req = common_pb2.GenerateRequest(
                request_id=f"{label}-{tenant}-{k}-{n}",
                sampling=common_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
            )
            req.tokens.ids.extend(int(t) for t in prompt)
            req.adapters.SetInParent()
            msg = worker_pb2.DecodeRequest(submit=req, tenant=worker_pb2.RequestTenant(name=tenant, weight=1.0))
            c = Call(tenant, k, time.monotonic())
            call = stub.Decode(iter([msg]), timeout=args.duration + args.drain + 600)
            with lock:
                calls.append(c)
                open_calls.add(call)
            try:
                for ev in call:
                    now = time.monotonic()
                    kind = ev.WhichOneof("event")
                    if kind == "started":
                        c.started, c.prompt_tokens = now, len(ev.started.prompt_token_ids)
                    elif kind == "token":
                        c.tokens.append(now)
            except grpc.RpcError as exc:
                c.error = exc.code().name
            c.ended = time.monotonic()
            with lock:
                open_calls.discard(call)

    threads = []
    for ti, (tenant, n) in enumerate(streams.items()):
        for k in range(n):
            rng = np.random.default_rng([seed, ti, k])
            threads.append(threading.Thread(target=loop, args=(tenant, k, rng), daemon=True, name=f"{tenant}-{k}"))
    for t in threads:
        t.start()
    deadline = stop_at + args.drain
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    with lock:
        for call in list(open_calls):
            call.cancel()
    for t in threads:
        t.join(30)
    return Run(label, calls, start + args.warmup, stop_at, dict(streams))


# ---- analysis (pure) ------------------------------------------------------------------------------


def service_curve(calls: list[Call], w_p: float, w_q: float, weight: float = 1.0) -> tuple[list[float], list[float]]:
    """One tenant's cumulative service: (event times ascending, service after each), in
    virtual tokens (module docstring)."""
    events = []
    for c in calls:
        if c.started is not None:
            events.append((c.started, w_p * c.prompt_tokens / weight))
        events += [(t, w_q / weight) for t in c.tokens]
    events.sort()
    times, cum, total = [], [], 0.0
    for t, v in events:
        total += v
        times.append(t)
        cum.append(total)
    return times, cum


def service_at(curve: tuple[list[float], list[float]], t: float) -> float:
    """``S(t)``: the service received up to and including time ``t``."""
    times, cum = curve
    i = bisect.bisect_right(times, t)
    return cum[i - 1] if i else 0.0


def backlog_intervals(calls: list[Call], gap_s: float = GAP_S) -> list[tuple[float, float]]:
    """The times one tenant had a request outstanding (sent, not ended), merged across its
    calls, gaps of at most ``gap_s`` (a closed loop's turnaround) bridged."""
    spans = sorted((c.sent, c.ended if c.ended is not None else math.inf) for c in calls)
    out: list[list[float]] = []
    for a, b in spans:
        if out and a <= out[-1][1] + gap_s:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def backlogged(intervals: list[tuple[float, float]], a: float, b: float) -> bool:
    """Whether one interval covers all of ``[a, b]``."""
    return any(x <= a and b <= y for x, y in intervals)


def max_service_difference(
    curves: dict[str, tuple[list[float], list[float]]],
    intervals: dict[str, list[tuple[float, float]]],
    t0: float,
    t1: float,
    length: float,
    step: float,
) -> tuple[float, int]:
    """Over windows ``[a, a + length]`` with ``a = t0, t0 + step, …`` and ``a + length ≤ t1``:
    the largest service difference between two tenants backlogged over the window, and the
    number of windows that had at least two. (NaN, 0) when none had two."""
    best, n = math.nan, 0
    a = t0
    while a + length <= t1 + 1e-9:
        b = a + length
        served = [service_at(curves[t], b) - service_at(curves[t], a) for t in curves if backlogged(intervals[t], a, b)]
        if len(served) >= 2:
            n += 1
            d = max(served) - min(served)
            best = d if math.isnan(best) else max(best, d)
        a += step
    return best, n


def vtc_bound(w_p: float, w_q: float, max_prompt: int, slots: int, max_tokens: int) -> float:
    """The paper's bound ``2 max(w_p L_in, w_q M)`` with ``M = slots × max_tokens`` (no
    preemption: module docstring)."""
    return 2 * max(w_p * max_prompt, w_q * slots * max_tokens)


def analyze(run: Run, args: argparse.Namespace) -> dict:
    """Per tenant: tok/s, TTFT p50/p99 (ms), requests; total tok/s; service differences."""
    span = run.t1 - run.t0
    by: dict[str, list[Call]] = {t: [c for c in run.calls if c.tenant == t] for t in run.streams}
    tenants = {}
    for t, calls in by.items():
        toks = sum(1 for c in calls for x in c.tokens if run.t0 <= x <= run.t1)
        ttft = [(c.tokens[0] - c.sent) * 1000 for c in calls if run.t0 <= c.sent <= run.t1 and c.tokens]
        tenants[t] = {
            "streams": run.streams[t],
            "tok_s": toks / span,
            "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p99_ms": percentile(ttft, 99),
            "requests": len(ttft),
            "errors": sum(1 for c in calls if c.error and c.ended is not None and c.ended <= run.t1),
        }
    curves = {t: service_curve(calls, args.prompt_weight, args.output_weight) for t, calls in by.items()}
    intervals = {t: backlog_intervals(calls) for t, calls in by.items()}
    diffs = {}
    for name, length in (("T", args.window), ("3T", 3 * args.window)):
        d, n = max_service_difference(curves, intervals, run.t0, run.t1, length, args.window / 4)
        diffs[name] = {"seconds": length, "max_difference": d, "windows": n}
    return {
        "tenants": tenants,
        "total_tok_s": sum(v["tok_s"] for v in tenants.values()),
        "service_difference": diffs,
        "max_prompt_tokens": max((c.prompt_tokens for c in run.calls), default=0),
    }


def light_ttft_p99(run: Run) -> float:
    """TTFT p99 (ms) of the light tenants' requests sent in the measured window, pooled."""
    ttft = [
        (c.tokens[0] - c.sent) * 1000
        for c in run.calls
        if c.tenant in LIGHT and run.t0 <= c.sent <= run.t1 and c.tokens
    ]
    return percentile(ttft, 99)


def aggregate(reps: list[dict]) -> dict:
    """One run's figures over its repetitions: the median total tok/s and light TTFT p99, the
    largest service differences (the bound is a worst case), the longest prompt."""
    diffs = {
        k: {"max_difference": max(r["service_difference"][k]["max_difference"] for r in reps)}
        for k in reps[0]["service_difference"]
    }
    return {
        "total_tok_s": statistics.median(r["total_tok_s"] for r in reps),
        "light_ttft_p99_ms": statistics.median(r["light_ttft_p99_ms"] for r in reps),
        "service_difference": diffs,
        "max_prompt_tokens": max(r["max_prompt_tokens"] for r in reps),
    }


def checks(res: dict, bound: float, one_request: float) -> list[tuple[bool, str]]:
    """The targets (module docstring) as (passed, line)."""
    off, on, ref = res["off"], res["vtc"], res["alone"]
    out = []
    p99_on, p99_ref = on["light_ttft_p99_ms"], ref["light_ttft_p99_ms"]
    out.append((p99_on <= 1.5 * p99_ref, f"light TTFT p99 on {p99_on:.0f} ms <= 1.5 x reference {p99_ref:.0f} ms"))
    tot_on, tot_off = on["total_tok_s"], off["total_tok_s"]
    out.append((tot_on >= 0.95 * tot_off, f"total throughput on {tot_on:.2f} tok/s >= 95% of off {tot_off:.2f}"))
    d_t, d_3t = (on["service_difference"][k]["max_difference"] for k in ("T", "3T"))
    out.append(
        (d_t <= bound and d_3t <= bound, f"service difference on: T {d_t:.0f}, 3T {d_3t:.0f} <= bound {bound:.0f}")
    )
    steady = d_3t <= 1.25 * d_t or max(d_t, d_3t) <= one_request
    out.append((steady, f"service difference on does not grow: 3T {d_3t:.0f} vs T {d_t:.0f}"))
    o_t, o_3t = (off["service_difference"][k]["max_difference"] for k in ("T", "3T"))
    out.append((o_3t > 1.5 * o_t, f"service difference off grows: 3T {o_3t:.0f} > 1.5 x T {o_t:.0f}"))
    return out


# ---- main ----------------------------------------------------------------------------------------


def _print_run(label: str, r: dict) -> None:
    print(f"\n{label}: total {r['total_tok_s']:.2f} tok/s")
    print(f"  {'tenant':8s} {'streams':>7s} {'tok/s':>7s} {'TTFT p50 ms':>12s} {'TTFT p99 ms':>12s} {'requests':>8s}")
    for t, v in r["tenants"].items():
        print(
            f"  {t:8s} {v['streams']:7d} {v['tok_s']:7.2f} {v['ttft_p50_ms']:12.0f} {v['ttft_p99_ms']:12.0f} "
            f"{v['requests']:8d}" + (f"  errors {v['errors']}" if v["errors"] else "")
        )
    for k, d in r["service_difference"].items():
        print(
            f"  max service difference over {k} = {d['seconds']:.0f} s windows: "
            f"{d['max_difference']:.0f} ({d['windows']} windows)"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.fairness",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--slots", type=int, default=2, help="worker --slots (default 2)")
    ap.add_argument("--heavy-streams", type=int, default=8, help="the heavy tenant's closed-loop streams (default 8)")
    ap.add_argument("--light-streams", type=int, default=1, help="each light tenant's streams (default 1)")
    ap.add_argument("--duration", type=float, default=90.0, help="seconds each run sends requests (default 90)")
    ap.add_argument("--warmup", type=float, default=10.0, help="first seconds of a run not measured (default 10)")
    ap.add_argument("--window", type=float, default=15.0, help="T, the shorter service window, s (default 15)")
    ap.add_argument("--drain", type=float, default=60.0, help="seconds to wait for in-flight requests (default 60)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (default 32)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens each request generates (default 32)")
    ap.add_argument("--prompt-weight", type=float, default=1.0, help="w_p, worker --fairness-prompt-weight (1)")
    ap.add_argument("--output-weight", type=float, default=2.0, help="w_q, worker --fairness-output-weight (2)")
    ap.add_argument("--model", default=None, help="base model GGUF (default: the embedded Gemma 3 270M)")
    ap.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu", help="worker --device (default cpu)")
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--weights", choices=["packed", "dequant"], default="packed")
    ap.add_argument("--reps", type=int, default=1, help="repetitions of the three runs, alternated (default 1)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", default=None, metavar="OUT", help="write every figure here")
    args = ap.parse_args(argv)
    if args.warmup >= args.duration or 3 * args.window > args.duration - args.warmup:
        ap.error("need --warmup < --duration and 3 x --window <= --duration - --warmup")
    args.prompt_ids = prompt_ids(args.model)
    machine = machine_info(args.weights, args.device, args.dtype)
    print(machine_line(machine), f"load {load_avg()}", flush=True)
    heavy = {HEAVY: args.heavy_streams, **{t: args.light_streams for t in LIGHT}}
    alone = {HEAVY: args.light_streams, **{t: args.light_streams for t in LIGHT}}
    print(
        f"slots {args.slots}; streams {heavy} (reference: {alone}); prompt {args.prompt_tokens} -> "
        f"{args.max_tokens} tokens; runs of {args.duration:.0f} s ({args.warmup:.0f} s warm-up); "
        f"T = {args.window:.0f} s; w_p {args.prompt_weight:g}, w_q {args.output_weight:g}",
        flush=True,
    )
    t_start = time.monotonic()
    plan = (("off", "off", heavy), ("vtc", "vtc", heavy), ("alone", "vtc", alone))
    reps: dict[str, list[dict]] = {label: [] for label, _, _ in plan}
    with tempfile.TemporaryDirectory(prefix="loraplane-bench-fairness-") as tmp:
        workers = {f: Worker(args, f, Path(tmp) / f"worker-{f}.log") for f in ("off", "vtc")}
        try:
            for w in workers.values():
                w.wait_ready()
            for rep in range(args.reps):  # alternating: machine noise hits every run alike
                for label, fairness, streams in plan:
                    tag = f"{label} rep {rep + 1}" if args.reps > 1 else label
                    print(f"[{time.monotonic() - t_start:6.0f} s] run {tag} (worker --fairness {fairness})", flush=True)
                    run = run_load(workers[fairness].stub, streams, args, f"{label}{rep}", args.seed + rep)
                    r = analyze(run, args)
                    r["light_ttft_p99_ms"] = light_ttft_p99(run)
                    reps[label].append(r)
                    _print_run(tag, r)
            tenants = [(t.name, round(t.virtual_tokens)) for t in workers["vtc"].stats().tenants]
            print(f"\nthe vtc worker's counters after its runs (name, virtual tokens): {tenants}")
        finally:
            for w in workers.values():
                w.stop()
    res = {label: aggregate(rs) for label, rs in reps.items()}
    if args.reps > 1:
        for label, r in res.items():
            d = r["service_difference"]
            print(
                f"{label}: median total {r['total_tok_s']:.2f} tok/s, median light TTFT p99 "
                f"{r['light_ttft_p99_ms']:.0f} ms, max service difference T {d['T']['max_difference']:.0f}, "
                f"3T {d['3T']['max_difference']:.0f} (over {args.reps} repetitions)"
            )
    max_prompt = max(r["max_prompt_tokens"] for r in res.values())
    bound = vtc_bound(args.prompt_weight, args.output_weight, max_prompt, args.slots, args.max_tokens)
    one_request = args.prompt_weight * max_prompt + args.output_weight * args.max_tokens
    print(
        f"\nVTC bound 2 max(w_p L_in, w_q M) = 2 max({args.prompt_weight:g} x {max_prompt}, "
        f"{args.output_weight:g} x {args.slots} x {args.max_tokens}) = {bound:.0f} virtual tokens "
        f"(M = slots x max_tokens: no preemption); one request = {one_request:.0f}"
    )
    results = checks(res, bound, one_request)
    for ok, line in results:
        print(("PASS " if ok else "FAIL ") + line)
    print(f"wall {time.monotonic() - t_start:.0f} s, load {load_avg()}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "machine": machine,
                    "params": {k: v for k, v in vars(args).items() if k != "prompt_ids"},
                    "runs": res,
                    "repetitions": reps,
                    "bound": bound,
                    "checks": [{"passed": ok, "check": line} for ok, line in results],
                },
                indent=2,
                default=lambda x: None if isinstance(x, float) and not math.isfinite(x) else str(x),
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
