"""The Python client library against an in-memory fake control plane (no model needed)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import grpc
import pytest

from clients.channel import SERVICE_CONFIG, auth_metadata
from clients.client import (
    AsyncLoraplaneClient,
    FinishedEvent,
    LoraplaneClient,
    LoraplaneError,
    ServerUnreachable,
    StartedEvent,
    TokenEvent,
)
from clients.results import f32
from clients.wire import UPLOAD_CHUNK_BYTES, generate_request
from tests.fake_control_plane import start_fake


@pytest.fixture
def fake():
    server, servicer, addr = start_fake()
    yield servicer, addr
    server.stop(None)


@pytest.fixture
def gguf_file(tmp_path):
    def make(size: int, name: str = "a.gguf"):
        path = tmp_path / name
        path.write_bytes(b"GGUF" + bytes(i % 251 for i in range(size - 4)))
        return path

    return make


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- wire ----------------------------------------------------------------------------------


def test_adapter_map_none_and_empty_differ_on_the_wire():
    unset = generate_request("hi", adapters=None)
    empty = generate_request("hi", adapters={})
    assert not type(unset).FromString(unset.SerializeToString()).HasField("adapters")
    decoded = type(empty).FromString(empty.SerializeToString())
    assert decoded.HasField("adapters") and len(decoded.adapters.entries) == 0


def test_generate_request_validates():
    with pytest.raises(ValueError):
        generate_request("a", prompt_tokens=[1])
    with pytest.raises(ValueError):
        generate_request(None)
    with pytest.raises(ValueError):
        generate_request("a", adapters={-1: 1.0})
    with pytest.raises(ValueError):
        generate_request("a", adapters={0: float("nan")})
    req = generate_request(prompt_tokens=[5, 6], seed=3)
    assert list(req.tokens.ids) == [5, 6] and req.sampling.HasField("seed")
    assert not generate_request("a").sampling.HasField("seed")


def test_f32_shortest():
    assert f32(0.30000001192092896) == 0.3
    assert f32(-1.25) == -1.25


def test_service_config_retries_only_reads():
    names = {n["method"] for n in SERVICE_CONFIG["methodConfig"][0]["name"]}
    assert names == {"ListAdapters", "GetAdapter", "GetDefaultAdapters", "ListWorkers"}
    json.dumps(SERVICE_CONFIG)


def test_auth_metadata_from_env(monkeypatch):
    monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN", "s3cret")
    assert auth_metadata(None) == (("authorization", "Bearer s3cret"),)
    assert auth_metadata("x") == (("authorization", "Bearer x"),)
    monkeypatch.delenv("LORAPLANE_ADMIN_TOKEN")
    assert auth_metadata(None) == ()


# ---- sync client ---------------------------------------------------------------------------


def test_generate_default_set_vs_empty_vs_map(fake, gguf_file):
    servicer, addr = fake
    with LoraplaneClient(addr) as lp:
        a0 = lp.add_adapter(gguf_file(100, "x.gguf"))
        a1 = lp.add_adapter(gguf_file(200, "y.gguf"))
        lp.set_default({a1.id: 0.5})
        lp.generate("hi", max_tokens=2)
        lp.generate("hi", adapters={}, max_tokens=2)
        res = lp.generate("hi", adapters={a0.id: 1.0, a1.id: 0.25}, max_tokens=2)
    unset, empty, mapped = servicer.received.generate
    assert not unset.HasField("adapters")
    assert empty.HasField("adapters") and not empty.adapters.entries
    assert [(e.id, e.scale) for e in mapped.adapters.entries] == [(0, 1.0), (1, 0.25)]
    assert res.telemetry["adapters"] == [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.25}]


def test_generate_collects_everything(fake):
    _, addr = fake
    with LoraplaneClient(addr) as lp:
        res = lp.generate("ab", max_tokens=3, logprobs=2, prompt_logprobs=True)
    assert res.text == "<t100><t101><t102>"
    assert res.token_ids == (100, 101, 102)
    assert res.prompt_token_ids == (2, 97, 98)
    assert res.finish_reason == "length"
    assert res.prompt_logprobs[0] is None and res.prompt_logprobs[2].logprob == -1.0
    assert [t.token_id for t in res.logprobs[0].top] == [100, 101]
    assert res.telemetry["prompt_tokens"] == 3 and len(res.telemetry["steps"]) == 3
    out = res.to_json(include_logprobs=True, include_prompt_logprobs=True)
    assert list(out) == ["text", "token_ids", "prompt_token_ids", "finish_reason",
                         "telemetry", "logprobs", "prompt_logprobs"]
    assert out["logprobs"][0] == {"token_id": 100, "logprob": -0.25,
                                  "top": [{"token_id": 100, "logprob": -0.25},
                                          {"token_id": 101, "logprob": -0.5}]}
    assert out["prompt_logprobs"][:2] == [None, {"token_id": 97, "logprob": -0.5}]
    assert "logprobs" not in res.to_json()


def test_generate_stream_yields_events_in_order(fake):
    _, addr = fake
    with LoraplaneClient(addr) as lp:
        events = list(lp.generate_stream(prompt_tokens=[7, 8], max_tokens=2))
    assert isinstance(events[0], StartedEvent) and events[0].prompt_token_ids == (7, 8)
    assert [type(e) for e in events[1:]] == [TokenEvent, TokenEvent, FinishedEvent]
    assert events[1].step["batching"] == "mixed"


def test_generate_stream_early_close_cancels(fake):
    _, addr = fake
    with LoraplaneClient(addr) as lp:
        stream = lp.generate_stream("x", max_tokens=50)
        next(stream)
        stream.close()
        assert lp.list_workers()[0].worker_id == "fake-0"


def test_upload_larger_than_4_mib_is_chunked(fake, gguf_file):
    servicer, addr = fake
    path = gguf_file(9 * (1 << 20) + 123)
    with LoraplaneClient(addr) as lp:
        info = lp.add_adapter(path, name="big")
        again = lp.add_adapter(path)
    chunks = servicer.received.chunks[0]
    assert chunks[0].name == "big" and not chunks[0].server_path
    assert all(len(c.data) <= UPLOAD_CHUNK_BYTES for c in chunks)
    assert len(chunks) == 10
    assert info.size_bytes == path.stat().st_size and info.name == "big"
    assert again.id == info.id


def test_register_by_server_path_sends_no_bytes(fake, gguf_file):
    servicer, addr = fake
    path = gguf_file(64)
    with LoraplaneClient(addr) as lp:
        info = lp.add_adapter(str(path), server_path=True)
    (only,) = servicer.received.chunks[0]
    assert only.server_path == str(path) and not only.data
    assert info.path == str(path)


def test_missing_upload_file_fails_before_the_call(fake, tmp_path):
    _, addr = fake
    with LoraplaneClient(addr) as lp, pytest.raises(FileNotFoundError):
        lp.add_adapter(tmp_path / "nope.gguf")


def test_server_errors_become_loraplane_error(fake):
    _, addr = fake
    with LoraplaneClient(addr) as lp:
        with pytest.raises(LoraplaneError) as info:
            lp.get_adapter(42)
        assert info.value.code == "NOT_FOUND" and "42" in info.value.message
        assert not isinstance(info.value, ServerUnreachable)
        with pytest.raises(LoraplaneError) as info:
            lp.generate("x", adapters={9: 1.0})
        assert info.value.code == "NOT_FOUND"


def test_admin_token_sent_as_bearer_metadata(gguf_file):
    server, servicer, addr = start_fake(admin_token="tok")
    try:
        with LoraplaneClient(addr) as lp, pytest.raises(LoraplaneError) as info:
            lp.set_default({})
        assert info.value.code == "UNAUTHENTICATED"
        with LoraplaneClient(addr, admin_token="tok") as lp:
            assert lp.set_default({}).entries == ()
            lp.list_adapters()
        assert ("authorization", "Bearer tok") in servicer.received.metadata["ListAdapters"]
    finally:
        server.stop(None)


def test_unreachable_closed_port_fails_fast():
    with LoraplaneClient(f"127.0.0.1:{closed_port()}", connect_timeout=10) as lp:
        with pytest.raises(ServerUnreachable) as info:
            lp.list_adapters()
    assert info.value.code == "UNAVAILABLE"


def test_unreachable_when_not_ready_before_deadline():
    # A TCP listener that never speaks HTTP/2: the channel never becomes READY.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        addr = f"127.0.0.1:{listener.getsockname()[1]}"
        with LoraplaneClient(addr, connect_timeout=0.5) as lp:
            with pytest.raises(ServerUnreachable) as info:
                lp.list_workers()
    assert "0.5s" in info.value.message


def test_wait_for_server_waits_for_a_late_server():
    port = closed_port()
    addr = f"127.0.0.1:{port}"
    holder = {}

    def start_late():
        import time

        time.sleep(0.5)
        from concurrent import futures

        from loraplane.v1 import control_plane_pb2_grpc
        from tests.fake_control_plane import FakeControlPlane

        srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        control_plane_pb2_grpc.add_ControlPlaneServicer_to_server(FakeControlPlane(), srv)
        srv.add_insecure_port(addr)
        srv.start()
        holder["server"] = srv

    t = threading.Thread(target=start_late)
    t.start()
    try:
        with LoraplaneClient(addr, wait_for_server=True, connect_timeout=20) as lp:
            assert lp.list_adapters() == []
    finally:
        t.join()
        holder["server"].stop(None)


# ---- async client --------------------------------------------------------------------------


def test_async_client(fake, gguf_file):
    servicer, addr = fake
    path = gguf_file(5 * (1 << 20))

    async def scenario():
        async with AsyncLoraplaneClient(addr) as lp:
            info = await lp.add_adapter(path)
            assert [a.id for a in await lp.list_adapters()] == [info.id]
            assert (await lp.set_default({info.id: 1.0})).as_dict() == {info.id: 1.0}
            assert (await lp.get_default()).to_json() == {"adapters": [{"id": 0, "scale": 1.0}]}
            events = [e async for e in lp.generate_stream("hi", adapters={}, max_tokens=2)]
            assert isinstance(events[-1], FinishedEvent)
            res = await lp.generate("hi", max_tokens=2)
            with pytest.raises(LoraplaneError) as info_err:
                await lp.remove_adapter(99)
            assert info_err.value.code == "NOT_FOUND"
            await lp.remove_adapter(info.id)
            assert (await lp.list_workers())[0].alive
            return res

    res = asyncio.run(scenario())
    assert res.token_ids == (100, 101)  # default set {0: 1.0} → offset 0
    assert len(servicer.received.chunks[0]) == 5
    assert servicer.received.generate[0].HasField("adapters")
    assert not servicer.received.generate[-1].HasField("adapters")


def test_async_unreachable():
    async def scenario():
        async with AsyncLoraplaneClient(f"127.0.0.1:{closed_port()}") as lp:
            await lp.list_adapters()

    with pytest.raises(ServerUnreachable):
        asyncio.run(scenario())


def test_relayed_worker_failure_is_a_refusal_not_unreachable():
    from clients.errors import from_rpc_error

    class Err(grpc.RpcError):
        def __init__(self, details):
            self._details = details

        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return self._details

    relayed = from_rpc_error(Err("worker w1 failed: UNAVAILABLE: failed to connect to all "
                                 "addresses; last error: ..."), "a:1")
    assert type(relayed) is LoraplaneError and relayed.code == "UNAVAILABLE"
    local = from_rpc_error(Err("failed to connect to all addresses; last error: "
                               "UNKNOWN: ipv4:127.0.0.1:1: Connection refused"), "a:1")
    assert isinstance(local, ServerUnreachable)
