"""Prometheus metrics of the control plane (``/metrics`` on ``--metrics-addr`` and on the HTTP
front).

`ControlPlaneMetrics` counts every Generate, gRPC or HTTP: ``Router.generate`` hands it the
event stream once its adapters are resolved (`ControlPlaneMetrics.track`); the quota book
reports tenant admissions, refusals, tokens and failed syncs; worker heartbeats bring KV usage,
adapter holdings and slot page-in/eviction counts (`ControlPlaneMetrics.on_paging`). Gauges are
computed at scrape time (`_StateCollector`); ``adapter`` and ``tenant`` labels are capped by
``loraplane.metrics.BoundedLabels``.

Each request is observed once and counted under two names: loraplane's own series (by
adapter) and the ``vllm:`` families vLLM's dashboards read (vllm/v1/metrics/loggers.py: the
same names, ``model_name`` label = the served base model, vLLM's buckets). ``adapter`` labels
are names (`control_plane.adapter_labels.adapter_label`). Every series a dashboard query reads
exists from the first scrape on, at 0 (`ControlPlaneMetrics.exposition`).

Every series, its labels and what it counts: docs/operations.md, "Health, logs, metrics" (the
tenant series: docs/tenants.md, "Metrics").
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from control_plane.adapter_labels import AdapterNaming, unknown_adapter
from control_plane.errors import InvalidArgumentError, NotFoundError
from control_plane.workers import WorkerHoldingsView
from loraplane.adapter_scales import AdapterScales
from loraplane.metrics import (
    LATENCY_BUCKETS_S,
    NO_ADAPTER_LABEL,
    OTHER_LABEL,
    VLLM_INTER_TOKEN_BUCKETS_S,
    VLLM_REQUEST_LATENCY_BUCKETS_S,
    BoundedLabels,
    kv_usage,
)
from loraplane.v1 import common_pb2
from loraplane.v1.membership_pb2 import AdapterPagingCount

LORA_INFO = "vllm:lora_requests_info"
REJECTED = (InvalidArgumentError, NotFoundError)

OUTCOMES = ("stop", "length", "cancelled", "rejected", "error")
"""``loraplane_requests_total``'s ``outcome`` values."""

VLLM_FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}
"""Outcome → ``vllm:request_success_total``'s ``finished_reason`` (vLLM's
``FINISH_REASON_STRINGS``, vllm/v1/engine/__init__.py). A ``rejected`` request (refused before
any worker ran it) is not counted: vLLM counts only requests its engine finished."""

NAMING_MAX_AGE_S = 1.0
"""How long one read of the adapters' names serves (`ControlPlaneMetrics.adapters`): a rename
shows in the labels within this."""


class _Observed:
    """One observation into several histograms (loraplane's and vLLM's: their buckets
    differ)."""

    def __init__(self, *histograms: Any) -> None:
        self._histograms = histograms

    def observe(self, value: float) -> None:
        for h in self._histograms:
            h.observe(value)


@dataclass
class _InFlight:
    names: tuple[str, ...]
    running: bool = False


