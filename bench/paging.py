"""Scenario 6: thousands of adapters through the worker's slot pool.

Three control-plane + worker pairs with the same worker flags (``--max-loras``,
``--max-cpu-loras``, mixed batching, keyed prefix cache):

- ``ten``: 10 adapters registered (the memory baseline);
- ``fit``: ``paging_fit`` adapters registered, all fitting in the slots (the speed baseline);
- ``many``: ``paging_adapters`` registered (F16, ranks 8 and 16 alternating, on the attention
  weights only — ``attn_q/k/v/output``), far more than the slots and the host cache.

All serve the same traffic shape: ``paging_streams`` closed-loop streams, Zipf(1.0) adapter
popularity over their own adapters, ``paging_warmup`` requests not timed, then
``paging_requests`` × ``paging_max_tokens`` tokens (greedy, ``ignore_eos``). Figures: output
tok/s and the many/fit ratio (target ≥ 0.8), TTFT p50/p99, page-ins, evictions and fetches per
request (worker ``Stats`` deltas), the first-token latency of requests whose adapter was
fetched (cold) vs resident, worker RSS after the same traffic with 1 000 vs 10 registered
(target ≤ 1.10: the worker's memory depends on its pool, not on registrations; serving itself
grows RSS — the keyed prefix cache fills up to ``--prefix-cache-tokens`` — equally in every
run, which is why the baseline serves the same traffic), control-plane RSS per registration,
and register → first token for an adapter no worker holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.engine import random_tokens, with_bos
from bench.load import RequestSpec, loraplane_driver, run_closed_loop, summarize
from bench.profiles import Profile
from bench.servers import LoraplaneServers
from bench.serving import ServingContext, zipf_choices
from bench.stats import percentile
from bench.synth import ATTENTION_WEIGHT, linear_targets, write_adapter
from clients.results import TokenEvent

RANKS = (8, 16)


class PagingAdapters:
    """Writes (once) ``page-<i>.gguf``: F16, rank ``RANKS[i % 2]``, attention weights."""

    def __init__(self, out_dir: Path, *, arch: str, base_tensors: dict, base_seed: int):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.arch = arch
        self.targets = linear_targets(base_tensors, pattern=ATTENTION_WEIGHT)
        self.base_seed = base_seed

    def path(self, i: int) -> Path:
        p = self.dir / f"page-{i:04d}.gguf"
        if not p.exists():
            tmp = p.with_suffix(".part")
            write_adapter(
                tmp,
                arch=self.arch,
                targets=self.targets,
                seed=self.base_seed + 50_000 + i,
                rank=RANKS[i % len(RANKS)],
                alpha=16.0,
                name=f"page-{i}",
                dtype=np.float16,
            )
            tmp.replace(p)
        return p


def _specs(
    p: Profile, n_adapters: int, ids: list[int], n: int, *, seed: int, bos: int | None, hi: int, salt: int
) -> list[RequestSpec]:
    rng = np.random.default_rng((seed, 6, n_adapters, salt))
    picks = zipf_choices(rng, n_adapters, n)
    return [
        RequestSpec(random_tokens(rng, p.prompt_tokens, bos=bos, hi=hi), {ids[j]: 1.0}, p.paging_max_tokens, i)
        for i, j in enumerate(picks)
    ]


def _register(srv: LoraplaneServers, paths: list[Path], log: Callable[[str], None], label: str) -> list[int]:
    ids = []
    for j, path in enumerate(paths):
        ids.append(srv.client.add_adapter(path).id)
        if (j + 1) % 100 == 0:
            log(f"paging: {label}: {j + 1}/{len(paths)} adapters registered")
    return ids


def _traffic(srv: LoraplaneServers, specs: list[RequestSpec], warm: list[RequestSpec], streams: int) -> dict:
    driver = loraplane_driver(srv.client)
    run_closed_loop(driver, warm, streams)
    st0 = srv.stats()
    results, wall = run_closed_loop(driver, specs, streams)
    st1 = srv.stats()
    out = summarize(results, wall)
    n = max(1, len(specs))
    out["page_ins_per_request"] = (st1.page_ins - st0.page_ins) / n
    out["evictions_per_request"] = (st1.evictions - st0.evictions) / n
    out["fetches_per_request"] = (st1.fetches - st0.fetches) / n
    out["fetch_mib"] = (st1.fetch_bytes - st0.fetch_bytes) / 2**20
    by_source: dict[str, list[float]] = {}
    for r in results:
        if r.error is None and r.t_first is not None:
            srcs = [a.get("source") for a in r.telemetry.get("adapter_residency", [])]
            by_source.setdefault(srcs[0] if srcs else "none", []).append((r.t_first - r.t_submit) * 1e3)
    out["ttft_by_source_ms"] = {
        k: {"n": len(v), "p50": percentile(v, 50), "p99": percentile(v, 99)} for k, v in sorted(by_source.items())
    }
    out["prefix_cache_entries"] = st1.prefix_cache_entries
    out["resident_adapters"] = st1.resident_adapters
    out["host_adapters"] = st1.host_adapters
    out["pool_mib"] = st1.pool_bytes / 2**20
    return out


def run_paging(sc: ServingContext, arch: str, base_tensors: dict, log: Callable[[str], None]) -> dict:
    """Scenario 6 (see the module docstring); ``sc`` is bench.serving's ``ServingContext``."""
    p = sc.profile
    adapters = PagingAdapters(sc.run_dir / "paging-adapters", arch=arch, base_tensors=base_tensors, base_seed=sc.seed)
    n = p.paging_adapters
    log(f"paging: writing {n + 1} synthetic adapters (F16, ranks {RANKS}, attention weights)")
    paths = [adapters.path(i) for i in range(n + 1)]
    disk = sum(q.stat().st_size for q in paths[:n])
    flags = (
        "--max-loras",
        str(p.paging_max_loras),
        "--max-cpu-loras",
        str(p.paging_max_cpu_loras),
        "--max-lora-rank",
        "16",
    )
    out: dict = {
        "adapters": n,
        "fit_adapters": p.paging_fit,
        "disk_mib": disk / 2**20,
        "max_loras": p.paging_max_loras,
        "max_cpu_loras": p.paging_max_cpu_loras,
        "streams": p.paging_streams,
        "requests": p.paging_requests,
        "max_tokens": p.paging_max_tokens,
        "ranks": list(RANKS),
        "prefix_cache": sc.paging_prefix_cache,
    }
    bos = sc.bos
    for label, count in (("ten", min(10, n)), ("fit", p.paging_fit), ("many", n)):
        srv = LoraplaneServers(
            sc.run_dir,
            f"paging-{label}",
            slots=p.paging_streams,
            batching="mixed",
            prefix_cache=sc.paging_prefix_cache,
            dtype=sc.dtype,
            device=sc.device,
            model_path=sc.model_path,
            worker_args=flags,
        )
        log(f"paging: {label}: starting control plane + worker")
        srv.start()
        try:
            srv.wait_ready()
            srv.client.generate(prompt_tokens=with_bos(bos, [1000, 1001]), adapters={}, max_tokens=1, ignore_eos=True)
            cp0 = srv.cp_rss()
            ids = _register(srv, paths[:count], log, label)
            cp1 = srv.cp_rss()
            rss_registered = srv.worker_rss()
            specs = _specs(p, count, ids, p.paging_requests, seed=sc.seed, bos=bos, hi=sc.token_hi, salt=2)
            warm = _specs(p, count, ids, p.paging_warmup, seed=sc.seed, bos=bos, hi=sc.token_hi, salt=3)
            log(f"paging: {label}: {len(specs)} requests × {p.paging_max_tokens} tokens over {count} adapters")
            res = _traffic(srv, specs, warm, p.paging_streams)
            res["registered"] = count
            res["worker_rss_registered_mib"] = rss_registered / 2**20  # before any traffic
            res["worker_rss_mib"] = srv.worker_rss() / 2**20  # after the traffic
            res["worker_rss_anon_mib"] = srv.worker_rss("RssAnon") / 2**20
            res["cp_rss_per_registration_kib"] = (cp1 - cp0) / count / 1024
            if label == "many":
                t0 = time.perf_counter()
                info = srv.client.add_adapter(paths[n])
                t_first = None
                for ev in srv.client.generate_stream(
                    prompt_tokens=with_bos(bos, [1000, 1001]), adapters={info.id: 1.0}, max_tokens=1, ignore_eos=True
                ):
                    if isinstance(ev, TokenEvent) and t_first is None:
                        t_first = time.perf_counter()
                res["register_to_first_token_ms"] = ((t_first or time.perf_counter()) - t0) * 1e3
            out[label] = res
            log(
                f"paging: {label}: {res['tok_s']:.1f} tok/s, TTFT p50 {res['ttft_p50_ms']:.0f} ms, "
                f"page-ins/request {res['page_ins_per_request']:.2f}, fetches/request {res['fetches_per_request']:.2f}"
            )
        finally:
            srv.stop()
    ten, fit, many = out["ten"], out["fit"], out["many"]
    out["tok_s_ratio_many_over_fit"] = many["tok_s"] / fit["tok_s"] if fit["tok_s"] else None
    out["worker_rss_ratio_all_over_10"] = many["worker_rss_mib"] / ten["worker_rss_mib"]
    return out


__all__ = ["PagingAdapters", "run_paging"]
