"""The control plane's ``/metrics`` as a scraper reads it: a real control plane (``--metrics-addr``)
with a scripted worker that reports residency, paging and KV cells like a real one, scraped over
HTTP and parsed by prometheus_client's text parser. Checks the ``vllm:`` families vLLM's
dashboards read (names, ``model_name``, vLLM's buckets, ``finished_reason``), ``adapter`` labels
by name (``name#id`` for a shared name, never the overflow label's value), and that every series
``deploy/grafana/loraplane-dashboard.json`` reads exists, at 0, before the first request."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients.client import LoraplaneClient
from loraplane.v1 import common_pb2, control_plane_pb2
from tests.helpers.control_plane import upload, write_adapter
from tests.helpers.live_servers import wait_until
from tests.helpers.scripted_worker import ScriptedMember, generate

ROOT = Path(__file__).resolve().parents[2]
BASE = "gemma-3-270m-q4_k_m"  # the served base-model name: the GGUF file's stem
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# vllm/v1/metrics/loggers.py
VLLM_TTFT_LE = (
    "0.001 0.005 0.01 0.02 0.04 0.06 0.08 0.1 0.25 0.5 0.75 1.0 2.5 5.0 7.5 10.0 20.0 40.0 80.0 160.0 640.0 2560.0"
)
VLLM_ITL_LE = "0.01 0.025 0.05 0.075 0.1 0.15 0.2 0.3 0.4 0.5 0.75 1.0 2.5 5.0 7.5 10.0 20.0 40.0 80.0"
VLLM_E2E_LE = "0.3 0.5 0.8 1.0 1.5 2.0 2.5 5.0 10.0 15.0 20.0 30.0 40.0 50.0 60.0 120.0 240.0 480.0 960.0 1920.0 7680.0"


def scrape(port: int) -> Samples:
    """Every sample of ``http://127.0.0.1:port/metrics``: (name, sorted labels) → value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def values(samples: Samples, name: str, label: str) -> dict[str, float]:
    """``{value of label: sample value}`` of the samples named ``name``."""
    return {dict(labels)[label]: v for (n, labels), v in samples.items() if n == name}


def dashboard_names() -> set[str]:
    dash = json.loads((ROOT / "deploy/grafana/loraplane-dashboard.json").read_text())
    return {
        m
        for p in dash["panels"]
        for t in p["targets"]
        for m in re.findall(r"\b(?:loraplane_[a-z0-9_]+|vllm:[a-z_]+)", t["expr"])
    }


@pytest.fixture
def plane(cluster, adapters_dir, tmp_path):
    """A control plane (label cap 5) with six adapters: ``sea`` (id 0, named at upload), two
    files embedding the name ``twin`` (1, 2), one embedding ``other`` — the overflow label's
    value — (3), one embedding ``sea#1`` (4) and ``extra`` (5, past the cap); a tenant with a
    token quota; and one scripted worker that holds sea in a slot, twin 2 on the host, reports
    page-ins of twin 1 and a third of its KV cells in use."""
    cp, _ = cluster(0, metrics_addr="127.0.0.1:0", metrics_max_adapters=5)
    assert upload(cp.stub, adapters_dir / "sea.gguf", name="sea").id == 0
    for seed, name in enumerate(("twin", "twin", "other", "sea#1", "extra"), start=1):
        info = upload(cp.stub, write_adapter(tmp_path / f"a{seed}.gguf", seed=seed, name=name))
        assert info.id == seed
    with LoraplaneClient(cp.addr) as admin:
        admin.add_tenant("acme", tokens_per_minute=6000)

    def refresh(hello: control_plane_pb2.WorkerHello) -> None:
        hello.paging.max_loras = 2
        hello.resident_adapter_ids[:] = [0]
        hello.host_adapter_ids[:] = [0, 2]
        hello.kv_cells_used, hello.kv_cells_total = 100, 300
        del hello.adapter_paging[:]
        hello.adapter_paging.add(adapter_id=1, page_ins=2, evictions=1)

    worker = ScriptedMember("w1", cp.addr, refresh=refresh)
    try:
        yield cp
    finally:
        worker.close()


