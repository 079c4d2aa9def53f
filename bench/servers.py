"""Starting and stopping the servers the serving scenarios talk to, all on 127.0.0.1.

``LoraplaneServers``: one control plane and one worker, each a subprocess
(``python -m clients.cli control-plane …`` and ``… worker --control-plane …``), both started
at once (the worker retries registering until the control plane is up), sharing a worker
secret generated for the run (`WORKER_SECRET`, in their environment). Their logs go to
files in the run's temp dir. ``LlamaServer``: the optional llama-server peer
(``$LLAMA_SERVER``), started with the same GGUF and adapters.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TypedDict

import grpc

from clients.client import LoraplaneClient
from loraplane.env import ENV_WORKER_SECRET
from loraplane.limits import GRPC_MESSAGE_OPTIONS
from loraplane.process import IMPORT_ROOT, child_pythonpath, stop_process
from loraplane.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from loraplane.worker_secret import new_worker_secret, with_secret

ROOT = IMPORT_ROOT  # the children's working directory: a checkout's root or site-packages
START_TIMEOUT_S = 900.0
STOP_GRACE_S = 20.0


_HANDED_OUT: set[int] = set()
_PORT_RNG = random.Random()  # its own generator: a test seeding `random` must not repeat our draws


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ``bind(port 0)`` (Linux ``ip_local_port_range``; IANA's elsewhere)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 49152, 65535


def free_port() -> int:
    """A loopback TCP port that nothing listens on, for a server started later with it.

    Drawn outside the kernel's ephemeral range (below it; above it where it starts low), so no
    ``:0`` bind in between (a serve's own worker, a client socket) can be handed the same port
    before our server binds it, and never the same port twice in one process. Where the range
    leaves no room, the kernel's own choice. Raises RuntimeError when 500 draws find none free.
    """
    lo, hi = _ephemeral_range()
    first, end = (10000 if lo > 12000 else 1024, lo) if lo > 2048 else (hi + 1, 65536)
    if end - first < 1000:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for _ in range(500):
        port = _PORT_RNG.randrange(first, end)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {first}..{end - 1}")


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """Resident memory of ``pid`` from /proc (``VmRSS`` total, ``RssAnon`` heap only, ``RssFile``
    mapped files); 0 where /proc is not available."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class WorkerFlags(TypedDict):
    """The runtime flags one ``LoraplaneServers`` passes to its worker."""

    slots: int
    batching: str
    prefix_cache: str
    dtype: str
    device: str
    n_ctx: int
    weights: str


WORKER_SECRET = new_worker_secret()
"""The worker secret every control plane and worker of this bench run shares (through
``$LORAPLANE_WORKER_SECRET``: a control plane without one refuses workers)."""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = child_pythonpath(env)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("LORAPLANE_ADMIN_TOKEN", None)
    env[ENV_WORKER_SECRET] = WORKER_SECRET
    return env


class LoraplaneServers:
    """A control plane plus one worker with the given runtime flags.

    Args:
        run_dir: parent folder for the data dir and the logs.
        name: label (folder and log names).
        slots / batching / prefix_cache / dtype / device / n_ctx / weights: worker flags
            (``weights`` = ``worker --weights packed|dequant``).
    """

    def __init__(
        self,
        run_dir: Path,
        name: str,
        *,
        slots: int,
        batching: str,
        prefix_cache: str,
        dtype: str,
        device: str,
        n_ctx: int = 1024,
        model_path: str | None = None,
        weights: str = "packed",
        worker_args: Sequence[str] = (),
    ):
        self.dir = Path(run_dir) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.flags = WorkerFlags(
            slots=slots,
            batching=batching,
            prefix_cache=prefix_cache,
            dtype=dtype,
            device=device,
            n_ctx=n_ctx,
            weights=weights,
        )
        self.model_path = model_path
        self.worker_args = tuple(worker_args)
        self.addr = f"127.0.0.1:{free_port()}"
        self.cp: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None
        self._client: LoraplaneClient | None = None
        self.worker_addr = ""
        self._worker_channel: grpc.Channel | None = None
        self._worker_stub: worker_pb2_grpc.WorkerStub | None = None
        self._logs: list[IO[bytes]] = []

    @property
    def client(self) -> LoraplaneClient:
        """The control plane's client (set by ``wait_ready``)."""
        if self._client is None:
            raise RuntimeError(f"{self.name}: no control-plane client yet (call wait_ready() first)")
        return self._client

    @property
    def worker_stub(self) -> worker_pb2_grpc.WorkerStub:
        """A gRPC stub straight to the worker (set by ``wait_ready``, once the worker registered)."""
        if self._worker_stub is None:
            raise RuntimeError(f"{self.name}: no worker stub yet (call wait_ready() first)")
        return self._worker_stub

    def _spawn(self, args: Sequence[str], log_name: str) -> subprocess.Popen:
        fh = open(self.dir / log_name, "ab")
        self._logs.append(fh)
        return subprocess.Popen(
            [sys.executable, "-m", "clients.cli", *args],
            cwd=ROOT,
            env=_env(),
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def start(self) -> None:
        """Start both processes (returns once the worker is registered and alive)."""
        model = ["--model", self.model_path] if self.model_path else []
        f = self.flags
        self.cp = self._spawn(
            [
                "control-plane",
                "--addr",
                self.addr,
                "--data-dir",
                str(self.dir / "data"),
                "--log-level",
                "warning",
                *model,
            ],
            "control-plane.log",
        )
        self.worker = self._spawn(
            [
                "worker",
                "--control-plane",
                self.addr,
                "--addr",
                "127.0.0.1:0",
                "--slots",
                str(f["slots"]),
                "--batching",
                f["batching"],
                "--prefix-cache",
                f["prefix_cache"],
                "--dtype",
                f["dtype"],
                "--weights",
                f["weights"],
                "--device",
                f["device"],
                "--n-ctx",
                str(f["n_ctx"]),
                "--queue-limit",
                "1024",
                *model,
                *self.worker_args,
            ],
            "worker.log",
        )

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        client = LoraplaneClient(self.addr, wait_for_server=True, connect_timeout=timeout_s, timeout=600)
        self._client = client
        while True:
            self._check_alive()
            alive = [w for w in client.list_workers() if w.alive]
            if alive:
                self.worker_addr = alive[0].addr
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.name}: the worker did not register within {timeout_s:.0f}s (logs in {self.dir})"
                )
            time.sleep(0.25)
        self._worker_channel = grpc.insecure_channel(self.worker_addr, options=GRPC_MESSAGE_OPTIONS)
        self._worker_stub = worker_pb2_grpc.WorkerStub(with_secret(self._worker_channel, WORKER_SECRET))

    def _check_alive(self) -> None:
        for what, proc in (("control plane", self.cp), ("worker", self.worker)):
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{self.name}: the {what} exited with code {proc.returncode} (log: {self.dir})")

    def stats(self) -> worker_pb2.WorkerStats:
        return self.worker_stub.Stats(common_pb2.Empty(), timeout=60)

    def worker_rss(self, field: str = "VmRSS") -> int:
        return rss_bytes(self.worker.pid, field) if self.worker else 0

    def cp_rss(self, field: str = "VmRSS") -> int:
        return rss_bytes(self.cp.pid, field) if self.cp else 0

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
        if self._worker_channel is not None:
            self._worker_channel.close()
        stop_process(self.worker)
        stop_process(self.cp)
        for fh in self._logs:
            fh.close()
        self._logs = []


