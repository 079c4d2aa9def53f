"""No open door for workers: the worker secret by default, caps and deadlines on FetchAdapter.

A real control plane in this process (``start_control_plane``), real sockets, raw gRPC callers
playing outsiders, and the scripted worker of ``tests/helpers/scripted_worker.py`` (no model):

- without a worker secret, RegisterWorker / Heartbeat / FetchAdapter are refused
  UNAUTHENTICATED with a message saying what to configure, and an outsider gets no adapter
  bytes; ``insecure_workers`` (``--insecure-workers``) opens them as before;
- a flood of unauthenticated membership calls never gets the real worker declared dead;
- 100 stalled FetchAdapter readers (insiders, with the secret) leave health and reads
  answering, and the stalled calls are cut off after the stall timeout.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import structlog
import structlog.testing
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraplane.env import ENV_WORKER_SECRET
from loraplane.process import stop_process
from loraplane.v1 import common_pb2 as pb
from loraplane.v1 import control_plane_pb2_grpc, membership_pb2, membership_pb2_grpc
from loraplane.worker_secret import WORKER_SECRET_KEY
from tests.helpers.control_plane import MiB, upload
from tests.helpers.live_servers import WORKER_SECRET
from tests.helpers.serve import free_port

ROOT = Path(__file__).resolve().parents[2]
HINT = "--worker-secret or $LORAPLANE_WORKER_SECRET"


def _worker(monkeypatch, cp_addr: str, *, secret: str | None, wait: bool = True, **kw):
    """A scripted worker (``tests/helpers/scripted_worker.py``) presenting ``secret``."""
    from tests.helpers.scripted_worker import ScriptedMember

    if wait:
        return ScriptedMember("w1", cp_addr, secret=secret, **kw)
    monkeypatch.setattr(ScriptedMember, "join", lambda self: None)
    w = ScriptedMember("w1", cp_addr, secret=secret, **kw)
    monkeypatch.undo()
    return w


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def _fetch(stub, sha256: str, metadata=None, timeout: float = 10.0) -> tuple[bytes, grpc.RpcError | None]:
    """Every byte FetchAdapter streams before it ends, and the error it ends with (None: OK)."""
    data = b""
    try:
        for chunk in stub.FetchAdapter(
            membership_pb2.FetchAdapterRequest(sha256=sha256, worker_id="outsider"),
            metadata=metadata,
            timeout=timeout,
        ):
            data += chunk.data
    except grpc.RpcError as exc:
        return data, exc
    return data, None


def test_without_a_secret_worker_rpcs_are_refused_saying_what_to_do(start_control_plane, fixtures_dir, monkeypatch):
    monkeypatch.delenv(ENV_WORKER_SECRET, raising=False)
    cp = start_control_plane(worker_secret=None, heartbeat_interval_s=0.2)
    sea = upload(cp.stub, fixtures_dir / "adapters" / "sea.gguf")  # admin calls stay as they were
    hello = membership_pb2.WorkerHello(worker_id="w1", addr="127.0.0.1:9", n_slots=4)
    for md in (None, [(WORKER_SECRET_KEY, "anything")]):
        for call in (cp.membership_stub.RegisterWorker, cp.membership_stub.Heartbeat):
            with pytest.raises(grpc.RpcError) as info:
                call(hello, metadata=md, timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert HINT in info.value.details() and "--insecure-workers" in info.value.details()
        data, err = _fetch(cp.membership_stub, sea.sha256, md)
        assert data == b"" and err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert HINT in err.details()
    # a real worker without a secret does not get in either
    w = _worker(monkeypatch, cp.addr, secret=None, wait=False)
    try:
        w.stop_event = threading.Event()
        from worker.rpc.membership import MembershipBackoff, start_membership

        w.thread = start_membership(cp.addr, w.hello, w.stop_event, backoff=MembershipBackoff(initial_s=0.05))
        assert not w.thread.registered.wait(0.5)
        assert list(cp.stub.ListWorkers(pb.Empty()).workers) == []
    finally:
        w.close()


def test_start_up_log_says_workers_cannot_join(start_control_plane, monkeypatch):
    monkeypatch.delenv(ENV_WORKER_SECRET, raising=False)
    with structlog.testing.capture_logs() as logs:
        start_control_plane(worker_secret=None)
    [entry] = [e for e in logs if e["event"] == "workers_cannot_join"]
    assert entry["log_level"] == "warning" and HINT in entry["reason"]


def test_insecure_workers_opens_the_door_as_before(start_control_plane, fixtures_dir, monkeypatch):
    monkeypatch.delenv(ENV_WORKER_SECRET, raising=False)
    with structlog.testing.capture_logs() as logs:
        cp = start_control_plane(worker_secret=None, insecure_workers=True, heartbeat_interval_s=0.2)
    [entry] = [e for e in logs if e["event"] == "insecure_workers"]
    assert entry["log_level"] == "warning" and "trusted network" in entry["warning"]
    sea = upload(cp.stub, fixtures_dir / "adapters" / "sea.gguf")
    data, err = _fetch(cp.membership_stub, sea.sha256)
    assert err is None and hashlib.sha256(data).hexdigest() == sea.sha256
    w = _worker(monkeypatch, cp.addr, secret=None)  # joins without a secret
    try:
        [info] = cp.stub.ListWorkers(pb.Empty()).workers
        assert (info.worker_id, info.state) == ("w1", "alive")
    finally:
        w.close()


def test_with_a_secret_an_outsider_gets_no_adapter_bytes(start_control_plane, fixtures_dir):
    cp = start_control_plane()  # the fixture's worker secret
    sea = upload(cp.stub, fixtures_dir / "adapters" / "sea.gguf")
    for md in (None, [(WORKER_SECRET_KEY, "wrong")], [("authorization", f"Bearer {WORKER_SECRET}")]):
        data, err = _fetch(cp.membership_stub, sea.sha256, md)
        assert data == b"" and err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED, md
    data, err = _fetch(cp.worker_stub, sea.sha256)
    assert err is None and hashlib.sha256(data).hexdigest() == sea.sha256


@pytest.mark.slow
def test_unauthenticated_membership_flood_never_gets_the_real_worker_declared_dead(start_control_plane, monkeypatch):
    cp = start_control_plane(heartbeat_interval_s=0.2, dead_after_missed=3)
    w = _worker(monkeypatch, cp.addr, secret=WORKER_SECRET)
    stop = threading.Event()
    codes: list[grpc.StatusCode] = []

    def flood(i: int) -> None:
        ch = grpc.insecure_channel(cp.addr)
        stub = membership_pb2_grpc.WorkerMembershipStub(ch)
        # the real worker's own id: the flood impersonates it
        hello = membership_pb2.WorkerHello(worker_id="w1", addr=f"127.0.0.1:{9 + i}", n_slots=4)
        while not stop.is_set():
            for call in (stub.Heartbeat, stub.RegisterWorker):
                try:
                    call(hello, timeout=5)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())
        ch.close()

    states: set[str] = set()
    try:
        with futures.ThreadPoolExecutor(24) as pool:
            for i in range(24):
                pool.submit(flood, i)
            t_end = time.monotonic() + 1.8  # three times dead_after (0.6 s)
            while time.monotonic() < t_end:
                states.update(x.state for x in cp.stub.ListWorkers(pb.Empty(), timeout=5).workers)
                time.sleep(0.05)
            stop.set()
        assert states == {"alive"}
        assert len(codes) > 50 and set(codes) == {grpc.StatusCode.UNAUTHENTICATED}
        [info] = cp.stub.ListWorkers(pb.Empty()).workers
        assert (info.addr, info.state) == (w.hello.addr, "alive")
    finally:
        stop.set()
        w.close()


@pytest.mark.slow
def test_100_stalled_fetch_readers_leave_health_and_reads_answering_and_are_cut_off(
    start_control_plane, fixtures_dir, monkeypatch
):
    cp = start_control_plane(heartbeat_interval_s=0.2, dead_after_missed=10, fetch_stall_timeout_s=1.0)
    big = upload(cp.stub, fixtures_dir / "adapters" / "shout_embd.gguf")  # 10.9 MB
    w = _worker(monkeypatch, cp.addr, secret=WORKER_SECRET)
    md = [(WORKER_SECRET_KEY, WORKER_SECRET)]
    # one connection per reader, BDP probing off: the transport takes ~64 KiB, not MiBs, so
    # each admitted call stalls after one chunk (what an attacker would do)
    options = [
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.max_receive_message_length", 64 * MiB),
    ]
    channels = [grpc.insecure_channel(cp.addr, options=options) for _ in range(100)]
    try:
        req = membership_pb2.FetchAdapterRequest(sha256=big.sha256, worker_id="stalled")
        calls = [membership_pb2_grpc.WorkerMembershipStub(ch).FetchAdapter(req, metadata=md) for ch in channels]
        stalled, refused = [], []
        for call in calls:  # read one chunk (or the refusal), then stop reading
            try:
                assert len(next(call).data) == MiB
                stalled.append(call)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                assert "adapter fetch" in exc.details() and "--max-fetches" in exc.details()
                refused.append(call)
        assert len(stalled) == 4 and len(refused) == 96  # the default cap
        health = health_pb2_grpc.HealthStub(cp.channel)
        worst = 0.0
        for _ in range(10):  # while the 4 stall
            t = time.monotonic()
            assert (
                health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                == health_pb2.HealthCheckResponse.SERVING
            )
            assert big.id in [a.id for a in cp.stub.ListAdapters(pb.Empty(), timeout=5).adapters]
            worst = max(worst, time.monotonic() - t)
        assert worst < 5.0
        # a worker's fetch meanwhile: RESOURCE_EXHAUSTED (cap taken), retried with backoff
        # until the stalled calls are cut off (CANCELLED) after the 1 s stall timeout...
        from worker.rpc.fetch import ControlPlaneFetcher

        fetcher = ControlPlaneFetcher(cp.addr, "w1", secret=WORKER_SECRET, timeout_s=30, attempts=8)
        try:
            assert hashlib.sha256(b"".join(fetcher(big.sha256))).hexdigest() == big.sha256
        finally:
            fetcher.close()
        assert _wait_for(lambda: cp.state.fetch_watchdog.cut_off == 4, 15.0)
        for call in stalled:
            with pytest.raises(grpc.RpcError) as info:
                for _ in call:  # what the transport had taken before the cut
                    pass
            assert info.value.code() == grpc.StatusCode.CANCELLED
        # ...and their threads and permits are back: a fetch gets every byte
        data, err = _fetch(cp.worker_stub, big.sha256)
        assert err is None and hashlib.sha256(data).hexdigest() == big.sha256
        [info] = cp.stub.ListWorkers(pb.Empty()).workers
        assert info.state == "alive"  # fetches have their own cap: heartbeats got through
    finally:
        for ch in channels:
            ch.close()
        w.close()


def test_a_reader_slower_than_the_minimum_rate_is_cut_off_after_the_grace():
    from control_plane.stall import StallWatchdog

    dog = StallWatchdog(30.0, min_rate_bytes_s=64 * MiB, grace_s=0.5)  # the stall rule never fires
    ended: list[str] = []

    class Slow(membership_pb2_grpc.WorkerMembershipServicer):
        def FetchAdapter(self, request, context):
            try:
                for piece in dog.stream(context, (b"x" * MiB for _ in range(200)), "slow reader"):
                    yield pb.AdapterChunk(data=piece)
                ended.append("finished")
            except GeneratorExit:
                ended.append("closed")
                raise

    server = grpc.server(futures.ThreadPoolExecutor(2))
    membership_pb2_grpc.add_WorkerMembershipServicer_to_server(Slow(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.http2.bdp_probe", 0)])
    try:
        call = membership_pb2_grpc.WorkerMembershipStub(ch).FetchAdapter(membership_pb2.FetchAdapterRequest())
        t0, got = time.monotonic(), 0
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:  # one chunk every 0.1 s: ~10 MiB/s, under the 64 MiB/s minimum
                got += 1
                time.sleep(0.1)
        assert info.value.code() == grpc.StatusCode.CANCELLED
        assert time.monotonic() - t0 < 10.0 and got < 100
        assert _wait_for(lambda: ended == ["closed"], 5.0) and dog.cut_off == 1
    finally:
        ch.close()
        server.stop(None)


class _Context:
    """What `StallWatchdog` calls on a servicer context."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


