"""Scenarios 2 (multi-tenant serving) and 3 (prefix reuse), over gRPC on localhost.

`run_multitenant` runs closed-loop streams with K = 0, 1, 4, 16 adapters (round-robin or
Zipf(1.0), `zipf_choices`) on a ``--batching mixed`` and a ``--batching compat`` worker,
alternating repetitions, plus a 1-stream row and the worker's step interval. `run_prefix` sends
requests sharing a system prompt one at a time across more adapters than slots under
``--prefix-cache keyed`` and ``llama``. `ServingContext` holds what both share; with
``$LLAMA_SERVER`` both also run against llama-server.

Workloads and figures: ``bench/README.md`` (scenarios 2 and 3, "Details per tool").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from bench.bounds import STEP_INTERVAL_FIELD
from bench.engine import random_tokens
from bench.load import (
    Driver,
    RequestResult,
    RequestSpec,
    llama_server_driver,
    loraplane_driver,
    run_closed_loop,
    summarize,
)
from bench.profiles import Profile
from bench.servers import LlamaServer, LoraplaneServers, start_all
from bench.stats import Figure, ratio
from bench.synth import AdapterFactory

RUN_FIGURES = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "mean_batch")


@dataclass
class ServingContext:
    """What the serving scenarios share."""

    profile: Profile
    seed: int
    run_dir: Path
    factory: AdapterFactory
    dtype: str
    device: str
    bos: int | None  # None: the model adds no BOS (its prompts start without one)
    token_hi: int  # prompt ids are drawn below this (bench.engine.token_hi)
    model_path: str
    llama_server: str | None
    log: Callable[[str], None]
    weights: str = "packed"
    paging_prefix_cache: str = "keyed"


SINGLE = "1-stream"


def workloads(ks: Sequence[int], single: bool = False) -> list[tuple[int, str]]:
    """``(K, distribution)``: K ≤ 1 has one distribution; larger K both rr and zipf; with
    ``single``, first the 1-stream base row ``(0, "1-stream")``."""
    out = [(0, SINGLE)] if single else []
    for k in ks:
        if k == 0:
            out.append((0, "base"))
        elif k == 1:
            out.append((1, "single"))
        else:
            out += [(k, "rr"), (k, "zipf")]
    return out


def wl_key(k: int, dist: str) -> str:
    return f"K={k} {dist}"


def zipf_choices(rng: np.random.Generator, k: int, n: int, s: float = 1.0) -> list[int]:
    w = 1.0 / np.arange(1, k + 1) ** s
    return [int(i) for i in rng.choice(k, size=n, p=w / w.sum())]


def serving_specs(
    sc: ServingContext, k: int, dist: str, rep: int, *, n: int | None = None, max_tokens: int | None = None
) -> list[RequestSpec]:
    """The request list of one run; adapters are named by index 0..K-1 (mapped per server)."""
    p = sc.profile
    n = (p.single_requests if dist == SINGLE else p.requests) if n is None else n
    code = {"base": 0, "single": 1, "rr": 2, "zipf": 3, SINGLE: 4}[dist]
    rng = np.random.default_rng((sc.seed, 2, k, code, rep + 1000))
    picks = (zipf_choices(rng, k, n) if dist == "zipf" else [i % k for i in range(n)]) if k else []
    specs = []
    for i in range(n):
        prompt = random_tokens(rng, p.prompt_tokens, bos=sc.bos, hi=sc.token_hi)
        adapters = {picks[i]: 1.0} if k else {}
        specs.append(RequestSpec(prompt, adapters, p.max_tokens if max_tokens is None else max_tokens, i))
    return specs


def _mapped(inner: Driver, id_map: list[int]) -> Driver:
    """Wrap a loraplane driver so it takes index-keyed adapter maps (index j → registered id)."""

    def run(spec: RequestSpec, res: RequestResult) -> None:
        inner(
            RequestSpec(spec.prompt, {id_map[j]: s for j, s in spec.adapters.items()}, spec.max_tokens, spec.seed), res
        )

    return run


def streams_of(sc: ServingContext, dist: str) -> int:
    return 1 if dist == SINGLE else sc.profile.streams


def _loop_timing(srv: LoraplaneServers) -> dict:
    """The worker scheduler's loop timing right after a run (``WorkerStats``: medians over its
    last decode-only steps, ``worker.serving.scheduler.STEP_LOG``): the interval between step
    starts and the step itself on the loop thread, in ms."""
    st = srv.stats()
    return {
        "sched_interval_p50_ms": st.step_interval_p50_ms,
        "sched_busy_p50_ms": st.step_busy_p50_ms,
        "sched_samples": st.step_samples,
    }


def _aggregate(runs: list[dict]) -> dict:
    out: dict[str, object] = {f: Figure.of([r[f] for r in runs]).to_json() for f in RUN_FIGURES}
    for f in ("sched_interval_p50_ms", "sched_busy_p50_ms"):
        if runs and f in runs[0]:
            out[f] = Figure.of([r[f] for r in runs], "ms").to_json()
    if runs and "per_token_ms" in runs[0]:
        out["per_token_ms"] = Figure.of([r["per_token_ms"] for r in runs], "ms").to_json()
    out["n_errors"] = sum(r["n_errors"] for r in runs)
    out["errors"] = [e for r in runs for e in r["errors"]][:5]
    out["requests"] = runs[0]["requests"] if runs else 0
    out["tokens"] = runs[0]["tokens"] if runs else 0
    return out


def _register(srv: LoraplaneServers, paths: list[Path]) -> list[int]:
    return [srv.client.add_adapter(p).id for p in paths]


def run_multitenant(
    sc: ServingContext, keep_for_lifecycle: Callable[[LoraplaneServers], object] | None = None
) -> tuple[dict, object]:
    """Scenario 2 (and, through ``keep_for_lifecycle``, scenario 4 on the mixed worker
    before it stops). Returns ``(scenario 2 results, what keep_for_lifecycle returned)``."""
    p = sc.profile
    wls = workloads(p.ks, single=p.single_requests > 0)
    max_k = max(p.ks)
    paths = sc.factory.paths(max_k)
    modes = ("mixed", "compat")
    servers = {
        m: LoraplaneServers(
            sc.run_dir,
            f"serving-{m}",
            slots=p.slots,
            batching=m,
            prefix_cache="keyed",
            dtype=sc.dtype,
            device=sc.device,
            n_ctx=p.prompt_tokens + p.max_tokens + 64,
            model_path=sc.model_path,
            weights=sc.weights,
        )
        for m in modes
    }
    sc.log(
        f"serving: starting control plane + worker for {', '.join(modes)} ({p.slots} slots each, weights {sc.weights})"
    )
    start_all(list(servers.values()))
    runs: dict[str, dict[str, list[dict]]] = {
        m: {wl_key(*w): [] for w in wls if m == "mixed" or w[1] != SINGLE} for m in modes
    }
    lifecycle = None
    rss: dict[str, dict[str, int]] = {
        m: {"loaded": srv.worker_rss(), "loaded_anon": srv.worker_rss("RssAnon")} for m, srv in servers.items()
    }
    try:
        ids = {m: _register(srv, paths) for m, srv in servers.items()}
        drivers = {m: _mapped(loraplane_driver(srv.client), ids[m]) for m, srv in servers.items()}
        warm = (
            serving_specs(sc, max_k, "rr", -1, n=max(max_k, p.streams), max_tokens=2)
            if max_k
            else serving_specs(sc, 0, "base", -1, n=p.streams, max_tokens=2)
        )
        for m in modes:  # warm-up, excluded
            run_closed_loop(drivers[m], warm, p.streams)
        for rep in range(p.reps):
            for k, dist in wls:
                specs = serving_specs(sc, k, dist, rep)
                for m in modes:
                    if wl_key(k, dist) not in runs[m]:
                        continue
                    res, wall = run_closed_loop(drivers[m], specs, streams_of(sc, dist))
                    s = summarize(res, wall)
                    s.update(_loop_timing(servers[m]))
                    runs[m][wl_key(k, dist)].append(s)
                    sc.log(
                        f"serving: rep {rep + 1}/{p.reps} {wl_key(k, dist)} {m}: {s['tok_s']:.1f} tok/s, "
                        f"TTFT p50 {s['ttft_p50_ms']:.0f} ms, ITL p50 {s['itl_p50_ms']:.0f} ms, "
                        f"mean batch {s['mean_batch']:.1f}, scheduler step interval p50 "
                        f"{s['sched_interval_p50_ms']:.0f} ms (step {s['sched_busy_p50_ms']:.0f} ms)"
                        + (f", {s['n_errors']} errors" if s["n_errors"] else "")
                    )
        worker_stats = {m: _stats_json(srv) for m, srv in servers.items()}
        for m, srv in servers.items():
            rss[m]["after_runs"] = srv.worker_rss()
        if keep_for_lifecycle is not None:
            lifecycle = keep_for_lifecycle(servers["mixed"])
    finally:
        for srv in servers.values():
            srv.stop()
    out: dict = {
        "streams": p.streams,
        "slots": p.slots,
        "requests": p.requests,
        "max_tokens": p.max_tokens,
        "prompt_tokens": p.prompt_tokens,
        "ks": list(p.ks),
        "prefix_cache": "keyed",
        "workloads": [wl_key(*w) for w in wls],
        "modes": {m: {key: _aggregate(v) for key, v in runs[m].items()} for m in modes},
        "single_requests": p.single_requests,
        "single_key": wl_key(0, SINGLE) if p.single_requests else None,
        "worker_stats": worker_stats,
        "worker_rss": rss,
        "weights": sc.weights,
        "adapter_rank": sc.factory.rank,
    }
    out["mixed_over_compat"] = {
        key: ratio(out["modes"]["mixed"][key]["tok_s"]["median"], out["modes"]["compat"][key]["tok_s"]["median"])
        for key in out["workloads"]
        if key in out["modes"]["compat"]
    }
    if sc.llama_server:
        out["llama_server"] = _peer_multitenant(sc, sc.llama_server, wls, paths)
        out["ours_over_llama_server"] = {
            key: ratio(
                out["modes"]["mixed"][key]["tok_s"]["median"], out["llama_server"]["runs"][key]["tok_s"]["median"]
            )
            for key in out["workloads"]
        }
    return out, lifecycle


def _stats_json(srv: LoraplaneServers) -> dict:
    st = srv.stats()
    return {
        "graph_reuses": st.graph_reuses,
        "graph_rebuilds": st.graph_rebuilds,
        "prompt_tokens_computed": st.prompt_tokens_computed,
        "tokens_generated": st.tokens_generated,
        "prefix_cache_hit_tokens": st.prefix_cache_hit_tokens,
        "adapter_bytes": st.adapter_bytes,
        # the scheduler's step interval p50 (bench.bounds.STEP_INTERVAL_FIELD) for the bounds table
        **{f: getattr(st, f) for f in (STEP_INTERVAL_FIELD,) if f in st.DESCRIPTOR.fields_by_name},
    }


def _peer_multitenant(sc: ServingContext, binary: str, wls: list[tuple[int, str]], paths: list[Path]) -> dict:
    p = sc.profile
    srv = LlamaServer(
        binary,
        sc.run_dir,
        "llama-server-serving",
        model=sc.model_path,
        adapters=paths,
        parallel=p.slots,
        n_ctx=p.prompt_tokens + p.max_tokens + 64,
    )
    sc.log(f"serving: starting llama-server ({srv.binary}, --parallel {p.slots}, {len(paths)} adapters)")
    srv.start()
    runs: dict[str, list[dict]] = {wl_key(*w): [] for w in wls}
    try:
        driver = llama_server_driver(srv)
        max_k = max(p.ks)
        warm = (
            serving_specs(sc, max_k, "rr", -1, n=max(max_k, p.streams), max_tokens=2)
            if max_k
            else serving_specs(sc, 0, "base", -1, n=p.streams, max_tokens=2)
        )
        run_closed_loop(driver, warm, p.streams)
        for rep in range(p.reps):
            for k, dist in wls:
                res, wall = run_closed_loop(driver, serving_specs(sc, k, dist, rep), streams_of(sc, dist))
                s = summarize(res, wall)
                per_tok = [
                    float(r.telemetry["predicted_per_token_ms"])
                    for r in res
                    if r.error is None and r.telemetry.get("predicted_per_token_ms") is not None
                ]
                s["per_token_ms"] = float(np.median(per_tok)) if per_tok else math.nan
                runs[wl_key(k, dist)].append(s)
                sc.log(
                    f"serving: rep {rep + 1}/{p.reps} {wl_key(k, dist)} llama-server: {s['tok_s']:.1f} tok/s, "
                    f"TTFT p50 {s['ttft_p50_ms']:.0f} ms" + (f", {s['n_errors']} errors" if s["n_errors"] else "")
                )
    finally:
        srv.stop()
    return {"binary": binary, "parallel": p.slots, "runs": {k: _aggregate(v) for k, v in runs.items()}}


# --- scenario 3 ---------------------------------------------------------------------------


def prefix_specs(sc: ServingContext, rep: int) -> list[RequestSpec]:
    p = sc.profile
    rng = np.random.default_rng((sc.seed, 3, rep + 1000))
    system = random_tokens(rng, p.prefix_len, bos=sc.bos, hi=sc.token_hi)
    return [
        RequestSpec(
            system + random_tokens(rng, p.prefix_user_tokens, hi=sc.token_hi),
            {i % p.prefix_adapters: 1.0},
            p.prefix_max_tokens,
            i,
        )
        for i in range(p.prefix_requests)
    ]


def _prompt_tokens_computed(srv: LoraplaneServers) -> int:
    return srv.stats().prompt_tokens_computed


def _prefix_run(driver: Driver, specs: list[RequestSpec], computed_fn: Callable[[], int] | None) -> dict:
    """One prefix run; ``computed_fn`` reads our worker's prompt-token counter (None: llama-server,
    whose per-request timings say what it computed)."""
    computed_before = computed_fn() if computed_fn is not None else 0
    res, wall = run_closed_loop(driver, specs, 1)
    s = summarize(res, wall)
    ok = [r for r in res if r.error is None]
    ttft = [(r.t_first - r.t_submit) * 1e3 for r in ok if r.t_first is not None]
    s["ttft_mean_ms"] = sum(ttft) / len(ttft) if ttft else math.nan
    s["prompt_tokens"] = sum(len(sp.prompt) for sp in specs)
    if computed_fn is not None:  # ours: worker Stats, cross-checked with telemetry
        s["computed"] = computed_fn() - computed_before
        s["cached"] = sum(int(r.telemetry.get("cached_prompt_tokens", 0)) for r in ok)
        s["cache_cleared"] = sum(1 for r in ok if r.telemetry.get("cache_cleared"))
    else:  # llama-server: per-request timings
        s["computed"] = sum(int(r.telemetry.get("prompt_n") or 0) for r in ok)
        s["cached"] = sum(int(r.telemetry.get("cache_n") or 0) for r in ok)
        s["cache_cleared"] = math.nan
    return s


PREFIX_FIGURES = ("computed", "cached", "ttft_p50_ms", "ttft_mean_ms")


def run_prefix(sc: ServingContext) -> dict:
    """Scenario 3. Returns JSON-ready results."""
    p = sc.profile
    paths = sc.factory.paths(p.prefix_adapters)
    policies = ("keyed", "llama")
    servers = {
        pol: LoraplaneServers(
            sc.run_dir,
            f"prefix-{pol}",
            slots=p.prefix_slots,
            batching="mixed",
            prefix_cache=pol,
            dtype=sc.dtype,
            device=sc.device,
            n_ctx=p.prefix_len + p.prefix_user_tokens + p.prefix_max_tokens + 64,
            model_path=sc.model_path,
            weights=sc.weights,
        )
        for pol in policies
    }
    sc.log(
        f"prefix: starting control plane + worker for --prefix-cache {' and '.join(policies)} "
        f"({p.prefix_slots} slots each)"
    )
    start_all(list(servers.values()))
    runs: dict[str, list[dict]] = {pol: [] for pol in policies}
    try:
        ids = {pol: _register(srv, paths) for pol, srv in servers.items()}
        drivers = {pol: _mapped(loraplane_driver(srv.client), ids[pol]) for pol, srv in servers.items()}
        warm = prefix_specs(sc, -1)[: p.prefix_adapters]
        for pol in policies:  # warm-up, excluded (another system prompt)
            run_closed_loop(drivers[pol], [RequestSpec(w.prompt, w.adapters, 2, w.seed) for w in warm], 1)
        for rep in range(p.reps):
            specs = prefix_specs(sc, rep)
            for pol in policies:
                s = _prefix_run(drivers[pol], specs, partial(_prompt_tokens_computed, servers[pol]))
                runs[pol].append(s)
                sc.log(
                    f"prefix: rep {rep + 1}/{p.reps} {pol}: computed {s['computed']} of {s['prompt_tokens']} "
                    f"prompt tokens, TTFT p50 {s['ttft_p50_ms']:.0f} ms"
                )
    finally:
        for srv in servers.values():
            srv.stop()
    out: dict = {
        "prefix_len": p.prefix_len,
        "user_tokens": p.prefix_user_tokens,
        "requests": p.prefix_requests,
        "adapters": p.prefix_adapters,
        "slots": p.prefix_slots,
        "max_tokens": p.prefix_max_tokens,
        "prompt_tokens": runs["keyed"][0]["prompt_tokens"] if runs["keyed"] else 0,
        "policies": {pol: _prefix_aggregate(v) for pol, v in runs.items()},
    }
    out["llama_over_keyed"] = {
        f: ratio(out["policies"]["llama"][f]["median"], out["policies"]["keyed"][f]["median"])
        for f in ("computed", "ttft_p50_ms", "ttft_mean_ms")
    }
    if sc.llama_server:
        out["llama_server"] = _peer_prefix(sc, sc.llama_server, paths)
        peer = out["llama_server"]["figures"]
        out["llama_server_over_keyed"] = {
            f: ratio(peer[f]["median"], out["policies"]["keyed"][f]["median"])
            for f in ("computed", "ttft_p50_ms", "ttft_mean_ms")
        }
    return out


def _prefix_aggregate(runs: list[dict]) -> dict:
    out: dict[str, object] = {f: Figure.of([r[f] for r in runs]).to_json() for f in PREFIX_FIGURES}
    out["cache_cleared"] = Figure.of([r["cache_cleared"] for r in runs]).to_json()
    out["n_errors"] = sum(r["n_errors"] for r in runs)
    out["errors"] = [e for r in runs for e in r["errors"]][:5]
    return out


def _peer_prefix(sc: ServingContext, binary: str, paths: list[Path]) -> dict:
    p = sc.profile
    srv = LlamaServer(
        binary,
        sc.run_dir,
        "llama-server-prefix",
        model=sc.model_path,
        adapters=paths,
        parallel=p.prefix_slots,
        n_ctx=p.prefix_len + p.prefix_user_tokens + p.prefix_max_tokens + 64,
    )
    sc.log(f"prefix: starting llama-server (--parallel {p.prefix_slots})")
    srv.start()
    runs = []
    try:
        driver = llama_server_driver(srv)
        warm = prefix_specs(sc, -1)[: p.prefix_adapters]
        run_closed_loop(driver, [RequestSpec(w.prompt, w.adapters, 2, w.seed) for w in warm], 1)
        for rep in range(p.reps):
            s = _prefix_run(driver, prefix_specs(sc, rep), None)
            runs.append(s)
            sc.log(
                f"prefix: rep {rep + 1}/{p.reps} llama-server: computed {s['computed']} prompt tokens, "
                f"TTFT p50 {s['ttft_p50_ms']:.0f} ms"
            )
    finally:
        srv.stop()
    return {"binary": binary, "parallel": p.prefix_slots, "figures": _prefix_aggregate(runs)}
