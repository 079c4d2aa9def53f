"""The Python client library: request building and error mapping without a server, and every
call against the REAL control plane with one real worker (the shared ``live_server``; admin
checks against ``admin_control_plane``). Wire semantics are shown by what the real system
does: the default set, explicit maps, uploads, server paths, tokens, cancellation."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest

from clients.async_client import AsyncLoraplaneClient
from clients.channel import (
    SERVICE_CONFIG,
    Replicas,
    auth_metadata,
    backoff_before,
    max_attempts,
    parse_addresses,
)
from clients.client import (
    FinishedEvent,
    LoraplaneClient,
    LoraplaneError,
    ServerUnreachable,
    StartedEvent,
    TokenEvent,
)
from clients.results import f32
from clients.wire import generate_request, upload_chunks
from loraplane.v1 import common_pb2, control_plane_pb2_grpc
from tests.helpers.control_plane import write_adapter
from tests.helpers.live_servers import nonzero, restored_default, wait_until

pytestmark = pytest.mark.slow

PROMPT = "Tell me about the weather today."
MiB = 1 << 20


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sha256_of(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def lp(live_server):
    with LoraplaneClient(live_server.addr, timeout=300) as client:
        yield client


@pytest.fixture
def adapters_dir(fixtures_dir):
    return fixtures_dir / "adapters"


@pytest.fixture
def shout(lp, adapters_dir) -> int:
    """shout.gguf's id on the shared server (registered now, or the existing one)."""
    return lp.add_adapter(adapters_dir / "shout.gguf").id


# ---- no server -----------------------------------------------------------------------------


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


def test_upload_chunks_stay_under_grpc_default_limit(fixtures_dir):
    path = fixtures_dir / "adapters" / "shout.gguf"
    chunks = list(upload_chunks(path, name="big"))
    assert chunks[0].name == "big" and not chunks[0].server_path
    assert all(c.ByteSize() < 4 * MiB for c in chunks) and len(chunks) > 1
    assert b"".join(c.data for c in chunks) == path.read_bytes()
    (only,) = upload_chunks(str(path), server_path=True)
    assert only.server_path == str(path) and not only.data


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


def test_missing_upload_file_fails_before_the_call(tmp_path):
    with LoraplaneClient(f"127.0.0.1:{closed_port()}") as client:
        with pytest.raises(FileNotFoundError):
            client.add_adapter(tmp_path / "nope.gguf")


def test_unreachable_closed_port_fails_fast():
    with LoraplaneClient(f"127.0.0.1:{closed_port()}", connect_timeout=10) as client:
        with pytest.raises(ServerUnreachable) as info:
            client.list_adapters()
    assert info.value.code == "UNAVAILABLE"


def test_unreachable_when_not_ready_before_deadline():
    # A TCP listener that never speaks HTTP/2: the channel never becomes READY.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        addr = f"127.0.0.1:{listener.getsockname()[1]}"
        with LoraplaneClient(addr, connect_timeout=0.5) as client:
            with pytest.raises(ServerUnreachable) as info:
                client.list_workers()
    assert "0.5s" in info.value.message


def test_async_unreachable():
    async def scenario():
        async with AsyncLoraplaneClient(f"127.0.0.1:{closed_port()}") as client:
            await client.list_adapters()

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

    relayed = from_rpc_error(
        Err("worker w1 failed: UNAVAILABLE: failed to connect to all addresses; last error: ..."), "a:1"
    )
    assert type(relayed) is LoraplaneError and relayed.code == "UNAVAILABLE"
    local = from_rpc_error(
        Err("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused"), "a:1"
    )
    assert isinstance(local, ServerUnreachable)


# ---- a real control plane, started late ----------------------------------------------------