def start_all(servers: Sequence[LoraplaneServers]) -> None:
    """Start several server pairs at once and wait for all (stops all on failure)."""
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
    except BaseException:
        for s in servers:
            s.stop()
        raise


class LlamaServer:
    """llama-server (``$LLAMA_SERVER``) with the same GGUF, adapters loaded unapplied.

    Requests name adapters by position in ``adapters`` (llama-server ids 0, 1, …) with the
    full scale vector, zeros explicit.
    """

    def __init__(
        self,
        binary: str,
        run_dir: Path,
        name: str,
        *,
        model: str,
        adapters: Sequence[Path],
        parallel: int,
        n_ctx: int,
        threads: int | None = None,
    ):
        self.binary = binary
        self.dir = Path(run_dir) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.n_adapters = len(adapters)
        args = [
            binary,
            "-m",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--parallel",
            str(parallel),
            "-c",
            str(parallel * n_ctx),
            "--no-webui",
            "--lora-init-without-apply",
        ]
        if adapters:  # one comma-separated list: a repeated --lora keeps only the last one
            args += ["--lora", ",".join(str(a) for a in adapters)]
        if threads:
            args += ["-t", str(threads)]
        self.args = args
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        log = open(self.dir / "llama-server.log", "ab")
        self._log = log
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} (log in {self.dir})")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                healthy = conn.getresponse().status == 200
                conn.close()
            except OSError:
                healthy = False
            if healthy:
                self._check_adapters()
                return
            time.sleep(0.5)
        raise RuntimeError(f"llama-server did not become healthy within {timeout_s:.0f}s")

    def _check_adapters(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", "/lora-adapters")
            loaded = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        if len(loaded) != self.n_adapters:
            raise RuntimeError(f"llama-server loaded {len(loaded)} adapters, expected {self.n_adapters}")

    def lora_vector(self, scales: dict[int, float]) -> list[dict]:
        return [{"id": i, "scale": float(scales.get(i, 0.0))} for i in range(self.n_adapters)]

    def stream(self, prompt: list[int], *, adapters: dict[int, float], max_tokens: int, seed: int):
        """Yield ``("token", n_tokens)`` per streamed chunk, then ``("done", final_json)``."""
        body = json.dumps(
            {
                "prompt": prompt,
                "n_predict": max_tokens,
                "temperature": 0.0,
                "top_k": 1,
                "ignore_eos": True,
                "stream": True,
                "cache_prompt": True,
                "seed": seed,
                "lora": self.lora_vector(adapters),
            }
        )
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            conn.request("POST", "/completion", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"llama-server answered {resp.status}: {resp.read()[:500]!r}")
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                msg = json.loads(payload)
                if msg.get("stop"):
                    n = len(msg.get("tokens") or [])
                    if n or msg.get("content"):
                        yield ("token", max(n, 1))
                    yield ("done", msg)
                    return
                n = len(msg.get("tokens") or [])
                if n or msg.get("content"):
                    yield ("token", max(n, 1))
        finally:
            conn.close()

    def stop(self) -> None:
        stop_process(self.proc)
        if self._log is not None:
            self._log.close()