class ControlPlaneMetrics:
    """Metric objects in their own registry plus the in-flight table behind the gauges.

    Args:
        model_name: the served base model's name, the ``vllm:`` families' ``model_name``.
        adapters: ``() -> {id: AdapterNaming}`` of every registered adapter (one store read;
            None when the store cannot be read: ids are then named ``adapter:<id>`` and the
            adapter count is the last one read). Read at most once per `NAMING_MAX_AGE_S`.
        pool_state: ``() -> (live workers, their total slots, their total adapter slots)``.
        adapter_label_cap: distinct ``adapter`` label values before "other".
        holdings: ``() -> [WorkerHoldingsView]`` of the alive workers (None: no KV or residency
            gauges).
    """

    def __init__(
        self,
        *,
        model_name: str,
        adapters: Callable[[], dict[int, AdapterNaming] | None],
        pool_state: Callable[[], tuple[int, int, int]],
        adapter_label_cap: int,
        holdings: Callable[[], list[WorkerHoldingsView]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.labels = BoundedLabels(adapter_label_cap)
        self.model_name = model_name
        self._adapters = adapters
        self._naming_lock = threading.Lock()
        self._naming_read: tuple[float, dict[int, AdapterNaming]] | None = None  # (monotonic s, namings)
        self._n_adapters = 0  # registered adapters at the last read that worked
        self._pool_state = pool_state
        self._holdings = holdings
        self._paging_lock = threading.Lock()
        # worker id → (incarnation, adapter id → (page-ins, evictions) as last reported)
        self._paging_last: dict[str, tuple[str, dict[int, tuple[int, int]]]] = {}
        # adapter id → [page-ins, evictions] over all workers since start (labelled at scrape
        # time: heartbeats arrive under the pool's lock, where no store read may happen)
        self._paging_totals: dict[int, list[int]] = {}
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
        model = [model_name]
        self.ttft = _Observed(
            Histogram(
                "loraplane_time_to_first_token_seconds",
                "Admission to first token.",
                buckets=LATENCY_BUCKETS_S,
                registry=r,
            ),
            Histogram(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                ["model_name"],
                buckets=LATENCY_BUCKETS_S,
                registry=r,
            ).labels(*model),
        )
        self.itl = _Observed(
            Histogram(
                "loraplane_inter_token_latency_seconds",
                "Time between consecutive tokens.",
                buckets=LATENCY_BUCKETS_S,
                registry=r,
            ),
            Histogram(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                ["model_name"],
                buckets=VLLM_INTER_TOKEN_BUCKETS_S,
                registry=r,
            ).labels(*model),
            Histogram(  # vLLM's older name of the same histogram, still what its dashboards read
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in seconds.",
                ["model_name"],
                buckets=VLLM_INTER_TOKEN_BUCKETS_S,
                registry=r,
            ).labels(*model),
        )
        self.e2e = _Observed(
            Histogram(
                "loraplane_e2e_request_latency_seconds",
                "Admission to the finished event.",
                buckets=LATENCY_BUCKETS_S,
                registry=r,
            ),
            Histogram(
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                ["model_name"],
                buckets=VLLM_REQUEST_LATENCY_BUCKETS_S,
                registry=r,
            ).labels(*model),
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.vllm_success = {reason: success.labels(model_name, reason) for reason in VLLM_FINISHED_REASONS.values()}
        self.vllm_prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", ["model_name"], registry=r
        ).labels(*model)
        self.vllm_generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", ["model_name"], registry=r
        ).labels(*model)
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
        """``(text format body, content type)`` for a ``/metrics`` response.

        Every labelled series a dashboard reads is created first, at 0, so a query over it has
        data before its first event: requests and tokens for the base model ("none") and each
        registered adapter (as the label cap allows), and each tenant's admissions and tokens.
        """
        adapter_labels = [NO_ADAPTER_LABEL, *(self.labels(n.label) for n in self.adapters().values())]
        for label in dict.fromkeys(adapter_labels):
            for outcome in OUTCOMES:
                self.requests.labels(outcome, label)
            for counter in (self.prompt_tokens, self.cached_tokens, self.generation_tokens):
                counter.labels(label)
        if self.quotas is not None:
            for rec in self.quotas.directory.records():
                label = self.tenant_labels(rec.name)
                self.tenant_requests.labels(label, "admitted")
                for kind in ("prompt", "output"):
                    self.tenant_token_counts.labels(label, kind)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def adapters(self) -> dict[int, AdapterNaming]:
        """``{id: AdapterNaming}`` of the registered adapters ({} when the store is down).

        One store read serves every use within `NAMING_MAX_AGE_S` (a scrape reads the names
        three times; with the database hung each read would wait out its timeout)."""
        now = time.monotonic()
        with self._naming_lock:
            if self._naming_read is not None and now - self._naming_read[0] < NAMING_MAX_AGE_S:
                return self._naming_read[1]
        read = self._adapters()
        with self._naming_lock:
            if read is not None:
                self._n_adapters = len(read)
            self._naming_read = (time.monotonic(), read or {})
            return self._naming_read[1]

    def namings(self, ids: Iterable[int]) -> list[AdapterNaming]:
        """How each of ``ids`` is named (`control_plane.adapter_labels.adapter_label`), in order;
        one store read."""
        ids = list(ids)
        known = self.adapters() if ids else {}
        return [known.get(i) or unknown_adapter(i) for i in ids]

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
        namings = self.namings(adapters.ids)
        labels = [self.labels(n.label) for n in namings] or [NO_ADAPTER_LABEL]
        key = next(self._ids)
        entry = _InFlight(tuple(n.served for n in namings))
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
            # vLLM's families count a request once, whatever its adapters
            reason = VLLM_FINISHED_REASONS.get(outcome)
            if reason is not None:
                self.vllm_success[reason].inc()
            self.vllm_prompt_tokens.inc(counts["prompt"])
            self.vllm_generation_tokens.inc(counts["out"])

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
        ``incarnation``: add the increase since its previous heartbeat to the totals (a new
        incarnation, or a count below the last one, starts again from 0). Never blocks long: the
        pool calls it under its lock (the totals are labelled at scrape time)."""
        with self._paging_lock:
            seen_incarnation, last = self._paging_last.get(worker_id, (incarnation, {}))
            if seen_incarnation != incarnation:
                last = {}
            now = dict(last)
            for c in counts:
                p0, e0 = last.get(c.adapter_id, (0, 0))
                dp = c.page_ins - p0 if c.page_ins >= p0 else c.page_ins
                de = c.evictions - e0 if c.evictions >= e0 else c.evictions
                if dp or de:
                    total = self._paging_totals.setdefault(c.adapter_id, [0, 0])
                    total[0] += dp
                    total[1] += de
                now[c.adapter_id] = (c.page_ins, c.evictions)
            self._paging_last[worker_id] = (incarnation, now)

    def paging_totals(self) -> dict[int, tuple[int, int]]:
        """``{adapter id: (page-ins, evictions)}`` over all workers since start."""
        with self._paging_lock:
            return {i: (p, e) for i, (p, e) in self._paging_totals.items()}

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
        """Registered adapters (the last count read when the store is down)."""
        self.adapters()
        with self._naming_lock:
            return self._n_adapters


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
            ("loraplane_workers_live", "Live workers.", live),
            ("loraplane_pool_slots", "Slots over the live workers.", slots),
            ("loraplane_adapters_registered", "Registered adapters.", self.m.n_adapters()),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", len(running)),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(waiting)),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self.m.model_name], value)
            yield gauge
        info = GaugeMetricFamily(
            LORA_INFO,
            "Running stats on lora requests.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        info.add_metric([str(max_lora), _names(running), _names(waiting)], time.time())
        yield info
        labels = {i: self.m.labels(n.label) for i, n in self.m.adapters().items()}
        yield from self._holdings(labels)
        yield from self._paging(labels)
        yield from self._tenants()

    def _paging(self, labels: dict[int, str]):
        """Page-ins and evictions by adapter label; 0 for every registered adapter without any."""
        totals = {i: (0, 0) for i in labels} | self.m.paging_totals()
        for name, doc, k in (
            (
                "loraplane_adapter_slot_page_ins",
                "Page-ins of an adapter into a worker's device slot (all workers).",
                0,
            ),
            (
                "loraplane_adapter_slot_evictions",
                "LRU evictions of an adapter out of a worker's device slot (all workers).",
                1,
            ),
        ):
            by_label: dict[str, int] = {}
            for i in sorted(totals):
                label = labels.get(i) or self.m.labels(unknown_adapter(i).label)
                by_label[label] = by_label.get(label, 0) + totals[i][k]
            family = CounterMetricFamily(name, doc, labels=["adapter"])
            for label, n in by_label.items():
                family.add_metric([label], n)
            yield family

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

    def _holdings(self, labels: dict[int, str]):
        """KV-cache usage and adapter residency over the alive workers' last heartbeats
        (``labels``: id → label of the registered adapters)."""
        workers = self.m.holdings()
        used = sum(w.kv_cells[0] for w in workers)
        total = sum(w.kv_cells[1] for w in workers)
        pool = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=["model_name"]
        )
        pool.add_metric([self.m.model_name], kv_usage(used, total))
        yield pool
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
                    label = labels.get(i) or self.m.labels(unknown_adapter(i).label)
                    counts[label] = counts.get(label, 0) + 1
                for label, n in counts.items():
                    residency.add_metric([w.worker_id, label, state], n)
        yield residency
