"""Prometheus metrics of the control plane (``/metrics`` on ``--metrics-addr`` and on the HTTP
front).

`ControlPlaneMetrics` counts every Generate, gRPC or HTTP: ``Router.generate`` hands it the
event stream once its adapters are resolved (`ControlPlaneMetrics.track`); the quota book
reports tenant admissions, refusals, tokens and failed syncs; worker heartbeats bring KV usage,
adapter holdings and slot page-in/eviction counts (`ControlPlaneMetrics.on_paging`). Gauges are
computed at scrape time (`_StateCollector`); ``adapter`` and ``tenant`` labels are capped by
``loraplane.metrics.BoundedLabels``.

Every series, its labels and what it counts: docs/operations.md, "Health, logs, metrics" (the
tenant series: docs/tenants.md, "Metrics").
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from control_plane.errors import InvalidArgumentError, NotFoundError
from control_plane.workers import WorkerHoldingsView
from loraplane.adapter_scales import AdapterScales
from loraplane.metrics import LATENCY_BUCKETS_S, NO_ADAPTER_LABEL, OTHER_LABEL, BoundedLabels, kv_usage
from loraplane.v1 import common_pb2
from loraplane.v1.membership_pb2 import AdapterPagingCount

LORA_INFO = "vllm:lora_requests_info"
REJECTED = (InvalidArgumentError, NotFoundError)


@dataclass
class _InFlight:
    names: tuple[str, ...]
    running: bool = False


class ControlPlaneMetrics:
    """Metric objects in their own registry plus the in-flight table behind the gauges.

    Args:
        adapter_name: id → the name ``/v1/models`` serves it under.
        pool_state: ``() -> (live workers, their total slots, their total adapter slots)``.
        n_adapters: ``() -> registered adapters``.
        adapter_label_cap: distinct ``adapter`` label values before "other".
        holdings: ``() -> [WorkerHoldingsView]`` of the alive workers (None: no KV or residency
            gauges).
    """

    def __init__(
        self,
        *,
        adapter_name: Callable[[int], str],
        pool_state: Callable[[], tuple[int, int, int]],
        n_adapters: Callable[[], int],
        adapter_label_cap: int,
        holdings: Callable[[], list[WorkerHoldingsView]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.labels = BoundedLabels(adapter_label_cap)
        self._adapter_name = adapter_name
        self._pool_state = pool_state
        self._n_adapters = n_adapters
        self._holdings = holdings
        self._paging_lock = threading.Lock()
        # worker id → (incarnation, adapter id → (page-ins, evictions) as last reported)
        self._paging_last: dict[str, tuple[str, dict[int, tuple[int, int]]]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._in_flight: dict[int, _InFlight] = {}
        r = self.registry
        self.requests = Counter(
            "loraplane_requests", "Generate requests by outcome and adapter.", ["outcome", "adapter"], registry=r
        )
        self.prompt_tokens = Counter(
            "loraplane_prompt_tokens", "Prompt tokens of finished requests.", ["adapter"], registry=r
        )
        self.cached_tokens = Counter(
            "loraplane_prompt_tokens_cached", "Prompt tokens served from prefix caches.", ["adapter"], registry=r
        )
        self.generation_tokens = Counter("loraplane_generation_tokens", "Generated tokens.", ["adapter"], registry=r)
        self.ttft = Histogram(
            "loraplane_time_to_first_token_seconds", "Admission to first token.", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.itl = Histogram(
            "loraplane_inter_token_latency_seconds",
            "Time between consecutive tokens.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "loraplane_e2e_request_latency_seconds",
            "Admission to the finished event.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.page_ins = Counter(
            "loraplane_adapter_slot_page_ins",
            "Page-ins of an adapter into a worker's device slot (all workers).",
            ["adapter"],
            registry=r,
        )
        self.evictions = Counter(
            "loraplane_adapter_slot_evictions",
            "LRU evictions of an adapter out of a worker's device slot (all workers).",
            ["adapter"],
            registry=r,
        )
        self.tenant_labels = BoundedLabels(adapter_label_cap)
        self.tenant_requests = Counter(
            "loraplane_tenant_requests",
            "Requests by tenant: admitted, or refused by the quota named.",
            ["tenant", "outcome"],
            registry=r,
        )
        self.tenant_token_counts = Counter(
            "loraplane_tenant_tokens", "Tokens of finished requests by tenant.", ["tenant", "kind"], registry=r
        )
        self.tenant_sync_failures = Counter(
            "loraplane_tenant_quota_sync_failures", "Quota syncs with the store that failed.", registry=r
        )
        # the quota book (control_plane.quotas.QuotaBook), for the tenant gauges; None: none
        self.quotas: Any = None
        r.register(_StateCollector(self))

    def exposition(self) -> tuple[bytes, str]:
        """``(text format body, content type)`` for a ``/metrics`` response."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # -- the router hook -----------------------------------------------------------------
    def track(
        self, adapters: AdapterScales, events: Iterator[common_pb2.GenerateEvent], context=None
    ) -> Iterator[common_pb2.GenerateEvent]:
        """Relay ``events`` unchanged, counting the request (see the module docstring).

        ``context`` (the router's client context, optional): when the client goes away the
        request leaves the running/waiting gauges at once and is counted ``cancelled``, even
        while this generator is suspended; a relay that ends without ``finished`` after the
        client left is ``cancelled`` too, not ``error``.
        """
        ids = adapters.ids
        labels = [self.labels(str(i)) for i in ids] or [NO_ADAPTER_LABEL]
        key = next(self._ids)
        entry = _InFlight(tuple(self._adapter_name(i) for i in ids))
        with self._lock:
            self._in_flight[key] = entry
        t0 = time.monotonic()
        last: float | None = None
        counts = {"prompt": 0, "cached": 0, "out": 0}
        done = threading.Lock()
        counted = False

        def count(outcome: str) -> None:
            nonlocal counted
            with done:
                if counted:
                    return
                counted = True
            with self._lock:
                self._in_flight.pop(key, None)
            for label in labels:
                self.requests.labels(outcome, label).inc()
                self.prompt_tokens.labels(label).inc(counts["prompt"])
                self.cached_tokens.labels(label).inc(counts["cached"])
                self.generation_tokens.labels(label).inc(counts["out"])

        finish: list[str] = []  # the finish reason, once the worker sent it

        def client_gone() -> None:
            count(finish[0] if finish else "cancelled")

        if context is not None and not context.add_callback(client_gone):
            client_gone()
        outcome = "error"
        try:
            for ev in events:
                kind = ev.WhichOneof("event")
                now = time.monotonic()
                if kind == "started":
                    entry.running = True
                elif kind == "token":
                    counts["out"] += 1
                    self.ttft.observe(now - t0) if last is None else self.itl.observe(now - last)
                    last = now
                elif kind == "finished":
                    outcome = ev.finished.finish_reason or "stop"
                    finish.append(outcome)
                    counts["prompt"] = ev.finished.telemetry.prompt_tokens
                    counts["cached"] = ev.finished.telemetry.cached_prompt_tokens
                    self.e2e.observe(now - t0)
                yield ev
            if outcome == "error" and context is not None and not context.is_active():
                outcome = "cancelled"  # the router ends a relay quietly when its client left
        except GeneratorExit:
            outcome = finish[0] if finish else "cancelled"
            raise
        except REJECTED:
            outcome = "rejected"
            raise
        except Exception as exc:  # noqa: BLE001 - counted, then re-raised unchanged
            code = getattr(exc, "code", None)
            outcome = "rejected" if getattr(code, "name", "") in ("INVALID_ARGUMENT", "NOT_FOUND") else "error"
            raise
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()  # a client that went away: the router cancels the worker call
            count(outcome)

    # -- the quota book hooks --------------------------------------------------------------
    def tenant_admitted(self, tenant: str) -> None:
        self.tenant_requests.labels(self.tenant_labels(tenant), "admitted").inc()

    def tenant_rejected(self, tenant: str, reason: str) -> None:
        self.tenant_requests.labels(self.tenant_labels(tenant), reason).inc()

    def tenant_tokens(self, tenant: str, prompt: int, output: int) -> None:
        label = self.tenant_labels(tenant)
        self.tenant_token_counts.labels(label, "prompt").inc(prompt)
        self.tenant_token_counts.labels(label, "output").inc(output)

    def tenant_sync_failed(self) -> None:
        self.tenant_sync_failures.inc()

    # -- the worker pool hook -------------------------------------------------------------
    def on_paging(self, worker_id: str, incarnation: str, counts: Sequence[AdapterPagingCount]) -> None:
        """A heartbeat's cumulative per-adapter page-ins / evictions of ``worker_id``'s process
        ``incarnation``: add the increase since its previous heartbeat to the counters (a new
        incarnation, or a count below the last one, starts again from 0). Never blocks long: the
        pool calls it under its lock."""
        with self._paging_lock:
            seen_incarnation, last = self._paging_last.get(worker_id, (incarnation, {}))
            if seen_incarnation != incarnation:
                last = {}
            now = dict(last)
            for c in counts:
                p0, e0 = last.get(c.adapter_id, (0, 0))
                dp = c.page_ins - p0 if c.page_ins >= p0 else c.page_ins
                de = c.evictions - e0 if c.evictions >= e0 else c.evictions
                label = self.labels(str(c.adapter_id))
                if dp:
                    self.page_ins.labels(label).inc(dp)
                if de:
                    self.evictions.labels(label).inc(de)
                now[c.adapter_id] = (c.page_ins, c.evictions)
            self._paging_last[worker_id] = (incarnation, now)

    def holdings(self) -> list[WorkerHoldingsView]:
        return self._holdings() if self._holdings is not None else []

    def in_flight(self) -> tuple[list[_InFlight], list[_InFlight]]:
        """``(running, waiting)`` requests now."""
        with self._lock:
            entries = list(self._in_flight.values())
        return [e for e in entries if e.running], [e for e in entries if not e.running]

    def pool_state(self) -> tuple[int, int, int]:
        return self._pool_state()

    def n_adapters(self) -> int:
        return self._n_adapters()


