"""Scenarios 7 (long prompts) and 8 (long-context decode), ours beside llama-server.

`run_long` starts one pair of servers for both scenarios and alternates them run by run:
``longprompt`` (`longprompt_specs`: closed-loop streams of distinct long prompts, no prefix
shared, at each K of adapters; output and prompt tokens/s, TTFT, ITL, prompt tokens each server
computed) and ``longctx`` (`longctx_specs`: one stream, long then short contexts; ITL at each
and their ratio).

Workloads, figures and server settings: ``bench/README.md`` (scenarios 7 and 8, "Details per
tool").
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from bench.engine import random_tokens
from bench.load import Driver, RequestSpec, llama_server_driver, loraplane_driver, run_closed_loop, summarize
from bench.servers import LlamaServer, LoraplaneServers, start_all
from bench.serving import ServingContext, _mapped, _register, wl_key, zipf_choices
from bench.stats import Figure, ratio

OURS, PEER = "ours", "llama-server"
PREFILL_TOK_S = 600  # prefill rate of Gemma 3 270M on 2 quiet cores (RESULTS.md), for the time estimate only
LONG_FIGURES = ("tok_s", "prompt_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "computed")
CTX_FIGURES = ("itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "tok_s")


def longprompt_workloads(ks) -> list[tuple[int, str]]:
    """``(K, distribution)``: K = 0 is the base model, K > 0 Zipf(1.0) over K adapters."""
    return [(k, "base" if k == 0 else "zipf") for k in ks]


def longprompt_specs(sc: ServingContext, k: int, rep: int, *, n: int | None = None) -> list[RequestSpec]:
    """One run's requests: ``n`` (default ``longprompt_requests``) distinct prompts of
    ``longprompt_tokens`` ids (BOS first where the model adds one), adapters by index 0..K-1."""
    p = sc.profile
    n = p.longprompt_requests if n is None else n
    rng = np.random.default_rng((sc.seed, 7, k, rep + 1000))
    picks = zipf_choices(rng, k, n) if k else []
    return [
        RequestSpec(
            random_tokens(rng, p.longprompt_tokens, bos=sc.bos, hi=sc.token_hi),
            {picks[i]: 1.0} if k else {},
            p.longprompt_max_tokens,
            i,
        )
        for i in range(n)
    ]


def longctx_specs(sc: ServingContext, n_tokens: int, rep: int) -> list[RequestSpec]:
    """``longctx_requests`` base-model requests with fresh ``n_tokens``-token prompts."""
    p = sc.profile
    rng = np.random.default_rng((sc.seed, 8, n_tokens, rep + 1000))
    return [
        RequestSpec(random_tokens(rng, n_tokens, bos=sc.bos, hi=sc.token_hi), {}, p.longctx_max_tokens, i)
        for i in range(p.longctx_requests)
    ]


def _run(driver: Driver, specs: list[RequestSpec], streams: int, computed_fn: Callable[[], int] | None) -> dict:
    """One run's figures (``bench.load.summarize``) plus prompt tokens/s and the prompt tokens
    the server computed (ours: worker ``Stats.prompt_tokens_computed`` difference; llama-server:
    Σ ``timings.prompt_n``), and llama-server's median ``predicted_per_token_ms``."""
    before = computed_fn() if computed_fn is not None else 0
    res, wall = run_closed_loop(driver, specs, streams)
    s = summarize(res, wall)
    ok = [(r, sp) for r, sp in zip(res, specs, strict=True) if r.error is None]
    prompt_tokens = sum(len(sp.prompt) for _, sp in ok)
    s["prompt_tokens"] = prompt_tokens
    s["prompt_tok_s"] = prompt_tokens / wall if wall > 0 and ok else math.nan
    if computed_fn is not None:
        s["computed"] = computed_fn() - before
    else:
        s["computed"] = sum(int(r.telemetry.get("prompt_n") or 0) for r, _ in ok)
        per_tok = [
            float(r.telemetry["predicted_per_token_ms"])
            for r, _ in ok
            if r.telemetry.get("predicted_per_token_ms") is not None
        ]
        s["per_token_ms"] = float(np.median(per_tok)) if per_tok else math.nan
    return s


