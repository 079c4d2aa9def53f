"""Fair admission in a real worker process (``--fairness vtc``, tiny llama-MoE model): a light
tenant's request queued behind a heavy tenant's backlog takes the next free slot, and
``Stats`` reports the tenants' counters."""

from __future__ import annotations

import threading

import grpc
import pytest

from loraplane.v1 import worker_pb2
from tests.worker_service_helpers import WorkerProcess, gen

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PROMPT = [1, 450, 4996, 17354]
LONG = 300  # tokens of the heavy tenant's first request: the light one arrives while it runs


def test_light_tenant_takes_the_next_free_slot_and_stats_report_the_counters(fixtures_dir):
    tiny = fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"
    w = WorkerProcess("fair", f"n_slots=1, model_path={str(tiny)!r}, fairness=Fairness.VTC")
    try:
        w.wait_ready()
        heavy = worker_pb2.RequestTenant(name="heavy")
        light = worker_pb2.RequestTenant(name="light", weight=2.0)
        h0_running = threading.Event()

        def messages():
            yield worker_pb2.DecodeRequest(submit=gen("h0", tokens=PROMPT, adapters=[], max_tokens=LONG), tenant=heavy)
            for i in (1, 2, 3):
                yield worker_pb2.DecodeRequest(
                    submit=gen(f"h{i}", tokens=PROMPT, adapters=[], max_tokens=4), tenant=heavy
                )
            assert h0_running.wait(60)
            yield worker_pb2.DecodeRequest(submit=gen("l0", tokens=PROMPT, adapters=[], max_tokens=4), tenant=light)

        started: list[str] = []  # one slot and one stream: the order requests were admitted in
        for ev in w.stub.Decode(messages(), timeout=180):
            kind = ev.WhichOneof("event")
            if kind == "started":
                started.append(ev.request_id)
            elif kind == "token" and ev.request_id == "h0" and not h0_running.is_set():
                h0_running.set()
        # l0 was queued while h0 ran, behind h1-h3; off would admit h1, h2, h3 before it
        assert started == ["h0", "l0", "h1", "h2", "h3"]
        st = w.stats()
        assert st.fairness == "vtc"
        t = {x.name: x for x in st.tenants}
        assert set(t) == {"heavy", "light"}
        h, li = t["heavy"], t["light"]
        assert (h.prompt_tokens, h.output_tokens, h.queued, h.running, h.weight) == (16, LONG + 12, 0, 0, 1.0)
        assert h.virtual_tokens == 16 + 2 * (LONG + 12)  # w_p 1 per prompt token, w_q 2 per output token
        assert (li.prompt_tokens, li.output_tokens, li.weight, li.priority) == (4, 4, 2.0, 0)
        # light: lifted to heavy's counter when it arrived (h0's prompt and some of its
        # tokens), then (4 + 4 x 2) / weight 2 of its own
        lift = li.virtual_tokens - (4 + 2 * 4) / 2
        assert 4 + 2 <= lift <= 4 + 2 * LONG and lift % 2 == 0, li.virtual_tokens

        # a tenant weight the worker cannot use is refused, naming it
        bad = worker_pb2.DecodeRequest(
            submit=gen("bad", tokens=PROMPT, adapters=[]), tenant=worker_pb2.RequestTenant(name="acme", weight=-1)
        )
        with pytest.raises(grpc.RpcError) as err:
            list(w.stub.Decode(iter([bad]), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tenant 'acme': weight -1.0 must be a finite number > 0" in err.value.details()
    finally:
        w.stop()