def _names(entries: list[_InFlight]) -> str:
    """Distinct adapter names in first-seen order, comma-joined (vLLM's label format)."""
    seen: dict[str, None] = {}
    for e in entries:
        for n in e.names:
            seen.setdefault(n, None)
    return ",".join(seen)


class _StateCollector:
    def __init__(self, m: ControlPlaneMetrics) -> None:
        self.m = m

    def collect(self):
        running, waiting = self.m.in_flight()
        live, slots, max_lora = self.m.pool_state()
        for name, doc, value in (
            ("loraplane_requests_running", "Requests streaming tokens.", len(running)),
            ("loraplane_requests_waiting", "Requests routed but not started (queued or in prefill).", len(waiting)),
            ("vllm:num_requests_running", "Number of requests in model execution batches.", len(running)),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(waiting)),
            ("loraplane_workers_live", "Live workers.", live),
            ("loraplane_worker_slots", "Slots over the live workers.", slots),
            ("loraplane_adapters_registered", "Registered adapters.", self.m.n_adapters()),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        info = GaugeMetricFamily(
            LORA_INFO,
            "Running stats on lora requests.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        info.add_metric([str(max_lora), _names(running), _names(waiting)], time.time())
        yield info
        yield from self._holdings()
        yield from self._tenants()

    def _tenants(self):
        """In-flight counts, limits and bucket levels by tenant, and the sync's age."""
        book = self.m.quotas
        in_flight = GaugeMetricFamily(
            "loraplane_tenant_requests_in_flight", "Requests admitted here and not finished.", labels=["tenant"]
        )
        limits = GaugeMetricFamily(
            "loraplane_tenant_limit", "A tenant's limits (0: unlimited).", labels=["tenant", "limit"]
        )
        levels = GaugeMetricFamily(
            "loraplane_tenant_bucket_level",
            "Token / request bucket levels as this replica sees them.",
            labels=["tenant", "bucket"],
        )
        age = -1.0
        if book is not None:
            # a tenant with a row reads 0 when idle (a series that vanishes reads as "no data")
            counts: dict[str, int] = {
                label: 0
                for label in (self.m.tenant_labels(r.name) for r in book.directory.records())
                if label != OTHER_LABEL
            }
            for name, n in book.local_in_flight().items():
                label = self.m.tenant_labels(name)
                counts[label] = counts.get(label, 0) + n
            for label, n in counts.items():
                in_flight.add_metric([label], n)
            for rec in book.directory.records():
                label = self.m.tenant_labels(rec.name)
                if label == OTHER_LABEL:
                    continue  # limits do not add up
                limits.add_metric([label, "max_concurrent"], rec.max_concurrent)
                limits.add_metric([label, "tokens_per_minute"], rec.tokens_per_minute)
                limits.add_metric([label, "requests_per_minute"], rec.requests_per_minute)
                usage = book.usage(rec.name)
                if rec.tokens_per_minute:
                    levels.add_metric([label, "tokens"], usage.tokens_available)
                if rec.requests_per_minute:
                    levels.add_metric([label, "requests"], usage.requests_available)
            synced = book.synced_age_s()
            age = -1.0 if synced is None else synced
        yield in_flight
        yield limits
        yield levels
        yield GaugeMetricFamily(
            "loraplane_tenant_quota_sync_age_seconds", "Seconds since the last quota sync (-1: never).", value=age
        )

    def _holdings(self):
        """KV-cache usage and adapter residency over the alive workers' last heartbeats."""
        workers = self.m.holdings()
        used = sum(w.kv_cells[0] for w in workers)
        total = sum(w.kv_cells[1] for w in workers)
        yield GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", value=kv_usage(used, total)
        )
        per_worker = GaugeMetricFamily(
            "loraplane_kv_cache_usage_perc",
            "KV cache cells held by running requests / all cells of one worker (0-1).",
            labels=["worker"],
        )
        for w in workers:
            per_worker.add_metric([w.worker_id], kv_usage(*w.kv_cells))
        yield per_worker
        residency = GaugeMetricFamily(
            "loraplane_adapter_residency",
            "Adapters an alive worker holds: device (in a slot), host (host tier only), pinned (pinned in a slot).",
            labels=["worker", "adapter", "state"],
        )
        for w in workers:
            states = {"device": w.resident_ids, "host": w.host_ids - w.resident_ids, "pinned": w.pinned_ids}
            for state, ids in states.items():
                counts: dict[str, int] = {}
                for i in sorted(ids):
                    label = self.m.labels(str(i))
                    counts[label] = counts.get(label, 0) + 1
                for label, n in counts.items():
                    residency.add_metric([w.worker_id, label, state], n)
        yield residency