def test_wait_for_server_waits_for_a_late_server(tmp_path, fixtures_dir, base_model_path):
    from tests.helpers.live_servers import start_control_plane

    addr = f"127.0.0.1:{closed_port()}"
    holder: dict = {}

    def start_late():
        time.sleep(0.5)
        try:
            holder["cp"] = start_control_plane(tmp_path / "data", fixtures_dir / "adapters", base_model_path, addr=addr)
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            holder["error"] = err

    t = threading.Thread(target=start_late)
    t.start()
    try:
        with LoraplaneClient(addr, wait_for_server=True, connect_timeout=120) as client:
            assert client.list_adapters() == []
    finally:
        t.join()
        if "cp" in holder:
            holder["cp"].stop()
    assert "error" not in holder, holder.get("error")


# ---- sync client against the real server --------------------------------------------------


def test_default_set_vs_empty_map_vs_explicit_map(lp, shout):
    """adapters=None → the control plane's default set; {} → the base model; {id: s} →
    exactly that map."""
    with restored_default(lp):
        assert nonzero(lp.set_default({shout: 1.0})) == {shout: 1.0}
        unset = lp.generate(PROMPT, max_tokens=4)
        explicit = lp.generate(PROMPT, adapters={shout: 1.0}, max_tokens=4)
        base = lp.generate(PROMPT, adapters={}, max_tokens=4)
        assert unset.token_ids == explicit.token_ids
        assert base.token_ids != explicit.token_ids
        assert unset.telemetry["adapters"] == [{"id": shout, "scale": 1.0}]
        assert base.telemetry["adapters"] == []
        # shout continues in upper case; the base model does not
        assert unset.text.strip() and unset.text == unset.text.upper()
        assert base.text != base.text.upper()
        # the default set cleared: no map → the base model again
        assert nonzero(lp.set_default({})) == {}
        assert lp.generate(PROMPT, max_tokens=4).token_ids == base.token_ids


def test_generate_collects_everything(lp):
    res = lp.generate("ab", adapters={}, max_tokens=3, logprobs=2, prompt_logprobs=True)
    assert len(res.token_ids) == 3 and res.finish_reason == "length" and res.text
    assert res.prompt_token_ids[0] == 2  # Gemma's BOS, added to a text prompt
    assert len(res.prompt_logprobs) == len(res.prompt_token_ids)
    assert res.prompt_logprobs[0] is None
    assert res.prompt_logprobs[1].token_id == res.prompt_token_ids[1]
    assert res.prompt_logprobs[1].logprob < 0
    for tok, lps in zip(res.token_ids, res.logprobs, strict=False):
        assert lps.token_id == tok and len(lps.top) == 2
        assert lps.top[0].token_id == tok  # greedy: the chosen token is the most likely
        assert 0 >= lps.top[0].logprob >= lps.top[1].logprob
    assert res.telemetry["prompt_tokens"] == len(res.prompt_token_ids)
    assert len(res.telemetry["steps"]) == 3 and res.telemetry["adapters"] == []
    out = res.to_json(include_logprobs=True, include_prompt_logprobs=True)
    assert list(out) == [
        "text",
        "token_ids",
        "prompt_token_ids",
        "finish_reason",
        "telemetry",
        "logprobs",
        "prompt_logprobs",
    ]
    assert set(out["logprobs"][0]) == {"token_id", "logprob", "top"}
    assert out["prompt_logprobs"][0] is None
    assert set(out["prompt_logprobs"][1]) == {"token_id", "logprob"}
    assert "logprobs" not in res.to_json() and "prompt_logprobs" not in res.to_json()


def test_generate_stream_yields_events_in_order(lp):
    events = list(lp.generate_stream(prompt_tokens=[2, 596], adapters={}, max_tokens=2))
    assert isinstance(events[0], StartedEvent) and events[0].prompt_token_ids == (2, 596)
    assert [type(e) for e in events[1:]] == [TokenEvent, TokenEvent, FinishedEvent]
    assert events[1].step["batching"] == "mixed"
    assert events[-1].finish_reason == "length"
    assert events[-1].text == events[1].text + events[2].text


def _in_flight(lp, worker_id: str) -> int:
    return next(w.in_flight for w in lp.list_workers() if w.worker_id == worker_id)


