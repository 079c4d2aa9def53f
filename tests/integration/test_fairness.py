"""Fair admission in a real worker process (``--fairness vtc``, tiny llama-MoE model): a light
tenant's request queued behind a heavy tenant's backlog takes the next free slot, and
``Stats`` reports the tenants' counters; through a real control plane, a light tenant's
requests are admitted while a heavy tenant keeps the worker full (per-tenant queue shares)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from clients.client import LoraplaneClient
from clients.errors import LoraplaneError
from loraplane.v1 import worker_pb2
from tests.helpers.live_servers import start_control_plane, start_worker, wait_until
from tests.helpers.worker_service import WorkerProcess, gen

pytestmark = pytest.mark.slow

PROMPT = [1, 450, 4996, 17354]
LONG = 300  # tokens of the heavy tenant's first request: the light one arrives while it runs


def test_light_tenant_takes_the_next_free_slot_and_stats_report_the_counters(fixtures_dir):
    tiny = fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"
    w = WorkerProcess("fair", f"n_seqs=1, model_path={str(tiny)!r}, fairness=Fairness.VTC")
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


def test_light_tenant_is_admitted_through_the_control_plane_while_a_heavy_one_fills_the_worker(
    tmp_path, fixtures_dir, base_model_path
):
    """A real control plane and worker (``--slots 2 --queue-limit 2 --fairness vtc``): eight
    heavy streams re-send as soon as they end or are refused, keeping all four places taken;
    each of a light tenant's requests (same weight) is still admitted — the control plane lets
    it through to the full worker, which evicts the heavy tenant's newest queued request (that
    client gets RESOURCE_EXHAUSTED saying so) — and served, never "every live worker is full"."""
    cp = start_control_plane(tmp_path / "data", fixtures_dir / "adapters", base_model_path)
    heavy_threads: list[threading.Thread] = []
    stop = threading.Event()
    try:
        tiny = fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"
        extra = ("--queue-limit", "2", "--fairness", "vtc", "--n-ctx", "256")
        start_worker(cp, tiny, tmp_path / "worker.log", slots=2, extra_args=extra)
        admin = LoraplaneClient(cp.addr, timeout=120)
        _, heavy_key = admin.add_tenant("heavy")
        _, light_key = admin.add_tenant("light")
        served: list[int] = []
        refusals: list[str] = []

        def heavy() -> None:
            with LoraplaneClient(cp.addr, api_key=heavy_key, timeout=120) as lp:
                while not stop.is_set():
                    try:
                        lp.generate(prompt_tokens=PROMPT, adapters={}, max_tokens=48, ignore_eos=True)
                        served.append(1)
                    except LoraplaneError as exc:
                        assert exc.code == "RESOURCE_EXHAUSTED", exc
                        refusals.append(exc.message)
                        time.sleep(0.02)

        heavy_threads = [threading.Thread(target=heavy, daemon=True) for _ in range(8)]
        for t in heavy_threads:
            t.start()

        def refused_full_since(n: int) -> bool:
            return any("every live worker is full" in m for m in refusals[n:])

        assert wait_until(lambda: refused_full_since(0), timeout=60), refusals
        light_outcomes: list[str] = []
        with LoraplaneClient(cp.addr, api_key=light_key, timeout=120) as light:
            for _ in range(4):
                # the place the previous light request freed is taken again first (a heavy
                # stream refused as full after it), so this one meets a full worker too
                seen = len(refusals)
                assert wait_until(lambda n=seen: refused_full_since(n), timeout=60), refusals[-5:]
                try:
                    done = light.generate(prompt_tokens=PROMPT, adapters={}, max_tokens=4, ignore_eos=True)
                    light_outcomes.append(f"served {len(done.token_ids)}")
                except LoraplaneError as exc:
                    light_outcomes.append(f"{exc.code}: {exc.message}")
        assert light_outcomes == ["served 4"] * 4
        evicted = [m for m in refusals if "this queued request gave its place to a lighter tenant's" in m]
        # each light request met a full worker and took a heavy one's queued place; a heavy
        # stream ending in the milliseconds between the refusal seen and the send may spare one
        assert len(evicted) >= 3 and "tenant 'heavy' had" in evicted[0], refusals[-5:]
        assert served, "the heavy tenant kept being served too"
    finally:
        stop.set()
        for t in heavy_threads:
            t.join(60)
        cp.stop()
