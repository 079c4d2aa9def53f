"""Process hygiene and graceful drain, with real ``loraplane serve`` / worker processes
on loopback over the tiny synthetic Llama of ``tests/helpers/tiny_models.py`` (loads in seconds).

One module-scoped ``serve`` (``--slots 1 --max-loras 1 --max-cpu-loras 2``, a known worker
secret) is shared and replaced in turn, in file order:

- ``kill -9`` of ``serve`` ends its worker (pipe watch) and a new ``serve`` on the same port
  starts with only its own worker;
- a worker-side adapter copy changed on disk is fetched again and the request succeeds;
- the host tier is back at its cap once requests end;
- the control plane's restart count equals the restarts ``serve`` logged (one restarted worker
  killed before it registered), and the killed workers' cache directories are removed;
- SIGTERM drains a worker: its generation completes, health is NOT_SERVING, it is listed
  ``draining``, new requests are refused UNAVAILABLE there and served elsewhere, it exits;
- SIGTERM of ``serve`` drains its worker the same way (last: it ends ``serve``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraplane.env import ENV_WORKER_SECRET
from loraplane.v1 import common_pb2 as pb
from loraplane.v1 import control_plane_pb2_grpc, worker_pb2, worker_pb2_grpc
from loraplane.worker_secret import with_secret
from tests.helpers import tiny_models
from tests.helpers.control_plane import rpc_error, upload
from tests.helpers.live_servers import wait_until as wait_for
from tests.helpers.serve import free_port
from tests.helpers.worker_service import gen
from worker.lora.host_cache import CACHE_DIR_PREFIX, pid_alive

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SECRET = "process-hygiene-test-secret"


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            kids += [int(p) for p in (task / "children").read_text().split()]
    except OSError:
        pass
    return kids


def _env() -> dict[str, str]:
    return {**os.environ, ENV_WORKER_SECRET: SECRET, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def _cache_dirs(pid: int) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"{CACHE_DIR_PREFIX}{pid}-*"))


class TinyServe:
    """``loraplane serve`` over the tiny model at ``addr``, its output in ``log``."""

    def __init__(self, tmp: Path, model: Path, addr: str) -> None:
        self.addr = addr
        self.log = tmp / f"serve-{time.monotonic_ns()}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "clients.cli",
                    "serve",
                    "--addr",
                    addr,
                    "--data-dir",
                    str(tmp / "data"),
                    "--model",
                    str(model),
                    "--device",
                    "cpu",
                    "--slots",
                    "1",
                    "--max-loras",
                    "1",
                    "--max-cpu-loras",
                    "2",
                    "--drain-timeout",
                    "120",  # a ceiling for a loaded test machine, not a timing
                    "--heartbeat-interval",
                    "0.5",
                ],
                cwd=ROOT,
                env=_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.channel = grpc.insecure_channel(addr)
        self.stub = control_plane_pb2_grpc.ControlPlaneStub(self.channel)
        assert wait_for(lambda: self.alive_workers() or self.proc.poll() is not None, 180, 0.2), self.log_tail()
        assert self.proc.poll() is None, self.log_tail()

    def workers(self, state: str | None = None) -> list:
        try:
            listed = self.stub.ListWorkers(pb.Empty(), timeout=2).workers
        except grpc.RpcError:
            return []
        return [w for w in listed if state is None or w.state == state]

    def alive_workers(self) -> list:
        return self.workers("alive")

    def worker_pid(self) -> int:
        [pid] = _children(self.proc.pid)
        return pid

    def log_text(self) -> str:
        return self.log.read_bytes().decode(errors="replace")

    def log_tail(self) -> str:
        return self.log_text()[-3000:]

    def stop(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Holder:
    serve: TinyServe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tiny")
    return {
        "model": tiny_models.model_llama(d / "llama.gguf"),
        **{f"a{i}": tiny_models.adapter("llama", d / f"a{i}.gguf", seed=200 + i) for i in range(1, 7)},
    }


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny):
    tmp = tmp_path_factory.mktemp("hygiene")
    h = Holder()
    h.serve = TinyServe(tmp, tiny["model"], f"127.0.0.1:{free_port()}")
    h.tmp = tmp  # type: ignore[attr-defined]
    yield h
    h.serve.stop()


def _generate(stub, adapters=(), max_tokens: int = 8, text: str = "Hello", timeout: float = 120) -> list:
    return list(stub.Generate(gen("", text=text, adapters=list(adapters), max_tokens=max_tokens), timeout=timeout))


def _finished(events: list) -> pb.Finished:
    assert events and events[-1].HasField("finished"), events[-3:]
    return events[-1].finished


def test_kill_9_of_serve_ends_its_worker_and_the_next_serve_starts_on_the_same_port(served, tiny):
    old = served.serve
    wpid = old.worker_pid()
    old_id = old.alive_workers()[0].worker_id
    os.kill(old.proc.pid, signal.SIGKILL)
    old.proc.wait()
    old.channel.close()
    # the orphan would heartbeat forever (PPID 1) and re-join the next serve; the pipe watch ends it
    orphan_gone = wait_for(lambda: not pid_alive(wpid), 15, 0.1)
    try:
        served.serve = new = TinyServe(served.tmp, tiny["model"], old.addr)
        time.sleep(1.5)  # three heartbeat intervals: an orphan would have re-joined by now
        listed = [w.worker_id for w in new.workers()]
    finally:
        if not orphan_gone:
            os.kill(wpid, signal.SIGKILL)  # keep the next tests independent of this one
    assert orphan_gone, f"worker {wpid} outlived its serve"
    assert listed == [new.alive_workers()[0].worker_id] and old_id not in listed
    assert _finished(_generate(new.stub)).finish_reason in ("length", "stop")


def test_a_local_adapter_copy_changed_on_disk_is_fetched_again(served, tiny):
    s = served.serve
    a1, a2 = upload(s.stub, tiny["a1"]), upload(s.stub, tiny["a2"])
    _finished(_generate(s.stub, [(a1.id, 1.0)]))
    _finished(_generate(s.stub, [(a2.id, 1.0)]))  # a2 takes the one slot: a1 stays on host only
    [cache] = _cache_dirs(s.worker_pid())
    copy = cache / f"{a1.sha256}.gguf"
    data = bytearray(copy.read_bytes())
    data[-64:] = bytes(64)  # tensor bytes at the end: the page-in re-read notices the change
    copy.write_bytes(bytes(data))
    fetches = s.alive_workers()[0].paging.fetches
    assert _finished(_generate(s.stub, [(a1.id, 1.0)])).finish_reason in ("length", "stop")
    assert copy.read_bytes() == tiny["a1"].read_bytes()
    assert wait_for(lambda: s.alive_workers()[0].paging.fetches > fetches, 5)


def test_host_tier_is_trimmed_to_its_cap_when_requests_end(served, tiny):
    s = served.serve
    ids = [upload(s.stub, tiny[f"a{i}"]).id for i in (4, 5, 6)]  # none on the worker yet
    barrier = threading.Barrier(3)
    out: list = []

    def one(aid: int) -> None:
        barrier.wait(10)
        out.append(_finished(_generate(s.stub, [(aid, 1.0)], max_tokens=150)))

    threads = [threading.Thread(target=one, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(out) == 3
    # at rest: at most --max-cpu-loras 2 on host (three were held while the requests ran)
    assert wait_for(lambda: s.alive_workers()[0].paging.host <= 2, 5, 0.1), s.alive_workers()[0].paging


def test_restart_count_equals_the_logged_restarts_and_dead_workers_cache_dirs_go(served):
    s = served.serve
    p1 = s.worker_pid()
    assert _cache_dirs(p1)
    os.kill(p1, signal.SIGKILL)
    assert wait_for(lambda: _children(s.proc.pid) not in ([], [p1]), 15, 0.01), s.log_tail()
    [p2] = _children(s.proc.pid)
    os.kill(p2, signal.SIGKILL)  # restarted, then killed long before it could register
    assert wait_for(lambda: [w.restarts for w in s.alive_workers()] == [2], 90, 0.2), (s.workers(), s.log_tail())
    logged = s.log_text()
    assert "(restart 2)" in logged and "(restart 3)" not in logged
    assert not _cache_dirs(p1) and not _cache_dirs(p2)


def test_sigterm_drains_a_worker_and_the_control_plane_routes_around_it(served, tiny):
    s = served.serve
    log = served.tmp / "w2.log"
    with open(log, "wb") as out:
        w2 = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "clients.cli",
                "worker",
                "--control-plane",
                s.addr,
                "--addr",
                "127.0.0.1:0",
                "--worker-id",
                "drainer",
                "--model",
                str(tiny["model"]),
                "--device",
                "cpu",
                "--slots",
                "1",
                "--drain-timeout",
                "120",
            ],
            cwd=ROOT,
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        assert wait_for(lambda: len(s.alive_workers()) == 2, 120, 0.2), log.read_text()[-2000:]
        addr = next(w.addr for w in s.alive_workers() if w.worker_id == "drainer")
        n = 800
        results: dict[str, list] = {}
        first_token: dict[str, threading.Event] = {k: threading.Event() for k in ("g1", "g2")}

        def long(name: str) -> None:
            events = []
            for ev in s.stub.Generate(gen("", text=name, adapters=[], max_tokens=n), timeout=180):
                events.append(ev)
                first_token[name].set()
            results[name] = events

        # one long generation on each worker (slots 1: the second goes where the first is not)
        threads = [threading.Thread(target=long, args=(k,)) for k in ("g1", "g2")]
        threads[0].start()
        assert first_token["g1"].wait(60)
        threads[1].start()
        assert first_token["g2"].wait(60)
        assert wait_for(lambda: [w.in_flight for w in s.alive_workers()] == [1, 1], 10), s.workers()
        w2.send_signal(signal.SIGTERM)
        assert wait_for(lambda: [w.state for w in s.workers() if w.worker_id == "drainer"] == ["draining"], 10)
        ch = with_secret(grpc.insecure_channel(addr), SECRET)
        try:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            err = rpc_error(
                lambda: list(
                    worker_pb2_grpc.WorkerStub(ch).Decode(
                        iter([worker_pb2.DecodeRequest(submit=gen("late", text="hi", max_tokens=2))]), timeout=10
                    )
                )
            )
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.details()
        finally:
            ch.close()
        # a new request through the control plane is served by the other worker
        assert _finished(_generate(s.stub, max_tokens=2, timeout=120)).finish_reason == "length"
        for t in threads:
            t.join(180)
        for name in ("g1", "g2"):
            tokens = [e for e in results[name] if e.HasField("token")]
            assert _finished(results[name]).finish_reason == "length" and len(tokens) == n, name
        assert w2.wait(60) == 0
        assert "worker_drained" in log.read_text()
    finally:
        if w2.poll() is None:
            w2.kill()
            w2.wait()


def test_sigterm_of_serve_drains_its_worker_then_exits(served):
    s = served.serve
    wpid = s.worker_pid()
    [wid] = [w.worker_id for w in s.alive_workers()]
    n = 800
    events: list = []
    started = threading.Event()

    def long() -> None:
        for ev in s.stub.Generate(gen("", text="drain me", adapters=[], max_tokens=n), timeout=180):
            events.append(ev)
            started.set()

    t = threading.Thread(target=long)
    t.start()
    assert started.wait(60)
    s.proc.send_signal(signal.SIGTERM)
    # the worker drains first, while the control plane still serves and relays its stream
    assert wait_for(lambda: [w.state for w in s.workers() if w.worker_id == wid] == ["draining"], 10, 0.05), (
        s.workers(),
        s.log_tail(),
    )
    t.join(180)
    assert _finished(events).finish_reason == "length"
    assert len([e for e in events if e.HasField("token")]) == n
    assert s.proc.wait(60) == 0
    assert wait_for(lambda: not pid_alive(wpid), 10)