def test_generate_stream_early_close_cancels(lp, live_server):
    before = live_server.worker_stats().tokens_generated
    stream = lp.generate_stream("x", adapters={}, max_tokens=200, ignore_eos=True)
    assert isinstance(next(stream), StartedEvent)
    assert isinstance(next(stream), TokenEvent)
    assert _in_flight(lp, live_server.worker_id) == 1
    stream.close()
    assert wait_until(lambda: _in_flight(lp, live_server.worker_id) == 0)
    assert wait_until(lambda: live_server.worker_stats().slots_busy == 0)
    stopped_at = live_server.worker_stats().tokens_generated
    time.sleep(1.0)  # give a leaked generation a second to show
    after = live_server.worker_stats().tokens_generated
    assert after == stopped_at and after - before < 200


def test_upload_larger_than_4_mib(lp, live_server, adapters_dir):
    path = adapters_dir / "shout.gguf"
    assert path.stat().st_size > 4 * MiB
    info = lp.add_adapter(path, name="shout-upload")
    assert info.sha256 == sha256_of(path) and info.size_bytes > 4 * MiB  # tensor bytes
    stored = Path(info.path)  # the server keeps the uploaded bytes in its data dir
    assert stored.is_relative_to(live_server.data_dir) and sha256_of(stored) == info.sha256
    assert info.arch == "gemma3" and info.alpha == 16.0 and info.ranks == (8,)
    assert info.target_tensors and not info.is_alora
    assert lp.get_adapter(info.id) == info
    assert info.id in {a.id for a in lp.list_adapters()}
    assert lp.add_adapter(path).id == info.id  # same content → same id


def test_register_by_server_path(lp, adapters_dir, tmp_path):
    # shout_rs is registered by server path only (no other test uploads it)
    inside = adapters_dir / "shout_rs.gguf"
    info = lp.add_adapter(str(inside), server_path=True)
    assert info.path == str(inside.resolve()) and info.sha256 == sha256_of(inside)
    assert info.ranks == (16,) and lp.get_adapter(info.id) == info
    assert lp.add_adapter(str(inside), server_path=True).id == info.id

    outside = tmp_path / "sea.gguf"
    shutil.copyfile(adapters_dir / "sea.gguf", outside)
    escaping = f"{adapters_dir}/../README.md"
    for path in (str(outside), escaping):
        with pytest.raises(LoraplaneError) as refused:
            lp.add_adapter(path, server_path=True)
        assert refused.value.code == "PERMISSION_DENIED" and "outside" in refused.value.message
    with pytest.raises(LoraplaneError) as missing:
        lp.add_adapter(str(adapters_dir / "nope.gguf"), server_path=True)
    assert missing.value.code == "NOT_FOUND" and "nope.gguf" in missing.value.message


def test_server_errors_become_loraplane_error(lp, tmp_path):
    unknown = 10**6
    with pytest.raises(LoraplaneError) as info:
        lp.get_adapter(unknown)
    assert info.value.code == "NOT_FOUND" and str(unknown) in info.value.message
    assert not isinstance(info.value, ServerUnreachable)
    with pytest.raises(LoraplaneError) as info:
        lp.generate("x", adapters={unknown: 1.0}, max_tokens=4)
    assert info.value.code == "NOT_FOUND" and str(unknown) in info.value.message
    with pytest.raises(LoraplaneError) as info:
        lp.remove_adapter(unknown)
    assert info.value.code == "NOT_FOUND"
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(LoraplaneError) as info:
        lp.add_adapter(junk)
    assert info.value.code == "INVALID_ARGUMENT"