def _aggregate(runs: list[dict], figures: tuple[str, ...]) -> dict:
    out: dict[str, object] = {f: Figure.of([r[f] for r in runs]).to_json() for f in figures}
    if runs and "per_token_ms" in runs[0]:
        out["per_token_ms"] = Figure.of([r["per_token_ms"] for r in runs], "ms").to_json()
    out["requests"] = runs[0]["requests"] if runs else 0
    out["ok"] = sum(r["ok"] for r in runs)
    out["runs"] = len(runs)
    out["n_errors"] = sum(r["n_errors"] for r in runs)
    out["errors"] = [e for r in runs for e in r["errors"]][:5]
    return out


def _log_run(sc: ServingContext, what: str, who: str, s: dict) -> None:
    sc.log(
        f"{what} {who}: {s['tok_s']:.1f} out tok/s, {s['prompt_tok_s']:.0f} prompt tok/s, "
        f"TTFT p50 {s['ttft_p50_ms']:.0f} ms, ITL p50 {s['itl_p50_ms']:.1f} ms, computed {s['computed']} of "
        f"{s['prompt_tokens']} prompt tokens" + (f", {s['n_errors']} errors" if s["n_errors"] else "")
    )


def run_long(sc: ServingContext, selected: list[str]) -> dict[str, dict | BaseException]:
    """Scenarios 7 and 8 (whichever of ``longprompt`` / ``longctx`` is in ``selected``) on one
    pair of servers. Returns ``{name: results}``; a scenario that failed after the servers
    started holds its exception instead (the other's results survive it)."""
    p = sc.profile
    want_prompt, want_ctx = "longprompt" in selected, "longctx" in selected
    max_k = max(p.longprompt_ks) if want_prompt else 0
    paths = sc.factory.paths(max_k) if max_k else []
    need = max(
        p.longprompt_tokens + p.longprompt_max_tokens if want_prompt else 0,
        p.longctx_tokens + p.longctx_max_tokens if want_ctx else 0,
    )
    n_ctx = need + 64
    ours = LoraplaneServers(
        sc.run_dir,
        "long",
        slots=p.longprompt_streams,
        batching="mixed",
        prefix_cache="keyed",
        dtype=sc.dtype,
        device=sc.device,
        n_ctx=n_ctx,
        model_path=sc.model_path,
        weights=sc.weights,
    )
    peer = (
        LlamaServer(
            sc.llama_server,
            sc.run_dir,
            "llama-server-long",
            model=sc.model_path,
            adapters=paths,
            parallel=p.longprompt_streams,
            n_ctx=n_ctx,
        )
        if sc.llama_server
        else None
    )
    sc.log(
        f"long: starting control plane + worker ({p.longprompt_streams} slots, --n-ctx {n_ctx})"
        + (f" and llama-server (--parallel {p.longprompt_streams}, -c {p.longprompt_streams * n_ctx})" if peer else "")
    )
    n_prompt = (p.longprompt_tokens * p.longprompt_requests * len(p.longprompt_ks) if want_prompt else 0) + (
        (p.longctx_tokens + p.longctx_short) * p.longctx_requests if want_ctx else 0
    )
    sc.log(
        f"long: {n_prompt * p.reps:,} prompt tokens per server over {p.reps} repetition(s); at ~{PREFILL_TOK_S} "
        f"prompt tok/s (2 quiet cores) about {n_prompt * p.reps / PREFILL_TOK_S / 60:.1f} min of prefill per server"
    )
    start_all([ours])
    out: dict[str, dict | BaseException] = {}
    try:
        if peer is not None:
            peer.start()
        ids = _register(ours, paths)
        drivers: dict[str, Driver] = {OURS: _mapped(loraplane_driver(ours.client), ids)}
        computed: dict[str, Callable[[], int] | None] = {OURS: lambda: ours.stats().prompt_tokens_computed}
        if peer is not None:
            drivers[PEER] = llama_server_driver(peer)
            computed[PEER] = None
        # warm-up, excluded: one prompt at the longest length (big-ubatch plans, allocator) and
        # one short request per stream (and per adapter), on fresh prompts (repetition -1)
        warm_len = max(p.longprompt_tokens if want_prompt else 0, p.longctx_tokens if want_ctx else 0)
        warm_long = RequestSpec(
            random_tokens(np.random.default_rng((sc.seed, 9)), warm_len, bos=sc.bos, hi=sc.token_hi), {}, 2, 0
        )
        warm = [RequestSpec(s.prompt[:32], s.adapters, 2, s.seed) for s in longprompt_specs(sc, max_k, -1)]
        for who, drv in drivers.items():
            sc.log(f"long: warm-up {who}")
            run_closed_loop(drv, [warm_long], 1)
            run_closed_loop(drv, warm, p.longprompt_streams)
        if want_prompt:
            try:
                out["longprompt"] = _longprompt(sc, drivers, computed, peer)
            except Exception as exc:  # noqa: BLE001 - reported under "longprompt"
                out["longprompt"] = exc
        if want_ctx:
            try:
                out["longctx"] = _longctx(sc, drivers, computed, peer)
            except Exception as exc:  # noqa: BLE001 - reported under "longctx"
                out["longctx"] = exc
    finally:
        ours.stop()
        if peer is not None:
            peer.stop()
    return out


