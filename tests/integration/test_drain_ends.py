"""A draining worker always ends, with real ``loraplane serve`` / worker processes on loopback
over the tiny synthetic Gemma 2 of ``tests/helpers/tiny_models.py`` (its 32k vocabulary loads fastest):

- a SIGTERM to ``serve``'s process group drains its worker (the worker is not also signalled
  by the group, so ``serve``'s SIGTERM is its first signal, not its second); ``kill -9`` of
  ``serve`` in the middle of that drain, streams in flight, ends the worker at once;
- a draining worker whose stderr nobody reads any more (the pipe is full: every log line
  blocks, as with a stalled log shipper) still ends by its drain timeout, and at once on a
  second signal or when ``serve`` dies — the kernel's deadline (SIGALRM) ends it when the
  orderly stop is stuck;
- the parent watch sees ``serve`` gone even when another process holds the pipe's write end
  (a child ``serve`` forked): the worker was re-parented.

Each check starts its own processes; the stderr of each goes through `StallablePipe`.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraplane.v1 import common_pb2 as pb
from loraplane.v1 import control_plane_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.helpers import tiny_models
from tests.helpers.live_servers import wait_until
from tests.helpers.serve import free_port
from tests.helpers.worker_service import gen
from worker.lora.host_cache import pid_alive

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STOP_GRACE_S = 5.0  # the worker's kernel deadline after a second signal / serve's death
KILLED_BY_DEADLINE = -signal.SIGALRM  # Popen's return code of a process the deadline ended


class StallablePipe:
    """The processes' stdout/stderr: a one-page pipe pumped into ``path`` until `stall`, which
    stops reading and fills it, so every later write blocks — a log consumer that stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.read_fd, self.write_fd = os.pipe()
        fcntl.fcntl(self.write_fd, fcntl.F_SETPIPE_SZ, 4096)
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._run, daemon=True)
        self._pump.start()

    def _run(self) -> None:
        import select

        with open(self.path, "ab") as out:
            while not self._stop.is_set():
                if select.select([self.read_fd], [], [], 0.05)[0]:
                    data = os.read(self.read_fd, 65536)
                    if not data:
                        return
                    out.write(data)
                    out.flush()

    def stall(self) -> None:
        """Stop reading and fill the pipe: the next write of any process to it blocks."""
        self._stop.set()
        self._pump.join(5)
        # a description of our own: O_NONBLOCK on the shared one would reach the children too
        fd = os.open(f"/proc/self/fd/{self.write_fd}", os.O_WRONLY | os.O_NONBLOCK)
        try:
            for size in (512, 1):
                while True:
                    try:
                        os.write(fd, b"x" * size)
                    except BlockingIOError:
                        break
        finally:
            os.close(fd)

    def close(self) -> None:
        """Close both ends (a process still blocked on the pipe then gets EPIPE)."""
        self._stop.set()
        self._pump.join(5)
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass

    def text(self) -> str:
        return self.path.read_bytes().decode(errors="replace")[-3000:]


def _cli(args: list[str], pipe: StallablePipe, *, new_session: bool = False) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "clients.cli", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
        stdout=pipe.write_fd,
        stderr=pipe.write_fd,
        stdin=subprocess.DEVNULL,
        start_new_session=new_session,
    )


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            kids += [int(p) for p in (task / "children").read_text().split()]
    except OSError:
        pass
    return kids


class _Stream(threading.Thread):
    """One long generation consumed on a thread; ``tokens`` counts what arrived."""

    def __init__(self, events) -> None:
        super().__init__(daemon=True)
        self.events = events
        self.tokens = 0
        self.error: grpc.RpcError | None = None
        self.start()

    def run(self) -> None:
        try:
            for ev in self.events:
                if ev.HasField("token"):
                    self.tokens += 1
        except grpc.RpcError as exc:
            self.error = exc

    def grows(self, within_s: float = 10.0) -> bool:
        """Whether more tokens arrive within ``within_s`` seconds."""
        seen = self.tokens
        return wait_until(lambda: self.tokens > seen, within_s, 0.05)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return tiny_models.model_gemma2(tmp_path_factory.mktemp("tiny") / "gemma2.gguf")


def _worker(model: Path, pipe: StallablePipe, drain_timeout: float) -> tuple[subprocess.Popen, str]:
    """A standalone worker (no control plane) with one slot, SERVING at the returned address."""
    addr = f"127.0.0.1:{free_port()}"
    args = ["worker", "--addr", addr, "--model", str(model), "--device", "cpu", "--slots", "1"]
    proc = _cli([*args, "--drain-timeout", str(drain_timeout)], pipe)
    with grpc.insecure_channel(addr) as ch:
        health = health_pb2_grpc.HealthStub(ch)

        def serving() -> bool:
            try:
                return (
                    health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                )
            except grpc.RpcError:
                return proc.poll() is not None

        assert wait_until(serving, 120, 0.2) and proc.poll() is None, pipe.text()
    return proc, addr


def _decode(addr: str, max_tokens: int = 3000) -> tuple[grpc.Channel, _Stream]:
    ch = grpc.insecure_channel(addr)
    call = worker_pb2_grpc.WorkerStub(ch).Decode(
        iter([worker_pb2.DecodeRequest(submit=gen("long", text="drain me", max_tokens=max_tokens))]), timeout=300
    )
    stream = _Stream(call)
    assert wait_until(lambda: stream.tokens > 0, 60, 0.05), stream.error
    return ch, stream


def _ended(proc: subprocess.Popen, within_s: float) -> int | None:
    """``proc``'s return code if it ends within ``within_s`` seconds, else None."""
    try:
        return proc.wait(within_s)
    except subprocess.TimeoutExpired:
        return None


