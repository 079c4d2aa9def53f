"""A real control plane (``control_plane.server.create_server``, in this process) and, where
asked, one real worker subprocess (``python -m clients.cli worker``): what ``loraplane serve``
runs, for the client-side tests (Python client, CLI, Node client).

The ``live_server`` / ``admin_control_plane`` fixtures in ``conftest.py`` build on these. Every
client test shares one server, so tests must not assume adapter ids or the default set: they
register what they use (same content → same id) and restore the default set they change.
Conventions that keep them independent: ``shout_rs.gguf`` is registered only by server path
(test_client checks its stored path); an adapter a test removes or names is its own, written by
``tests.helpers.control_plane.write_adapter`` with a seed no other test uses (7101, 7201, ...).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from loraplane.env import ENV_WORKER_SECRET
from loraplane.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from loraplane.worker_secret import with_secret

ROOT = Path(__file__).resolve().parents[2]
WORKER_READY_TIMEOUT_S = 600.0
WORKER_STOP_GRACE_S = 20.0
ADMIN_TOKEN = "test-admin-token"
WORKER_SECRET = "test-worker-secret"
"""The worker secret every test control plane and worker shares (a control plane without one
refuses workers unless ``insecure_workers``)."""


@dataclass
class LiveControlPlane:
    """A started control plane: ``addr`` to dial, ``state`` for what clients cannot see."""

    addr: str
    server: grpc.Server
    state: object  # control_plane.server.ControlPlaneState
    data_dir: Path
    adapter_dir: Path
    admin_token: str | None = None
    worker_proc: subprocess.Popen | None = None
    worker_id: str = ""
    worker_addr: str = ""
    worker_log: Path | None = None
    _worker_channel: grpc.Channel | None = field(default=None, repr=False)

    def worker_stats(self) -> worker_pb2.WorkerStats:
        """The worker's own ``Stats`` (slots busy, tokens generated, ...)."""
        if self._worker_channel is None:
            self._worker_channel = grpc.insecure_channel(self.worker_addr)
        stub = worker_pb2_grpc.WorkerStub(with_secret(self._worker_channel, WORKER_SECRET))
        return stub.Stats(common_pb2.Empty(), timeout=10)

    def worker_log_tail(self, n_bytes: int = 4000) -> str:
        if self.worker_log is None or not self.worker_log.exists():
            return ""
        return self.worker_log.read_bytes()[-n_bytes:].decode(errors="replace")

    def stop(self) -> None:
        if self._worker_channel is not None:
            self._worker_channel.close()
        proc = self.worker_proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(WORKER_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.server.stop(None).wait()
        self.state.close()


def start_control_plane(
    data_dir: Path, adapter_dir: Path, model_path: Path, *, admin_token: str | None = None, addr: str = "127.0.0.1:0"
) -> LiveControlPlane:
    """A real control plane on ``addr`` (default 127.0.0.1, port 0) over ``data_dir``;
    server paths are accepted inside ``adapter_dir``; workers present `WORKER_SECRET`."""
    from control_plane.server import ControlPlaneConfig, create_server

    config = ControlPlaneConfig(
        addr=addr,
        data_dir=str(data_dir),
        adapter_dirs=(str(adapter_dir),),
        model_path=str(model_path),
        admin_token=admin_token,
        worker_secret=WORKER_SECRET,
        log_level="warning",
    )
    server, port, state = create_server(config)
    return LiveControlPlane(
        addr=f"127.0.0.1:{port}",
        server=server,
        state=state,
        data_dir=data_dir,
        adapter_dir=adapter_dir,
        admin_token=admin_token,
    )


def start_worker(
    cp: LiveControlPlane,
    model_path: Path,
    log_path: Path,
    *,
    slots: int = 4,
    extra_args: tuple[str, ...] = (),
    worker_id: str = "",
) -> None:
    """Start one real worker for ``cp`` and wait until the control plane lists it alive.

    Raises:
        RuntimeError: the worker exited or did not register in time (with its log's tail).
    """
    cp.worker_id = worker_id or f"test-worker-{uuid.uuid4().hex[:8]}"
    cp.worker_log = log_path
    cmd = [
        sys.executable,
        "-m",
        "clients.cli",
        "worker",
        "--control-plane",
        cp.addr,
        "--addr",
        "127.0.0.1:0",
        "--worker-id",
        cp.worker_id,
        "--slots",
        str(slots),
        "--device",
        "cpu",
        "--model",
        str(model_path),
        *extra_args,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "PYTHONUNBUFFERED": "1",
        ENV_WORKER_SECRET: WORKER_SECRET,
    }
    with open(log_path, "ab") as log:
        cp.worker_proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
    while True:
        ours = [w for w in cp.state.pool.snapshot() if w.worker_id == cp.worker_id and w.state == "alive"]
        if ours:
            cp.worker_addr = ours[0].addr
            return
        code = cp.worker_proc.poll()
        if code is not None:
            raise RuntimeError(
                f"the worker exited with code {code} before registering; log tail:\n{cp.worker_log_tail()}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the worker did not register within {WORKER_READY_TIMEOUT_S:g}s; log tail:\n{cp.worker_log_tail()}"
            )
        time.sleep(0.25)


# ---- helpers for tests sharing one server ---------------------------------------------------


def nonzero(default_set) -> dict[int, float]:
    """``{id: scale}`` of a `DefaultSet`'s attached adapters (the real one lists every
    registered adapter, detached ones at 0)."""
    return {e.id: e.scale for e in default_set.entries if e.scale != 0}


class restored_default:
    """``with restored_default(client): ...`` puts the default set back as it was (only the
    adapters still registered), so tests that change it stay independent of order."""

    def __init__(self, client) -> None:
        self.client = client

    def __enter__(self):
        self.saved = nonzero(self.client.get_default())
        return self

    def __exit__(self, *exc: object) -> None:
        registered = {a.id for a in self.client.list_adapters()}
        self.client.set_default({i: s for i, s in self.saved.items() if i in registered})


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.1) -> bool:
    """Poll ``predicate()`` until it is truthy (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