def test_every_dashboard_series_exists_at_zero_before_the_first_request(plane):
    port = plane.state.metrics_port
    assert wait_until(lambda: scrape(port).get(("loraplane_workers_live", ())) == 1, timeout=10)
    samples = scrape(port)
    present = {name for name, _ in samples}
    for name in sorted(dashboard_names()):
        if name.startswith("loraplane_worker_"):
            continue  # the worker's own /metrics (tests/integration/test_http_api.py)
        assert name in present, f"{name}: no series before the first request"
    # the request counters exist, at 0, for the base model and every adapter under the cap
    requests = {labels: v for (n, labels), v in samples.items() if n == "loraplane_requests_total"}
    assert set(requests.values()) == {0.0}
    assert {dict(labels)["adapter"] for labels in requests} == {
        "none",
        "sea",
        "twin#1",
        "twin#2",
        "other#3",  # an adapter named like the overflow label is not the overflow label
        "sea#1#4",  # nor is one whose name looks like another's name#id
        "other",  # extra: past the cap of 5
    }
    assert {dict(labels)["outcome"] for labels in requests} == {"stop", "length", "cancelled", "rejected", "error"}
    assert values(samples, "loraplane_generation_tokens_total", "adapter")["twin#2"] == 0
    assert values(samples, "loraplane_tenant_requests_total", "tenant") == {"acme": 0}
    assert values(samples, "loraplane_tenant_tokens_total", "kind") == {"prompt": 0, "output": 0}
    # the worker's heartbeat: residency, page-ins and evictions by adapter name; 0 for the rest
    residency = {
        (dict(labels)["adapter"], dict(labels)["state"]): v
        for (n, labels), v in samples.items()
        if n == "loraplane_adapter_residency"
    }
    assert residency == {("sea", "device"): 1, ("twin#2", "host"): 1}
    assert values(samples, "loraplane_adapter_slot_page_ins_total", "adapter") == {
        "sea": 0,
        "twin#1": 2,
        "twin#2": 0,
        "other#3": 0,
        "sea#1#4": 0,
        "other": 0,
    }
    assert values(samples, "loraplane_adapter_slot_evictions_total", "adapter")["twin#1"] == 1
    assert samples[("loraplane_pool_slots", ())] == 2  # renamed: the workers' own series is loraplane_worker_slots
    assert ("loraplane_worker_slots", ()) not in samples
    assert samples[("vllm:kv_cache_usage_perc", (("model_name", BASE),))] == pytest.approx(1 / 3)


def test_vllm_families_count_each_request_once_with_vllms_names_and_buckets(plane):
    port = plane.state.metrics_port
    model = (("model_name", BASE),)
    before = scrape(port)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:time_per_output_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert before[(name, model)] == 0, name
    assert values(before, "vllm:request_success_total", "finished_reason") == {
        "stop": 0,
        "length": 0,
        "abort": 0,
        "error": 0,
    }
    for family, bounds in (
        ("vllm:time_to_first_token_seconds", VLLM_TTFT_LE),
        ("vllm:time_per_output_token_seconds", VLLM_ITL_LE),
        ("vllm:inter_token_latency_seconds", VLLM_ITL_LE),
        ("vllm:e2e_request_latency_seconds", VLLM_E2E_LE),
    ):
        le = [dict(labels)["le"] for (n, labels), _ in before.items() if n == family + "_bucket"]
        assert le == [str(float(b)) for b in bounds.split()] + ["+Inf"], family
        assert {dict(labels)["model_name"] for (n, labels), _ in before.items() if n == family + "_bucket"} == {BASE}

    # two requests of 2 tokens each ("length"), the first on both twins: each adapter label
    # counts it, vLLM's families count it once
    generate(plane, "hello", {1: 1.0, 2: 1.0})
    generate(plane, "hello", {})
    # one refused by the worker (INVALID_ARGUMENT: "rejected", which vLLM never counts) and one
    # the client cancels after the worker started it ("cancelled" = vLLM's "abort")
    with pytest.raises(grpc.RpcError) as refused:
        generate(plane, "refuse", {0: 1.0})
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    hang = common_pb2.GenerateRequest(text="hang")
    hang.adapters.SetInParent()  # the base model alone (no map: the default set)
    call = plane.stub.Generate(hang)
    assert next(call).HasField("started")
    call.cancel()
    assert wait_until(
        lambda: scrape(port)[("loraplane_requests_total", (("adapter", "none"), ("outcome", "cancelled")))] == 1
    )
    after = scrape(port)

    def moved(name: str, *labels: tuple[str, str]) -> float:
        key = (name, tuple(sorted(labels)))
        return after[key] - before[key]

    assert moved("loraplane_requests_total", ("adapter", "twin#1"), ("outcome", "length")) == 1
    assert moved("loraplane_requests_total", ("adapter", "twin#2"), ("outcome", "length")) == 1
    assert moved("loraplane_requests_total", ("adapter", "none"), ("outcome", "length")) == 1
    assert moved("loraplane_requests_total", ("adapter", "sea"), ("outcome", "rejected")) == 1
    assert moved("loraplane_generation_tokens_total", ("adapter", "twin#1")) == 2
    m = ("model_name", BASE)
    reasons = ("stop", "length", "abort", "error")
    assert {r: moved("vllm:request_success_total", ("finished_reason", r), m) for r in reasons} == {
        "stop": 0,
        "length": 2,
        "abort": 1,
        "error": 0,
    }
    assert moved("vllm:generation_tokens_total", m) == 2 + 2  # not 2 + 2 + 2: the twins' request once
    assert moved("vllm:time_to_first_token_seconds_count", m) == 2
    assert moved("vllm:inter_token_latency_seconds_count", m) == 2  # one gap per 2-token request
    assert moved("vllm:time_per_output_token_seconds_count", m) == 2
    assert moved("vllm:e2e_request_latency_seconds_count", m) == 2
    assert moved("vllm:e2e_request_latency_seconds_bucket", ("le", "+Inf"), m) == 2
    assert after[("vllm:num_requests_running", model)] == 0 == after[("vllm:num_requests_waiting", model)]
