"""Worker membership and Generate routing, against a real control plane and scripted workers
(``tests/helpers/scripted_worker.py``: real gRPC servers of the ``loraplane.v1.Worker`` service,
no model, answering Decode by the prompt text). This pins the control plane's side of the wire
contract (a worker marked ``down`` fails before any event); the real worker is covered in the
worker's own tests.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time

import grpc
import httpx
import pytest

from bench.servers import free_port
from loraplane.v1 import common_pb2, control_plane_pb2, membership_pb2
from tests.helpers.control_plane import MiB, by_path, rpc_error, upload, upload_chunks
from tests.helpers.live_servers import wait_until
from tests.helpers.scripted_worker import generate, workers_of

# -- membership ------------------------------------------------------------------------------


def test_registration_pushes_nothing_and_fetch_streams_bytes_in_chunks(cluster, adapters_dir):
    """Adapter paging: nothing sent to workers on registration; a request announces the adapter (header only, id →
    sha256); the worker fetches the bytes by sha256 in ≤ 1 MiB chunks."""
    shout = adapters_dir / "shout.gguf"
    cp, [w] = cluster(1, lora=(str(shout),))
    upload(cp.stub, adapters_dir / "sea.gguf")
    time.sleep(0.3)
    assert w.servicer.adapters == {} and w.servicer.load_calls == []
    generate(cp, "hello", {0: 1.0})
    [[header]] = w.servicer.load_calls
    digest = hashlib.sha256(shout.read_bytes()).hexdigest()
    assert (header.id, header.sha256, header.fetch_on_demand, header.data) == (0, digest, True, b"")
    assert header.HasField("pinned") and header.pinned is False
    chunks = list(cp.worker_stub.FetchAdapter(membership_pb2.FetchAdapterRequest(sha256=digest, worker_id="w1")))
    assert len(chunks) == -(-shout.stat().st_size // MiB) and all(len(c.data) <= MiB for c in chunks)
    assert hashlib.sha256(b"".join(c.data for c in chunks)).hexdigest() == digest
    with pytest.raises(grpc.RpcError) as info:
        list(cp.worker_stub.FetchAdapter(membership_pb2.FetchAdapterRequest(sha256="0" * 64)))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "0" * 64 in info.value.details()
    info = workers_of(cp)["w1"]
    assert (info.state, info.addr, info.n_slots) == ("alive", w.hello.addr, 2)
    assert list(info.adapter_ids) == [0]


def test_adapters_are_announced_on_use_and_removals_unloaded(cluster, adapters_dir):
    cp, [w] = cluster(1)
    info = by_path(cp.stub, adapters_dir / "critic_alora.gguf")
    assert w.servicer.adapters == {}  # not pushed
    generate(cp, "hello", {info.id: 1.0})
    assert w.servicer.adapters == {info.id: info.sha256}
    cp.stub.UnregisterAdapter(common_pb2.AdapterRef(id=info.id))
    assert w.servicer.unloaded == [info.id] and w.servicer.adapters == {}
    assert list(workers_of(cp)["w1"].adapter_ids) == []


def test_pin_reaches_workers_that_know_the_adapter(cluster, adapters_dir):
    cp, [w] = cluster(1)
    sea = upload(cp.stub, adapters_dir / "sea.gguf")
    assert cp.stub.PinAdapter(control_plane_pb2.PinRequest(id=sea.id, pinned=True)).pinned is True
    assert w.servicer.load_calls == []  # the worker does not know it yet: nothing to tell
    generate(cp, "hello", {sea.id: 1.0})
    assert w.servicer.load_calls[-1][0].pinned is True  # announced with its pin
    unpinned = cp.stub.PinAdapter(control_plane_pb2.PinRequest(id=sea.id, pinned=False))
    assert unpinned.pinned is False and cp.stub.GetAdapter(common_pb2.AdapterRef(id=sea.id)).pinned is False
    assert w.servicer.load_calls[-1][0].HasField("pinned") and w.servicer.load_calls[-1][0].pinned is False
    with pytest.raises(grpc.RpcError) as info:
        cp.stub.PinAdapter(control_plane_pb2.PinRequest(id=99, pinned=True))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_affinity_prefers_the_worker_holding_the_adapter(cluster, adapters_dir):
    """Heartbeats report residency; routing prefers the holder over the idle first-by-id."""
    cp, [w1, w2] = cluster(2)
    sea = upload(cp.stub, adapters_dir / "sea.gguf")
    shout = by_path(cp.stub, adapters_dir / "shout.gguf")
    w2.leave()
    w2.hello.resident_adapter_ids.append(sea.id)
    w2.hello.paging.CopyFrom(common_pb2.WorkerPaging(max_loras=2, resident=1, page_ins=1))
    w2.join()
    assert list(workers_of(cp)["w2"].resident_adapter_ids) == [sea.id]
    assert workers_of(cp)["w2"].paging.page_ins == 1
    for _ in range(3):
        generate(cp, "hello", {sea.id: 1.0})
    assert len(w2.servicer.submitted) == 3 and len(w1.servicer.submitted) == 0
    generate(cp, "hello", {shout.id: 1.0})  # nobody holds it: least loaded, then by id
    assert len(w1.servicer.submitted) == 1


def test_missed_heartbeats_mark_a_worker_dead_until_it_returns(cluster):
    cp, [w] = cluster(1, heartbeat_interval_s=0.1, dead_after_missed=3)
    assert workers_of(cp)["w1"].state == "alive"
    w.leave()
    assert wait_until(lambda: workers_of(cp)["w1"].state == "dead", timeout=3)
    assert workers_of(cp)["w1"].last_heartbeat_age_s >= 0.3
    err = rpc_error(generate, cp, "hello")
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "no live worker" in err.details()
    w.join()
    assert workers_of(cp)["w1"].state == "alive"
    assert len(generate(cp, "hello")) == 4


def test_worker_reregisters_after_control_plane_restart(cluster, start_control_plane, adapters_dir):
    port = free_port()  # one the restarted control plane can take again
    cp, [w] = cluster(1, addr=f"127.0.0.1:{port}", lora=(str(adapters_dir / "sea.gguf"),))
    generate(cp, "hello", {0: 1.0})  # announces adapter 0 to the worker
    assert set(w.servicer.adapters) == {0}
    loads = len(w.servicer.load_calls)
    cp.stop()
    cp2 = start_control_plane(
        addr=f"127.0.0.1:{port}", heartbeat_interval_s=0.2, lora=(str(adapters_dir / "sea.gguf"),)
    )
    assert wait_until(lambda: "w1" in workers_of(cp2), timeout=10)
    assert list(workers_of(cp2)["w1"].adapter_ids) == [0]
    assert len(w.servicer.load_calls) == loads  # same content already held: nothing re-pushed


# -- Generate --------------------------------------------------------------------------------


def test_generate_sends_resolved_vectors_and_relays_events(cluster, adapters_dir):
    cp, [w] = cluster(1, lora=(str(adapters_dir / "shout.gguf"),))
    upload(cp.stub, adapters_dir / "sea.gguf")
    events = generate(cp, "hello")
    assert [e.WhichOneof("event") for e in events] == ["started", "token", "token", "finished"]
    sent = w.servicer.submitted[-1]
    assert sent.request_id and all(e.request_id == sent.request_id for e in events)
    assert sent.HasField("adapters") and [(e.id, e.scale) for e in sent.adapters.entries] == [(0, 1.0)]
    generate(cp, "hello", {})  # an explicit empty map: no adapters, still an explicit map
    sent = w.servicer.submitted[-1]
    assert sent.HasField("adapters") and list(sent.adapters.entries) == []
    generate(cp, "hello", {1: 0.5, 0: 0.0}, request_id="mine")
    sent = w.servicer.submitted[-1]
    assert sent.request_id == "mine" and [(e.id, e.scale) for e in sent.adapters.entries] == [(1, 0.5)]


def test_generate_carries_the_tenant_and_refuses_over_quota_before_any_worker(cluster, adapters_dir):
    """The tenant reaches the worker on the submit (keyless: the explicit map's first adapter,
    else "anonymous"; a tenant key: that tenant with its weight and priority); a tenant over its
    tokens per minute is refused RESOURCE_EXHAUSTED with ``retry-after`` before the worker sees
    anything, a request that can never fit is INVALID_ARGUMENT, and keyless traffic is untouched."""
    cp, [w] = cluster(1, lora=(str(adapters_dir / "shout.gguf"),))
    sea = upload(cp.stub, adapters_dir / "sea.gguf")
    generate(cp, "hello")
    generate(cp, "hello", {sea.id: 0.5, 0: 1.0})
    generate(cp, "hello", {})
    names = [(t.name, t.weight, t.priority) for t in w.servicer.tenants]
    assert names == [("anonymous", 1.0, 0), (f"adapter:{sea.name}", 1.0, 0), ("anonymous", 1.0, 0)]
    # an adapter name too long for a tenant name (256 bytes against 128 characters): adapter:<id>
    long = cp.stub.RegisterAdapter(upload_chunks(adapters_dir / "shout_embd.gguf", name="n" * 200))
    generate(cp, "hello", {long.id: 1.0})
    assert w.servicer.tenants[-1].name == f"adapter:{long.id}"
    limits = control_plane_pb2.TenantLimits(weight=2.5, priority=-1, tokens_per_minute=20)
    added = cp.stub.AddTenant(control_plane_pb2.AddTenantRequest(name="acme", limits=limits))
    assert added.api_key.startswith("lp-") and added.tenant.usage.tokens_available == 20.0
    key = (("authorization", f"Bearer {added.api_key}"),)
    request = common_pb2.GenerateRequest(text="hello", sampling=common_pb2.SamplingParams(max_tokens=15))
    events = list(cp.stub.Generate(request, metadata=key))  # reserves 2 prompt + 15; settles 2 + 2
    assert events[-1].HasField("finished")
    assert (w.servicer.tenants[-1].name, w.servicer.tenants[-1].weight, w.servicer.tenants[-1].priority) == (
        "acme",
        2.5,
        -1,
    )
    n_submitted = len(w.servicer.submitted)
    err = rpc_error(lambda: list(cp.stub.Generate(request, metadata=key)))  # needs 17, 16 left
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant 'acme': over tokens_per_minute 20 (the request needs 17 tokens, 16 are left)" in err.details()
    retry = dict(err.trailing_metadata())["retry-after"]
    assert retry in ("2", "3") and f"retry after {retry} s" in err.details()  # 1 token at 20/60 per second
    too_big = common_pb2.GenerateRequest(text="hello", sampling=common_pb2.SamplingParams(max_tokens=50))
    err = rpc_error(lambda: list(cp.stub.Generate(too_big, metadata=key)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than its tokens_per_minute 20" in err.details()
    assert len(w.servicer.submitted) == n_submitted  # refused before any worker work
    assert generate(cp, "hello")[-1].HasField("finished")  # another tenant: untouched
    (acme,) = cp.stub.ListTenants(control_plane_pb2.ListTenantsRequest()).tenants
    assert (acme.usage.requests_total, acme.usage.tokens_total, acme.usage.rejected_total) == (1, 4, 1)


def test_generate_refuses_bad_maps_before_any_worker(cluster, adapters_dir):
    cp, [w] = cluster(1)
    upload(cp.stub, adapters_dir / "sea.gguf")
    err = rpc_error(generate, cp, "hello", {4: 1.0})
    assert err.code() == grpc.StatusCode.NOT_FOUND and "[4]" in err.details() and "[0]" in err.details()
    err = rpc_error(generate, cp, "hello", {0: -1.0})
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "adapter 0" in err.details()
    assert w.servicer.submitted == []


def test_generate_without_workers_is_unavailable(start_control_plane):
    cp = start_control_plane()
    err = rpc_error(generate, cp, "hello")
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "no live worker" in err.details()


def test_worker_failure_mid_stream_is_unavailable_and_marks_it(cluster):
    cp, [w] = cluster(1, heartbeat_interval_s=5.0)
    call = cp.stub.Generate(common_pb2.GenerateRequest(text="fail"))
    got = []
    with pytest.raises(grpc.RpcError) as info:
        for event in call:
            got.append(event.WhichOneof("event"))
    assert got == ["started", "token"]
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "worker w1 failed" in info.value.details() and "boom" in info.value.details()
    assert workers_of(cp)["w1"].state == "dead"


def test_worker_request_errors_keep_their_code(cluster):
    cp, [w] = cluster(1)
    err = rpc_error(generate, cp, "refuse")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "w1" in err.details()
    assert "prompt too long" in err.details()
    assert workers_of(cp)["w1"].state == "alive"


def test_failure_before_first_event_tries_another_worker(cluster):
    cp, [w1, w2] = cluster(2, heartbeat_interval_s=5.0)
    w1.servicer.down = True  # w1 (first pick: both idle, by id) fails before any event
    events = generate(cp, "hello")
    assert [e.WhichOneof("event") for e in events] == ["started", "token", "token", "finished"]
    assert len(w1.servicer.submitted) == 1 and len(w2.servicer.submitted) == 1
    states = {k: v.state for k, v in workers_of(cp).items()}
    assert states == {"w1": "dead", "w2": "alive"}


def test_client_cancel_cancels_the_worker_call(cluster):
    cp, [w] = cluster(1)
    call = cp.stub.Generate(common_pb2.GenerateRequest(text="hang"))
    assert next(call).HasField("started")
    call.cancel()
    assert w.servicer.cancelled.wait(5)
    assert wait_until(lambda: workers_of(cp)["w1"].in_flight == 0)
    assert workers_of(cp)["w1"].state == "alive"


def test_missing_adapter_is_loaded_before_decode(cluster, adapters_dir):
    cp, [w] = cluster(1)
    sea = upload(cp.stub, adapters_dir / "sea.gguf")
    # The worker lost the adapter and the control plane knows it (e.g. a push failed).
    w.servicer.adapters.clear()
    [handle] = cp.state.pool.live()
    handle.adapter_ids.clear()
    generate(cp, "hello", {sea.id: 1.0})
    assert w.servicer.adapters == {sea.id: sea.sha256}


def test_affinity_prefers_the_worker_that_served_the_same_set(cluster, adapters_dir):
    cp, [w1, w2] = cluster(2)
    upload(cp.stub, adapters_dir / "sea.gguf")
    held = cp.stub.Generate(common_pb2.GenerateRequest(text="hang", adapters=common_pb2.AdapterMap()))
    assert next(held).HasField("started")  # set {} now on w1, which has one request in flight
    assert len(w1.servicer.submitted) == 1
    generate(cp, "hello", {0: 1.0})  # a new set goes to the least loaded worker: w2
    assert len(w2.servicer.submitted) == 1
    generate(cp, "hello", {})  # set {} sticks to w1 (1 in flight < 2 slots) though w2 is idle
    assert len(w1.servicer.submitted) == 2
    held.cancel()


def test_client_deadline_bounds_the_worker_call(cluster):
    cp, [w] = cluster(1)
    call = cp.stub.Generate(common_pb2.GenerateRequest(text="hang"), timeout=1.0)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert w.servicer.cancelled.wait(5)
    assert wait_until(lambda: workers_of(cp)["w1"].in_flight == 0)


# -- a worker declared dead while relaying (stopped / hung: no heartbeat, Decode blocked) --------


def test_relays_to_a_worker_declared_dead_are_cut_with_unavailable(cluster):
    """`kill -STOP` of a worker with streams in flight used to leave their clients without a
    byte for as long as it stayed stopped. Here the worker's heartbeats stop and its Decode
    streams block forever: every client gets UNAVAILABLE naming the worker and why once it is
    declared dead (0.6 s), the worker calls are cancelled and in-flight returns to 0."""
    cp, [w] = cluster(1, heartbeat_interval_s=0.2, dead_after_missed=3)
    calls = [cp.stub.Generate(common_pb2.GenerateRequest(text="hang", request_id=f"r{i}")) for i in range(3)]
    for call in calls:
        assert next(call).HasField("started")
    assert workers_of(cp)["w1"].in_flight == 3
    w.leave()  # heartbeats stop; the server keeps every Decode blocked
    started = time.monotonic()
    errors = []
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:
            next(call)
        errors.append(info.value)
    took = time.monotonic() - started
    assert took < 0.6 + 5.0, f"clients were cut {took:.1f} s after the last heartbeat"
    for i, err in enumerate(errors):
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "worker w1 declared dead (no heartbeat for" in err.details()
        assert f"while relaying request r{i}" in err.details()
    assert wait_until(lambda: w.servicer.n_cancelled == 3)
    info = workers_of(cp)["w1"]
    assert (info.state, info.in_flight) == ("dead", 0)
    w.join()  # back: routable again, its accounting exact
    assert len(generate(cp, "hello")) == 4
    assert workers_of(cp)["w1"].in_flight == 0


def test_a_request_cut_before_its_first_event_is_retried_on_a_live_worker(cluster):
    """Nothing relayed yet when its worker is declared dead: the router's rule for failures
    before the first event sends the request to another live worker."""
    cp, [w1, w2] = cluster(2, heartbeat_interval_s=0.2, dead_after_missed=3)
    w1.servicer.stall = True  # w1 (first pick: both idle, by id) accepts and sends nothing
    result: list = []
    thread = threading.Thread(target=lambda: result.append(generate(cp, "hello")), daemon=True)
    thread.start()
    assert wait_until(lambda: len(w1.servicer.submitted) == 1)
    w1.leave()
    thread.join(0.6 + 5.0)
    assert not thread.is_alive(), "the request stayed on the stopped worker"
    [events] = result
    assert [e.WhichOneof("event") for e in events] == ["started", "token", "token", "finished"]
    assert len(w2.servicer.submitted) == 1 and w1.servicer.cancelled.wait(5)
    states = {k: (v.state, v.in_flight) for k, v in workers_of(cp).items()}
    assert states == {"w1": ("dead", 0), "w2": ("alive", 0)}


@pytest.mark.slow
def test_one_failed_stream_leaves_the_workers_other_streams_alone(cluster):
    """One stream of a worker fails mid-stream (the worker is marked failed until its next
    heartbeat): its other streams are not cut, since the worker still heartbeats; only
    silence (`test_relays_to_a_worker_declared_dead_are_cut_with_unavailable`) cuts them."""
    cp, [w] = cluster(1, heartbeat_interval_s=0.2, dead_after_missed=3)
    held = cp.stub.Generate(common_pb2.GenerateRequest(text="hang", request_id="held"))
    assert next(held).HasField("started")
    with pytest.raises(grpc.RpcError):
        generate(cp, "fail")
    time.sleep(1.5)  # several watchdog passes and heartbeats
    assert not held.done()
    assert workers_of(cp)["w1"].in_flight == 1
    held.cancel()
    assert w.servicer.cancelled.wait(5)
    assert wait_until(lambda: workers_of(cp)["w1"].in_flight == 0)


def test_http_clients_of_a_worker_declared_dead_get_503_or_an_error_event(cluster):
    """The HTTP front over the same router: a request cut before its first token is a 503 with
    ``Retry-After`` in OpenAI's error shape; a stream cut after it ends with the ``data:
    {"error": …}`` event and ``[DONE]``; both name the worker."""
    cp, [w] = cluster(1, heartbeat_interval_s=0.2, dead_after_missed=3, http_addr="127.0.0.1:0")
    with httpx.Client(base_url=f"http://127.0.0.1:{cp.state.http_port}", timeout=30) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        results: dict[str, object] = {}

        def before_first_token() -> None:
            results["json"] = http.post("/v1/completions", json={"model": model, "prompt": "hang", "max_tokens": 4})

        def streamed() -> None:
            body = {"model": model, "prompt": "token then hang", "max_tokens": 4, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                results["sse"] = (r.status_code, [line for line in r.iter_lines() if line])

        threads = [threading.Thread(target=fn, daemon=True) for fn in (before_first_token, streamed)]
        for t in threads:
            t.start()
        assert wait_until(lambda: workers_of(cp)["w1"].in_flight == 2)
        w.leave()
        for t in threads:
            t.join(0.6 + 5.0)
        assert not any(t.is_alive() for t in threads), "an HTTP client stayed on the stopped worker"
    r = results["json"]
    assert isinstance(r, httpx.Response)
    assert r.status_code == 503 and r.headers["retry-after"]
    error = r.json()["error"]
    assert error["type"] == "service_unavailable" and "worker w1 declared dead" in error["message"]
    status, lines = results["sse"]
    assert status == 200 and lines[-1] == "data: [DONE]"
    event = json.loads(lines[-2][len("data: ") :])
    assert "worker w1 declared dead (no heartbeat for" in event["error"]["message"]
    assert wait_until(lambda: workers_of(cp)["w1"].in_flight == 0)
