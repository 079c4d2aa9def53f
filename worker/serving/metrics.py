"""Prometheus metrics of one worker (``/metrics`` on ``--metrics-addr``), prefixed `PREFIX`.

`WorkerMetrics` observes request outcomes, token counts and latencies as they happen: the
scheduler's output thread calls `WorkerMetrics.on_token` / `on_finish` (its ``observer`` hook)
and the engine calls `on_rejected` / `on_adapter_loaded` / `on_adapter_freed`. Everything the
scheduler already counts (slots, queue, plan reuse, prefix-cache hits, KV usage, residency,
paging) is read from ``WorkerEngine.stats()`` at scrape time by `_StatsCollector`, so there is
one count, not two. ``adapter`` labels are bounded by ``loraplane.metrics.BoundedLabels``.

Every series and what it counts: docs/operations.md, "Health, logs, metrics".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loraplane.metrics import LATENCY_BUCKETS_S, NO_ADAPTER_LABEL, BoundedLabels, kv_usage
from worker.serving.request import GenRequest

PREFIX = "loraplane_worker_"


class WorkerMetrics:
    """The worker's metric objects in their own registry (one per engine: tests run several
    engines in one process)."""

    def __init__(
        self,
        stats: Callable[[], Any],
        *,
        adapter_label_cap: int,
        registry: CollectorRegistry | None = None,
        adapter_paging: Callable[[], dict[int, tuple[int, int]]] | None = None,
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.labels = BoundedLabels(adapter_label_cap)
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests", "Requests by outcome and adapter.", ["outcome", "adapter"], registry=r
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", ["adapter"], registry=r
        )
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", ["adapter"], registry=r)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Admission to first token.", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive tokens.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Admission to last token.", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.adapter_loads = Counter(
            PREFIX + "adapter_loads",
            "Adapters validated into the host tier (eager, from a local file, or fetched from the control plane); "
            "page-ins into device slots are the worker's page_ins stat.",
            registry=r,
        )
        self.adapter_evictions = Counter(PREFIX + "adapter_evictions", "Adapters freed.", registry=r)
        r.register(_StatsCollector(stats, self.labels, adapter_paging or dict))

    def adapter_labels(self, ids: tuple[int, ...]) -> list[str]:
        return [self.labels(str(i)) for i in ids] or [NO_ADAPTER_LABEL]

    # -- scheduler observer ------------------------------------------------------------
    def on_token(self, req: GenRequest, now: float) -> None:
        if req.last_token_at is not None:
            self.itl.observe(now - req.last_token_at)

    def on_finish(self, req: GenRequest, outcome: str) -> None:
        for label in self.adapter_labels(req.adapter_ids):
            self.requests.labels(outcome, label).inc()
            self.prompt_tokens.labels(label).inc(len(req.prompt))
            self.generation_tokens.labels(label).inc(len(req.generated))
        if req.first_token_at is not None:
            self.ttft.observe(req.first_token_at - req.admitted_at)
            self.e2e.observe((req.last_token_at or req.first_token_at) - req.admitted_at)

    # -- engine hooks --------------------------------------------------------------------
    def on_rejected(self, adapter_ids: tuple[int, ...]) -> None:
        for label in self.adapter_labels(adapter_ids):
            self.requests.labels("rejected", label).inc()

    def on_adapter_loaded(self) -> None:
        self.adapter_loads.inc()

    def on_adapter_freed(self) -> None:
        self.adapter_evictions.inc()


class _StatsCollector:
    """Scrape-time view of ``WorkerEngine.stats()`` (a ``WorkerStatsRecord``) and of the
    engine's per-adapter paging counters."""

    def __init__(
        self, stats: Callable[[], Any], labels: BoundedLabels, paging: Callable[[], dict[int, tuple[int, int]]]
    ) -> None:
        self._stats = stats
        self._labels = labels
        self._paging = paging

    def collect(self):
        record = self._stats()
        s = record.scheduler
        gauges = {
            "slots": ("Parallel KV sequences (--slots).", s.n_slots),
            "slots_busy": ("KV sequences serving a request.", s.slots_busy),
            "requests_running": ("Requests on a KV sequence (prefill or decode).", s.slots_busy),
            "requests_waiting": ("Requests queued for a KV sequence.", s.queue_depth),
            "queue_limit": ("Waiting requests allowed before RESOURCE_EXHAUSTED.", s.queue_limit),
            "adapters_loaded": ("Adapters registered on this worker.", len(record.adapter_ids)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        counters = {
            "graph_reuses": ("Decode steps whose cached LoRA plan was reused.", s.graph_reuses),
            "graph_rebuilds": ("Decode steps that rebuilt the LoRA plan.", s.graph_rebuilds),
            "prefix_cache_hit_tokens": ("Prompt tokens served from the prefix cache.", s.prefix_cache_hit_tokens),
            "prompt_tokens_computed": ("Prompt rows computed (cache misses).", s.prompt_tokens_computed),
            "cuda_graphs_captured": (
                "CUDA graphs captured (GPU engine: one per decode batch bucket).",
                s.cuda_graphs_captured,
            ),
            "cuda_graph_replays": ("Decode steps served by replaying a CUDA graph.", s.cuda_graph_replays),
            "cuda_graph_eager_fallbacks": (
                "GPU engine steps run without a graph (prompts, mixed ubatches, MoE, side branches).",
                s.cuda_graph_eager_fallbacks,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        usage = kv_usage(s.kv_cells_used, s.kv_cells_total)
        yield GaugeMetricFamily(
            PREFIX + "kv_cache_usage_perc", "KV cache cells held by running requests / all cells (0-1).", value=usage
        )
        yield GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", value=usage)
        resident = set(record.resident_adapter_ids)
        states = {
            "device": resident,
            "host": set(record.host_adapter_ids) - resident,
            "pinned": set(record.pinned_adapter_ids),
        }
        residency = GaugeMetricFamily(
            PREFIX + "adapter_residency",
            "Adapters this worker holds, by state: device (in a slot), host (host tier only), pinned (in a slot).",
            labels=["adapter", "state"],
        )
        for state, ids in states.items():
            for label, n in _fold(self._labels, {i: 1 for i in ids}).items():
                residency.add_metric([label, state], n)
        yield residency
        paging = self._paging()
        for name, doc, k in (
            ("adapter_slot_page_ins", "Page-ins of an adapter into a device slot.", 0),
            ("adapter_slot_evictions", "LRU evictions of an adapter out of a device slot.", 1),
        ):
            fam = CounterMetricFamily(PREFIX + name, doc, labels=["adapter"])
            for label, n in _fold(self._labels, {i: v[k] for i, v in paging.items()}).items():
                fam.add_metric([label], n)
            yield fam


def _fold(labels: BoundedLabels, values: dict[int, int]) -> dict[str, int]:
    """Per-adapter-id values → per-label values, the ids past the label cap summed under
    "other" (``loraplane.metrics.BoundedLabels``), in id order."""
    out: dict[str, int] = {}
    for i in sorted(values):
        label = labels(str(i))
        out[label] = out.get(label, 0) + values[i]
    return out
