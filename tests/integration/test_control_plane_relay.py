"""Generate through the control plane to a real worker (``worker.rpc.server.create_server``).

One worker process-wide (loading the model takes a while), a fresh control plane per test;
the worker joins through ``worker.rpc.membership`` like a deployed one, gets its adapters pushed
by the control plane, and decodes the resolved adapters it is sent.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format

from loraplane.v1 import common_pb2, membership_pb2, worker_pb2_grpc
from tests.helpers.control_plane import rpc_error, upload
from tests.helpers.live_servers import WORKER_SECRET
from worker.rpc.membership import MembershipBackoff, start_membership

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def real_worker(base_model_path: Path):
    from worker.config import WorkerConfig
    from worker.rpc.server import create_server

    server, port, engine = create_server(
        WorkerConfig(
            addr="127.0.0.1:0",
            model_path=str(base_model_path),
            n_seqs=2,
            device="cpu",
            n_ctx_seq=512,
            grammar_warmup=False,
        )
    )
    yield port, engine
    server.stop(None).wait()
    engine.close()


@pytest.fixture
def joined(start_control_plane, real_worker, fixtures_dir):
    """``joined(**config) -> (ControlPlane, worker stub)`` with the real worker registered."""
    port, engine = real_worker
    stops: list[threading.Event] = []

    def make(**overrides):
        overrides.setdefault("adapter_dirs", (str(fixtures_dir / "adapters"),))
        overrides.setdefault("heartbeat_interval_s", 0.2)
        overrides.setdefault("dead_after_missed", 10)
        cp = start_control_plane(**overrides)
        from worker.rpc.fetch import ControlPlaneFetcher

        # what serve_worker sets up
        engine.fetcher = ControlPlaneFetcher(cp.addr, engine.worker_id, secret=WORKER_SECRET)
        stop = threading.Event()
        stops.append(stop)
        hello = membership_pb2.WorkerHello(
            worker_id=engine.worker_id, addr=f"127.0.0.1:{port}", model="gemma3", n_slots=2
        )
        thread = start_membership(
            cp.addr, hello, stop, backoff=MembershipBackoff(initial_s=0.05, max_s=0.2), secret=WORKER_SECRET
        )
        assert thread.registered.wait(60)
        return cp, worker_pb2_grpc.WorkerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))

    yield make
    for stop in stops:
        stop.set()


def run(cp, adapters: dict[int, float] | None = None, max_tokens: int = 8):
    req = common_pb2.GenerateRequest(text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
    if adapters is not None:
        req.adapters.SetInParent()
        req.adapters.entries.extend(common_pb2.AdapterScale(id=i, scale=s) for i, s in adapters.items())
    events = list(cp.stub.Generate(req))
    finished = events[-1].finished
    tokens = [e.token.token_id for e in events if e.HasField("token")]
    return tokens, finished


def test_default_set_and_explicit_maps_reach_the_worker_resolved(joined, fixtures_dir):
    adapters = fixtures_dir / "adapters"
    cp, wstub = joined(lora=(str(adapters / "shout.gguf"),))
    upload(cp.stub, adapters / "sea.gguf")
    assert list(wstub.ListAdapters(common_pb2.Empty()).adapters) == []  # nothing pushed

    default_tokens, fin = run(cp)  # no map: the default set, shout@1
    assert [(a.id, a.scale) for a in fin.telemetry.adapters] == [(0, 1.0)]
    # the worker sets adapter 0's id (optional: present), so JSON printers show it
    telemetry = json_format.MessageToDict(fin.telemetry, preserving_proto_field_name=True)
    assert telemetry["adapters"] == [{"id": 0, "scale": 1.0}]
    assert [r["id"] for r in telemetry["adapter_residency"]] == [0]
    assert [json_format.MessageToDict(a)["id"] for a in wstub.ListAdapters(common_pb2.Empty()).adapters] == [0]
    assert fin.finish_reason in ("length", "stop") and len(default_tokens) == 8
    assert run(cp, {0: 1.0})[0] == default_tokens
    base_tokens, fin = run(cp, {})  # an explicit empty map: the base model
    assert list(fin.telemetry.adapters) == [] and base_tokens != default_tokens
    assert fin.text.upper() != fin.text  # the base continues in lower case

    cp.stub.SetDefaultAdapters(common_pb2.AdapterMap())  # everything detached
    assert run(cp)[0] == base_tokens
    run(cp, {1: 1.0})  # sea announced, its bytes fetched by the worker
    held = {a.id: a.sha256 for a in wstub.ListAdapters(common_pb2.Empty()).adapters}
    listed = {a.id: a.sha256 for a in cp.stub.ListAdapters(common_pb2.Empty()).adapters}
    assert held == listed  # both known now, by the content the control plane registered
    st = wstub.Stats(common_pb2.Empty())
    assert sorted(st.host_adapter_ids) == [0, 1] and st.fetches >= 1


def test_unregister_unloads_from_the_worker(joined, fixtures_dir):
    cp, wstub = joined()
    info = upload(cp.stub, fixtures_dir / "adapters" / "sea.gguf")
    run(cp, {info.id: 1.0})  # announces it to the worker (nothing is pushed at registration)
    assert info.id in {a.id for a in wstub.ListAdapters(common_pb2.Empty()).adapters}
    assert info.id in wstub.Stats(common_pb2.Empty()).resident_adapter_ids
    cp.stub.UnregisterAdapter(common_pb2.AdapterRef(id=info.id))
    assert info.id not in {a.id for a in wstub.ListAdapters(common_pb2.Empty()).adapters}
    err = rpc_error(run, cp, {info.id: 1.0})
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_client_deadlines_never_take_the_worker_out_of_routing(joined):
    # a client whose own deadline expires while the relay runs is not a failing worker: a
    # stream of 3 ms deadlines used to mark the only worker dead ("no live worker") for everyone
    cp, wstub = joined()
    req = common_pb2.GenerateRequest(text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=400, ignore_eos=True))
    codes = set()
    for i in range(60):
        try:
            list(cp.stub.Generate(req, timeout=0.002 + 0.001 * (i % 20)))
        except grpc.RpcError as exc:
            codes.add(exc.code())
        assert [w.state for w in cp.stub.ListWorkers(common_pb2.Empty()).workers] == ["alive"], i
    assert codes == {grpc.StatusCode.DEADLINE_EXCEEDED}
    tokens, finished = run(cp, max_tokens=2)
    assert len(tokens) == 2 and finished.finish_reason == "length"


def test_client_cancel_frees_the_worker_slot(joined):
    cp, wstub = joined()
    req = common_pb2.GenerateRequest(
        text=PROMPT,
        adapters=common_pb2.AdapterMap(),
        sampling=common_pb2.SamplingParams(max_tokens=400, ignore_eos=True),
    )
    call = cp.stub.Generate(req)
    for event in call:
        if event.HasField("token"):
            break
    call.cancel()
    deadline = time.monotonic() + 20
    while wstub.Stats(common_pb2.Empty()).slots_busy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert wstub.Stats(common_pb2.Empty()).slots_busy == 0
    assert {w.worker_id: w.in_flight for w in cp.stub.ListWorkers(common_pb2.Empty()).workers} == {
        wstub.Stats(common_pb2.Empty()).worker_id: 0
    }