def test_stall_watchdog_counts_only_time_spent_sending():
    """A ``Generate`` relay waits on its worker between events (a slow producer): never cut;
    a consumer that does not take the message being sent (a stalled reader): cut after the
    timeout."""
    from control_plane.stall import StallWatchdog

    dog = StallWatchdog(0.3, min_rate_bytes_s=0, kind="generate")

    def slow_producer():
        for i in range(3):
            time.sleep(0.5)  # the next token takes longer than the stall timeout
            yield i

    ctx = _Context()
    assert list(dog.stream(ctx, slow_producer(), "slow producer", size=lambda _: 1)) == [0, 1, 2]
    assert not ctx.cancelled.is_set() and dog.cut_off == 0

    stalled = _Context()
    it = dog.stream(stalled, iter(range(10)), "stalled reader", size=lambda _: 1)
    assert next(it) == 0  # handed to the transport, never taken
    assert stalled.cancelled.wait(5.0)
    assert dog.cut_off == 1
    it.close()


def test_cli_flags():
    from click.testing import CliRunner

    from clients.cli.main import cli

    cp_help = CliRunner().invoke(cli, ["control-plane", "--help"]).output
    for flag in ("--insecure-workers", "--max-fetches", "--fetch-stall-timeout", "--worker-secret"):
        assert flag in cp_help, flag
    serve_help = CliRunner().invoke(cli, ["serve", "--help"]).output
    assert "--max-fetches" in serve_help and "--insecure-workers" not in serve_help  # serve has its secret