def test_admin_token_required(admin_control_plane, adapters_dir, monkeypatch):
    cp = admin_control_plane
    monkeypatch.delenv("LORAPLANE_ADMIN_TOKEN", raising=False)
    for token in (None, "wrong-token"):
        with LoraplaneClient(cp.addr, admin_token=token) as client:
            for call in (
                lambda: client.set_default({}),
                lambda: client.add_adapter(adapters_dir / "sea.gguf"),
                lambda: client.remove_adapter(0),
            ):
                with pytest.raises(LoraplaneError) as info:
                    call()
                assert info.value.code == "UNAUTHENTICATED", token
            client.list_adapters()  # reads stay open
            client.get_default()
    with LoraplaneClient(cp.addr, admin_token=cp.admin_token) as client:
        sea = client.add_adapter(str(adapters_dir / "sea.gguf"), server_path=True)
        assert nonzero(client.set_default({})) == {}
    monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN", cp.admin_token)
    with LoraplaneClient(cp.addr) as client:  # the token from the environment
        assert client.add_adapter(str(adapters_dir / "sea.gguf"), server_path=True).id == sea.id


# ---- async client against the real server --------------------------------------------------


def test_async_client(live_server, adapters_dir, tmp_path):
    shout_path = adapters_dir / "shout.gguf"
    tiny = write_adapter(tmp_path / "tiny.gguf", seed=7101)

    async def scenario():
        async with AsyncLoraplaneClient(live_server.addr, timeout=300) as client:
            shout = await client.add_adapter(shout_path)  # > 4 MiB upload
            assert shout.sha256 == sha256_of(shout_path)
            assert shout.id in [a.id for a in await client.list_adapters()]
            saved = nonzero(await client.get_default())
            try:
                assert nonzero(await client.set_default({shout.id: 1.0})) == {shout.id: 1.0}
                assert nonzero(await client.get_default()) == {shout.id: 1.0}
                unset = await client.generate(PROMPT, max_tokens=4)
                explicit = await client.generate(PROMPT, adapters={shout.id: 1.0}, max_tokens=4)
                events = [e async for e in client.generate_stream(PROMPT, adapters={}, max_tokens=4)]
            finally:
                registered = {a.id for a in await client.list_adapters()}
                await client.set_default({i: s for i, s in saved.items() if i in registered})
            assert unset.token_ids == explicit.token_ids
            assert isinstance(events[0], StartedEvent) and isinstance(events[-1], FinishedEvent)
            base_ids = tuple(e.token_id for e in events if isinstance(e, TokenEvent))
            assert base_ids != unset.token_ids

            added = await client.add_adapter(tiny)
            await client.remove_adapter(added.id)
            with pytest.raises(LoraplaneError) as err:
                await client.get_adapter(added.id)
            assert err.value.code == "NOT_FOUND"
            with pytest.raises(LoraplaneError) as err:
                await client.remove_adapter(added.id)
            assert err.value.code == "NOT_FOUND"
            assert (await client.add_adapter(tiny)).id > added.id  # ids are never reused

            stream = client.generate_stream("x", adapters={}, max_tokens=200, ignore_eos=True)
            assert isinstance(await anext(stream), StartedEvent)
            await stream.aclose()
            for _ in range(300):
                workers = await client.list_workers()
                ours = [w for w in workers if w.worker_id == live_server.worker_id]
                if ours and ours[0].in_flight == 0:
                    break
                await asyncio.sleep(0.1)
            assert ours[0].alive and ours[0].in_flight == 0

    asyncio.run(scenario())
    assert wait_until(lambda: live_server.worker_stats().slots_busy == 0)


# ---- several control-plane replicas ---------------------------------------------------------


class _Replica(control_plane_pb2_grpc.ControlPlaneServicer):
    """A scripted control-plane replica: ``dying`` answers every call UNAVAILABLE (after
    reading an upload whole, as a replica that died mid-call); otherwise uploads are kept
    and UnregisterAdapter answers NOT_FOUND (the adapter is already gone)."""

    def __init__(self, dying: bool) -> None:
        self.dying = dying
        self.uploads: list[bytes] = []
        self.calls: list[str] = []

    def RegisterAdapter(self, request_iterator, context):
        data = b"".join(c.data for c in request_iterator)
        self.calls.append("RegisterAdapter")
        if self.dying:
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica going away")
        self.uploads.append(data)
        return common_pb2.AdapterInfo(id=7, sha256=hashlib.sha256(data).hexdigest())

    def UnregisterAdapter(self, request, context):
        self.calls.append("UnregisterAdapter")
        if self.dying:
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica going away")
        context.abort(grpc.StatusCode.NOT_FOUND, f"adapter {request.id} not registered")

    def GetDefaultAdapters(self, request, context):
        self.calls.append("GetDefaultAdapters")
        if self.dying:
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica going away")
        return common_pb2.AdapterMap(entries=[common_pb2.AdapterScale(id=7, scale=0.5)])