def _longprompt(sc: ServingContext, drivers: dict[str, Driver], computed, peer: LlamaServer | None) -> dict:
    p = sc.profile
    wls = longprompt_workloads(p.longprompt_ks)
    runs: dict[str, dict[str, list[dict]]] = {who: {wl_key(*w): [] for w in wls} for who in drivers}
    for rep in range(p.reps):
        for k, dist in wls:
            specs = longprompt_specs(sc, k, rep)
            for who, drv in drivers.items():
                s = _run(drv, specs, p.longprompt_streams, computed[who])
                runs[who][wl_key(k, dist)].append(s)
                _log_run(sc, f"longprompt: rep {rep + 1}/{p.reps} {wl_key(k, dist)}", who, s)
    out: dict = {
        "prompt_tokens": p.longprompt_tokens,
        "max_tokens": p.longprompt_max_tokens,
        "streams": p.longprompt_streams,
        "slots": p.longprompt_streams,
        "requests": p.longprompt_requests,
        "reps": p.reps,
        "ks": list(p.longprompt_ks),
        "prefix_cache": "keyed",
        "workloads": [wl_key(*w) for w in wls],
        "servers": {who: {key: _aggregate(v, LONG_FIGURES) for key, v in r.items()} for who, r in runs.items()},
        "llama_server": peer.binary if peer is not None else None,
    }
    if peer is not None:
        sv = out["servers"]
        out["ours_over_llama_server"] = {
            key: {
                f: ratio(sv[OURS][key][f]["median"], sv[PEER][key][f]["median"])
                for f in ("tok_s", "prompt_tok_s", "ttft_p50_ms", "itl_p50_ms")
            }
            for key in out["workloads"]
        }
    return out


def _longctx(sc: ServingContext, drivers: dict[str, Driver], computed, peer: LlamaServer | None) -> dict:
    p = sc.profile
    lengths = {"long": p.longctx_tokens, "short": p.longctx_short}
    runs: dict[str, dict[str, list[dict]]] = {who: {name: [] for name in lengths} for who in drivers}
    for rep in range(p.reps):
        for name, n in lengths.items():
            specs = longctx_specs(sc, n, rep)
            for who, drv in drivers.items():
                s = _run(drv, specs, 1, computed[who])
                runs[who][name].append(s)
                _log_run(sc, f"longctx: rep {rep + 1}/{p.reps} {n}-token context", who, s)
    servers = {who: {name: _aggregate(v, CTX_FIGURES) for name, v in r.items()} for who, r in runs.items()}

    def med(who: str, name: str, f: str = "itl_p50_ms") -> float | None:
        return servers[who][name][f]["median"]

    out: dict = {
        "long_tokens": p.longctx_tokens,
        "short_tokens": p.longctx_short,
        "max_tokens": p.longctx_max_tokens,
        "requests": p.longctx_requests,
        "reps": p.reps,
        "streams": 1,
        "servers": servers,
        "long_over_short": {who: ratio(med(who, "long"), med(who, "short")) for who in servers},
        "llama_server": peer.binary if peer is not None else None,
    }
    if peer is not None:
        out["ours_over_llama_server"] = {name: ratio(med(OURS, name), med(PEER, name)) for name in lengths}
        out["llama_server_per_token_long_over_short"] = ratio(
            med(PEER, "long", "per_token_ms"), med(PEER, "short", "per_token_ms")
        )
    return out
