"""Tenant quotas end to end on the shared ``live_server`` (a real control plane and worker) with
its HTTP front started in-process: a tenant over its tokens per minute is refused — gRPC
RESOURCE_EXHAUSTED with ``retry-after`` trailing metadata, HTTP 429 ``rate_limit_exceeded`` with
``Retry-After`` (the official ``openai`` client raises ``RateLimitError``) — while another tenant
and keyless traffic are served; usage in ``ListTenants`` and the metrics by tenant are exact.
(Two replicas on PostgreSQL: ``tests/integration/test_replicas.py``.)"""

from __future__ import annotations

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients.client import LoraplaneClient
from clients.errors import LoraplaneError
from loraplane.v1 import common_pb2, control_plane_pb2_grpc

pytestmark = pytest.mark.slow

PROMPT = [2, 651, 6114, 3124]  # 4 token ids: what the quota counts exactly
MAX_TOKENS = 8


@pytest.fixture
def http_front(live_server):
    """The live server's HTTP front (``--http-addr``), started on its state for this test."""
    from control_plane.http.app import create_app
    from control_plane.http.server import HttpServer
    from control_plane.server import http_deps

    server = HttpServer(create_app(http_deps(live_server.state)), "127.0.0.1:0")
    port = server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def samples(live_server, name: str) -> dict[tuple[str, str], float]:
    """``{(metric sample name, label value other than tenant): value}`` for tenant ``name``."""
    text = live_server.state.metrics.exposition()[0].decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("tenant") == name:
                other = next((v for k, v in s.labels.items() if k != "tenant"), "")
                out[(s.name, other)] = s.value
    return out


def test_tenant_over_tokens_per_minute_is_refused_on_grpc_and_http_others_untouched(live_server, http_front):
    admin = LoraplaneClient(live_server.addr, timeout=120)
    _, heavy_key = admin.add_tenant("tpm-heavy", tokens_per_minute=3 * (len(PROMPT) + MAX_TOKENS), weight=2)
    _, light_key = admin.add_tenant("tpm-light", tokens_per_minute=100_000)
    heavy = LoraplaneClient(live_server.addr, api_key=heavy_key, timeout=120)
    light = LoraplaneClient(live_server.addr, api_key=light_key, timeout=120)
    try:
        for _ in range(3):  # 3 × (4 + 8) = the whole minute's 36 tokens
            done = heavy.generate(prompt_tokens=PROMPT, adapters={}, max_tokens=MAX_TOKENS, ignore_eos=True)
            assert len(done.token_ids) == MAX_TOKENS
        with pytest.raises(LoraplaneError) as refused:
            heavy.generate(prompt_tokens=PROMPT, adapters={}, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert refused.value.code == "RESOURCE_EXHAUSTED"
        assert "tenant 'tpm-heavy': over tokens_per_minute 36 (the request needs 12 tokens" in refused.value.message
        with grpc.insecure_channel(live_server.addr) as ch:
            request = common_pb2.GenerateRequest(tokens=common_pb2.TokenIds(ids=PROMPT))
            request.sampling.max_tokens = MAX_TOKENS
            call = control_plane_pb2_grpc.ControlPlaneStub(ch).Generate(
                request, metadata=(("authorization", f"Bearer {heavy_key}"),), timeout=60
            )
            with pytest.raises(grpc.RpcError) as raw:
                list(call)
        retry = int(dict(raw.value.trailing_metadata())["retry-after"])
        assert raw.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and 1 <= retry <= 20  # 12 tokens at 0.6/s

        base = openai.OpenAI(base_url=http_front + "/v1", api_key="unused", max_retries=0).models.list().data[0].id
        with pytest.raises(openai.RateLimitError) as limited:
            openai.OpenAI(base_url=http_front + "/v1", api_key=heavy_key, max_retries=0).completions.create(
                model=base, prompt="Hello there", max_tokens=MAX_TOKENS
            )
        assert limited.value.status_code == 429
        assert limited.value.body["code"] == "rate_limit_exceeded" and limited.value.body["type"] == "rate_limit_error"
        assert 1 <= int(limited.value.response.headers["retry-after"]) <= 20

        # another tenant, and keyless traffic: untouched, on both fronts
        assert len(light.generate(prompt_tokens=PROMPT, adapters={}, max_tokens=MAX_TOKENS).token_ids) == MAX_TOKENS
        for key in (light_key, "no-such-key-is-ignored-without-api-key"):
            answer = openai.OpenAI(base_url=http_front + "/v1", api_key=key, max_retries=0).completions.create(
                model=base, prompt="Hello there", max_tokens=2
            )
            assert answer.usage.completion_tokens == 2
        assert len(admin.generate(prompt_tokens=PROMPT, adapters={}, max_tokens=2).token_ids) == 2

        usage = {t.name: t.usage for t in admin.list_tenants()}
        heavy_usage = usage["tpm-heavy"]
        assert (heavy_usage.requests_total, heavy_usage.tokens_total, heavy_usage.rejected_total) == (3, 36, 3)
        assert heavy_usage.in_flight == 0 and heavy_usage.tokens_available < len(PROMPT) + MAX_TOKENS
        assert usage["tpm-light"].requests_total == 2
        if live_server.state.metrics.tenant_labels("tpm-heavy") == "tpm-heavy":  # under the shared label cap
            got = samples(live_server, "tpm-heavy")
            assert got[("loraplane_tenant_requests_total", "admitted")] == 3
            assert got[("loraplane_tenant_requests_total", "tokens_per_minute")] == 3
            assert got[("loraplane_tenant_tokens_total", "prompt")] == 12
            assert got[("loraplane_tenant_tokens_total", "output")] == 24
            assert got[("loraplane_tenant_limit", "tokens_per_minute")] == 36
    finally:
        for client in (heavy, light):
            client.close()
        admin.remove_tenant("tpm-heavy")
        admin.remove_tenant("tpm-light")
        admin.close()