@pytest.fixture
def two_replicas():
    from concurrent import futures

    servers, replicas, addrs = [], [], []
    for dying in (True, False):
        replica = _Replica(dying)
        server = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.max_receive_message_length", 64 * MiB)])
        control_plane_pb2_grpc.add_ControlPlaneServicer_to_server(replica, server)
        addrs.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
        replicas.append(replica)
    yield replicas, addrs
    for s in servers:
        s.stop(None)


def test_parse_addresses_and_backoff():
    assert parse_addresses(" a:1, b:2 ,a:1") == ["a:1", "b:2"]
    with pytest.raises(ValueError, match="empty element"):
        parse_addresses("a:1,,b:2")
    assert [max_attempts(n) for n in (1, 2, 3)] == [3, 4, 6]
    assert [backoff_before(i, 2) for i in range(7)] == [0.0, 0.0, 0.2, 0.0, 0.4, 0.0, 0.8]
    r = Replicas(["a", "b", "c"])
    r.failed("b")  # not the preferred one: nothing changes
    assert r.order() == ["a", "b", "c"]
    r.failed("a")
    assert r.order() == ["b", "c", "a"]


def test_upload_is_sent_again_whole_and_unregister_not_found_on_retry_is_done(two_replicas, fixtures_dir):
    (dying, alive), addrs = two_replicas
    path = fixtures_dir / "adapters" / "shout.gguf"  # > 4 MiB: several chunks
    with LoraplaneClient(",".join(addrs)) as lp:
        info = lp.add_adapter(path)
        assert info.id == 7 and info.sha256 == sha256_of(path)
        assert dying.calls == ["RegisterAdapter"] and alive.uploads == [path.read_bytes()]
        assert lp.get_default().entries[0].scale == 0.5  # now starts on the live replica
        assert dying.calls == ["RegisterAdapter"]
    with LoraplaneClient(",".join(addrs)) as lp:
        assert lp.remove_adapter(7) is None  # A: UNAVAILABLE, retry on B: NOT_FOUND → done
    assert dying.calls == ["RegisterAdapter", "UnregisterAdapter"]
    with LoraplaneClient(addrs[1]) as lp, pytest.raises(LoraplaneError) as first_try:
        lp.remove_adapter(7)  # no retry happened: NOT_FOUND is the answer
    assert first_try.value.code == "NOT_FOUND"


def test_unreachable_first_address_moves_on_and_all_unreachable_is_exit_3(two_replicas):
    from click.testing import CliRunner

    from clients.cli.main import cli

    _, addrs = two_replicas
    dead = f"127.0.0.1:{closed_port()}"
    with LoraplaneClient(f"{dead},{addrs[1]}") as lp:
        assert [(e.id, e.scale) for e in lp.get_default().entries] == [(7, 0.5)]
    ok = CliRunner().invoke(cli, ["default", "get", "--json", "--addr", f"{dead},{addrs[1]}"])
    assert ok.exit_code == 0, ok.output
    both_dead = f"{dead},127.0.0.1:{closed_port()}"
    gone = CliRunner().invoke(cli, ["default", "get", "--json", "--addr", both_dead])
    assert gone.exit_code == 3 and json.loads(gone.output)["error"]["code"] == "UNAVAILABLE"
    assert dead in json.loads(gone.output)["error"]["message"]
    bad = CliRunner().invoke(cli, ["default", "get", "--addr", "a:1,,b:2"])
    assert bad.exit_code == 2 and "empty element" in bad.output
