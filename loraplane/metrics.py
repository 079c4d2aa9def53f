"""Prometheus plumbing both planes share: bounded per-adapter label values and the
``/metrics`` HTTP server (``--metrics-addr HOST:PORT``).

Label cardinality: a Prometheus series exists per distinct label set, and adapters can number
in the thousands, so per-adapter labels go through `BoundedLabels`. The first ``cap`` distinct
values (by first use; default `DEFAULT_ADAPTER_LABEL_CAP`, flag ``--metrics-max-adapters``)
keep their own value for the life of the process; every later one is folded into
`OTHER_LABEL`. A removed adapter keeps its slot (counters never go back), so the cap bounds
the series count for good: at most ``cap + 2`` values ("none" for base-model requests and
"other") per labelled metric. The values are ids on a worker and names on the control plane
(``control_plane.adapter_labels.adapter_label``, which never yields "none" or "other").
"""

from __future__ import annotations

import threading
from typing import Any

DEFAULT_ADAPTER_LABEL_CAP = 64
OTHER_LABEL = "other"
NO_ADAPTER_LABEL = "none"

# Latency buckets in seconds: vLLM's TTFT buckets (vllm/v1/metrics/loggers.py), which cover
# a 2-core CPU as well as a GPU.
LATENCY_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)

# vLLM's inter-token buckets (``vllm:inter_token_latency_seconds`` and its older name
# ``vllm:time_per_output_token_seconds``, vllm/v1/metrics/loggers.py).
VLLM_INTER_TOKEN_BUCKETS_S = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)

# vLLM's request-latency buckets (``vllm:e2e_request_latency_seconds``, loggers.py's
# ``request_latency_buckets``).
VLLM_REQUEST_LATENCY_BUCKETS_S = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class BoundedLabels:
    """Maps label values to themselves for the first ``cap`` distinct ones, then to "other"."""

    def __init__(self, cap: int = DEFAULT_ADAPTER_LABEL_CAP) -> None:
        if cap < 0:
            raise ValueError(f"label cap must be >= 0, got {cap}")
        self.cap = cap
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        if value in (NO_ADAPTER_LABEL, OTHER_LABEL):
            return value
        with self._lock:
            if value in self._seen:
                return value
            if len(self._seen) < self.cap:
                self._seen.add(value)
                return value
        return OTHER_LABEL


def kv_usage(used: int, total: int) -> float:
    """KV-cache usage ``used / total`` cells (0–1; 0 when ``total`` is 0: nothing reported) —
    vLLM's ``vllm:kv_cache_usage_perc`` (used blocks / all blocks, ``KVCacheManager.usage``)."""
    return min(1.0, used / total) if total > 0 else 0.0


def split_host_port(addr: str) -> tuple[str, int]:
    """``"HOST:PORT"`` → ``(host, port)`` (IPv6 hosts may be bracketed).

    Raises:
        ValueError: no port or a port that is not a number.
    """
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address '{addr}': expected HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def start_metrics_server(addr: str, registry: Any) -> tuple[Any, int]:
    """Serve ``registry`` at ``http://addr/metrics`` on a daemon thread (prometheus-client's
    own WSGI server); returns the server (``shutdown()`` stops it) and its bound port (port 0
    picks a free one).

    Raises:
        OSError: the address cannot be bound.
    """
    from prometheus_client import start_http_server

    host, port = split_host_port(addr)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, int(server.server_port)
