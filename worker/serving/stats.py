"""``SchedulerStats``: the scheduler's counters and gauges, a slice of proto ``WorkerStats``
(``worker.rpc.servicer.stats_to_proto``); what the loop timing figures measure:
docs/architecture.md ("The serving loop")."""

from __future__ import annotations

from dataclasses import dataclass

from worker.serving.fairness import TenantService


@dataclass(frozen=True)
class SchedulerStats:
    """Counters and gauges of the scheduler (a slice of proto ``WorkerStats``, field for field:
    the wire's names, so ``n_slots`` / ``slots_busy`` count KV sequences, llama-server's server
    slots; a test holds the names to the proto's)."""

    n_slots: int
    slots_busy: int
    queue_depth: int
    queue_limit: int
    graph_reuses: int
    graph_rebuilds: int
    prefix_cache_entries: int
    prefix_cache_hit_tokens: int
    prompt_tokens_computed: int
    tokens_generated: int
    # loop timing over ``StepRunner.step_log``, ms; 0 before any decode-only step
    step_interval_p50_ms: float = 0.0
    step_busy_p50_ms: float = 0.0
    step_samples: int = 0
    # KV cache cells (token positions) held by busy sequences / all sequences' capacity
    # (sequences x n_ctx_seq): vLLM's kv_cache_usage_perc is their ratio. An idle sequence's
    # kept prompt cache is reusable at once, so it counts as free (vLLM: cached free blocks).
    kv_cells_used: int = 0
    kv_cells_total: int = 0
    # fair admission: "off" or "vtc", and the tenants known (``FairQueue.snapshot``; vtc only)
    fairness: str = "off"
    tenants: tuple[TenantService, ...] = ()
    # the GPU engine's CUDA graphs (``worker.gpu.context``; 0 on the CPU engine), named
    # apart from graph_reuses/graph_rebuilds (the LoRA plan cache of every engine)
    cuda_graphs_captured: int = 0
    cuda_graph_replays: int = 0
    cuda_graph_eager_fallbacks: int = 0


def median(xs: list[float]) -> float:
    """Median of sorted ``xs`` (0.0 when empty)."""
    if not xs:
        return 0.0
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


__all__ = ["SchedulerStats", "median"]
