"""Closed-loop load generation and the latency/throughput figures of one run.

``concurrency`` client threads each take the next request from the list as soon as their
previous one finished (closed loop), until the list is used up. Every token's arrival time is
recorded at the client: TTFT = first token − submit; inter-token latency (ITL) = gaps
between successive tokens of one request; output tokens/s = all generated tokens / (last
finish − first submit).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench.stats import percentile
from clients.client import LoraplaneClient
from clients.results import FinishedEvent, TokenEvent


@dataclass(frozen=True)
class RequestSpec:
    prompt: list[int]
    adapters: dict[int, float]  # {} = explicitly no adapters
    max_tokens: int
    seed: int


@dataclass
class RequestResult:
    t_submit: float
    t_first: float | None = None
    t_done: float | None = None
    token_times: list[float] = field(default_factory=list)
    n_tokens: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    telemetry: dict = field(default_factory=dict)
    error: str | None = None


# A driver runs one request and fills in its result (token times, telemetry).
Driver = Callable[[RequestSpec, RequestResult], None]


def loraplane_driver(client: LoraplaneClient) -> Driver:
    """Requests through the control plane's ``Generate`` (greedy, ``ignore_eos``)."""

    def run(spec: RequestSpec, res: RequestResult) -> None:
        for ev in client.generate_stream(
            prompt_tokens=spec.prompt,
            adapters=spec.adapters,
            max_tokens=spec.max_tokens,
            temperature=0.0,
            seed=spec.seed,
            ignore_eos=True,
        ):
            now = time.perf_counter()
            if isinstance(ev, TokenEvent):
                if res.t_first is None:
                    res.t_first = now
                res.token_times.append(now)
                res.n_tokens += 1
                res.batch_sizes.append(int(ev.step.get("batch_size", 0)))
            elif isinstance(ev, FinishedEvent):
                res.telemetry = dict(ev.telemetry)

    return run


def llama_server_driver(server) -> Driver:
    """Requests to llama-server's ``/completion`` (streamed, same sampling)."""

    def run(spec: RequestSpec, res: RequestResult) -> None:
        for kind, payload in server.stream(
            spec.prompt, adapters=spec.adapters, max_tokens=spec.max_tokens, seed=spec.seed
        ):
            now = time.perf_counter()
            if kind == "token":
                if res.t_first is None:
                    res.t_first = now
                res.token_times.append(now)
                res.n_tokens += payload
            else:
                timings = payload.get("timings") or {}
                res.telemetry = {
                    "prompt_n": timings.get("prompt_n"),
                    "cache_n": timings.get("cache_n"),
                    "tokens_cached": payload.get("tokens_cached"),
                    "predicted_n": timings.get("predicted_n"),
                    "predicted_per_token_ms": timings.get("predicted_per_token_ms"),
                }
                if timings.get("predicted_n"):
                    res.n_tokens = int(timings["predicted_n"])

    return run


def run_closed_loop(
    driver: Driver, specs: Sequence[RequestSpec], concurrency: int
) -> tuple[list[RequestResult], float]:
    """Run ``specs`` with ``concurrency`` closed-loop streams; returns results (spec order)
    and the wall time from the first submit to the last finish."""
    results: list[RequestResult | None] = [None] * len(specs)
    lock = threading.Lock()
    next_index = [0]

    def take() -> int | None:
        with lock:
            i = next_index[0]
            if i >= len(specs):
                return None
            next_index[0] = i + 1
            return i

    def stream() -> None:
        while (i := take()) is not None:
            res = RequestResult(t_submit=time.perf_counter())
            results[i] = res
            try:
                driver(specs[i], res)
            except Exception as exc:  # noqa: BLE001 - recorded, reported, never hidden
                res.error = f"{type(exc).__name__}: {exc}"
            res.t_done = time.perf_counter()

    threads = [
        threading.Thread(target=stream, name=f"bench-stream-{j}", daemon=True)
        for j in range(min(concurrency, len(specs)))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [r for r in results if r is not None]
    t0 = min(r.t_submit for r in done)
    t1 = max(r.t_done or r.t_submit for r in done)
    return done, t1 - t0


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict:
    """One run's figures: throughput, TTFT and ITL percentiles (ms), errors."""
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    ttft = [(r.t_first - r.t_submit) * 1e3 for r in ok if r.t_first is not None]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    tokens = sum(r.n_tokens for r in ok)
    batches = [b for r in ok for b in r.batch_sizes if b]
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": errors[:5],
        "n_errors": len(errors),
        "tokens": tokens,
        "wall_s": wall_s,
        "tok_s": tokens / wall_s if wall_s > 0 and ok else math.nan,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "mean_batch": sum(batches) / len(batches) if batches else math.nan,
    }