# ---- slow: the real `loraplane control-plane` processes ------------------------------------


def _spawn_control_plane(tmp_path, name: str, *flags: str) -> tuple[subprocess.Popen, str]:
    addr = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop(ENV_WORKER_SECRET, None)
    cmd = [
        sys.executable,
        "-m",
        "clients.cli",
        "control-plane",
        "--addr",
        addr,
        "--data-dir",
        str(tmp_path / name),
    ]
    with open(tmp_path / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(
            [*cmd, "--heartbeat-interval", "0.2", *flags],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    return proc, addr


@pytest.mark.slow
def test_control_plane_command_closes_the_door_by_default_and_insecure_workers_opens_it(tmp_path, monkeypatch):
    closed, closed_addr = _spawn_control_plane(tmp_path, "closed")
    opened, open_addr = _spawn_control_plane(tmp_path, "open", "--insecure-workers")
    try:
        for addr in (closed_addr, open_addr):
            with grpc.insecure_channel(addr) as ch:
                grpc.channel_ready_future(ch).result(timeout=120)
        hello = membership_pb2.WorkerHello(worker_id="probe", addr="127.0.0.1:9", n_slots=1)
        with grpc.insecure_channel(closed_addr) as ch:
            with pytest.raises(grpc.RpcError) as info:
                membership_pb2_grpc.WorkerMembershipStub(ch).Heartbeat(hello, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and HINT in info.value.details()
        assert "workers_cannot_join" in (tmp_path / "closed.log").read_text()
        w = _worker(monkeypatch, open_addr, secret=None)  # a worker without a secret joins
        try:
            with grpc.insecure_channel(open_addr) as ch:
                [info] = control_plane_pb2_grpc.ControlPlaneStub(ch).ListWorkers(pb.Empty(), timeout=10).workers
            assert (info.worker_id, info.state) == ("w1", "alive")
        finally:
            w.close()
        assert "insecure_workers" in (tmp_path / "open.log").read_text()
    finally:
        for proc in (closed, opened):
            stop_process(proc, 20)