def test_a_draining_worker_with_its_stderr_blocked_ends_by_its_drain_timeout(tmp_path, tiny_model):
    pipe = StallablePipe(tmp_path / "worker.log")
    proc, addr = _worker(tiny_model, pipe, drain_timeout=1)
    ch = None
    try:
        ch, stream = _decode(addr)
        pipe.stall()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = _ended(proc, 1 + STOP_GRACE_S + 10)  # drain timeout + grace + a loaded machine
        took = time.monotonic() - t0
        # the drain timeout passed and the orderly stop was stuck on its log line: the kernel ended it
        assert code == KILLED_BY_DEADLINE, (code, round(took, 1))
        assert took >= 1
    finally:
        if ch is not None:
            ch.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pipe.close()


def test_a_second_signal_stops_a_draining_worker_at_once_with_its_stderr_blocked(tmp_path, tiny_model):
    pipe = StallablePipe(tmp_path / "worker.log")
    proc, addr = _worker(tiny_model, pipe, drain_timeout=120)
    ch = None
    try:
        ch, stream = _decode(addr)
        proc.send_signal(signal.SIGTERM)
        with grpc.insecure_channel(addr) as hc:
            health = health_pb2_grpc.HealthStub(hc)
            assert wait_until(
                lambda: (
                    health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    == health_pb2.HealthCheckResponse.NOT_SERVING
                ),
                10,
                0.05,
            ), pipe.text()  # NOT_SERVING: draining
        assert stream.grows(), (stream.tokens, stream.error)  # the generation runs on in the drain
        pipe.stall()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = _ended(proc, STOP_GRACE_S + 7)
        assert code == KILLED_BY_DEADLINE, (code, round(time.monotonic() - t0, 1))
    finally:
        if ch is not None:
            ch.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pipe.close()


def test_group_sigterm_drains_serves_worker_and_kill_9_of_serve_mid_drain_ends_it_at_once(tmp_path, tiny_model):
    pipe = StallablePipe(tmp_path / "serve.log")
    addr = f"127.0.0.1:{free_port()}"
    serve = _cli(
        [
            "serve",
            "--addr",
            addr,
            "--data-dir",
            str(tmp_path / "data"),
            "--model",
            str(tiny_model),
            "--device",
            "cpu",
            "--slots",
            "1",
            "--drain-timeout",
            "120",  # a ceiling: the worker must go long before
            "--heartbeat-interval",
            "0.5",
        ],
        pipe,
        new_session=True,  # its own process group, as a shell job or a service manager's
    )
    channel = grpc.insecure_channel(addr)
    stub = control_plane_pb2_grpc.ControlPlaneStub(channel)

    def states() -> list[str]:
        try:
            return [w.state for w in stub.ListWorkers(pb.Empty(), timeout=2).workers]
        except grpc.RpcError:
            return []

    wpid = 0
    try:
        assert wait_until(lambda: states() == ["alive"] or serve.poll() is not None, 180, 0.2), pipe.text()
        [wpid] = _children(serve.pid)
        # slots 1: one generation decodes, two wait in the worker's queue (~20 s of work in all)
        streams = [
            _Stream(stub.Generate(gen("", text=f"group {i}", adapters=[], max_tokens=3000), timeout=300))
            for i in range(3)
        ]
        assert wait_until(lambda: any(s.tokens for s in streams), 60, 0.05), pipe.text()
        os.killpg(serve.pid, signal.SIGTERM)
        assert wait_until(lambda: states() == ["draining"], 10, 0.05), (states(), pipe.text())
        # drained, not cut: a worker stopped at once is gone within this second (tokens already
        # on their way could still arrive, so their count alone would not tell)
        assert not wait_until(lambda: not pid_alive(wpid) or any(s.error for s in streams), 1.0, 0.05), (
            [s.error for s in streams],
            pipe.text(),
        )
        seen = sum(s.tokens for s in streams)
        assert wait_until(lambda: sum(s.tokens for s in streams) > seen, 10, 0.05)
        pipe.stall()
        serve.kill()
        serve.wait()
        t0 = time.monotonic()
        gone = wait_until(lambda: not pid_alive(wpid), STOP_GRACE_S + 10, 0.05)
        assert gone, f"worker {wpid} alive {time.monotonic() - t0:.1f}s after serve's kill -9 (drain timeout 120s)"
    finally:
        channel.close()
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        if wpid and pid_alive(wpid):
            os.kill(wpid, signal.SIGKILL)
        pipe.close()


_REPARENT_SCRIPT = """
import os, subprocess, sys, time
r, w = os.pipe()
# holds the write end, as a child serve forked without exec would
holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], pass_fds=(w,))
code = (
    "import sys, time; from worker.rpc.parent import ParentWatch; "
    "ParentWatch(int(sys.argv[1])).start(); print('watching', flush=True); time.sleep(120)"
)
worker = subprocess.Popen([sys.executable, "-c", code, str(r)], pass_fds=(r,))
os.close(r)
print(worker.pid, holder.pid, flush=True)
time.sleep(120)
"""


def test_the_parent_watch_sees_serve_gone_while_another_process_holds_the_pipe():
    parent = subprocess.Popen(
        [sys.executable, "-c", _REPARENT_SCRIPT],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    worker = holder = 0
    try:
        worker, holder = (int(x) for x in parent.stdout.readline().split())
        assert parent.stdout.readline().strip() == "watching"
        assert pid_alive(worker)
        parent.kill()
        parent.wait()
        # the pipe never reaches end of file (the holder lives); re-parenting shows serve gone
        assert wait_until(lambda: not pid_alive(worker), 5, 0.05), "the worker outlived its parent"
        assert pid_alive(holder)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in (worker, holder):
            if pid and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
