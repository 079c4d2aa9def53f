"""FetchAdapter's door and stalled readers, measured against a real control-plane process.

Starts ``python -m clients.cli control-plane`` twice (from ``--repo``, default this checkout,
so the same script measures an older checkout too): at default flags (no worker secret), and
with a worker secret in its environment; uploads a 10.9 MB adapter
(``tests/fixtures/adapters/shout_embd.gguf``) to each and, per repetition:

- **outsider bytes** (default flags): what a caller without a secret receives from
  ``FetchAdapter`` (0 is the target; an open door streams the whole file);
- **100 stalled readers** (insiders, with the secret; one connection each, BDP probing off
  so each admitted stream stalls after one chunk): the worst latency of health checks and
  ``ListAdapters`` while they stall (target < 1 s; a probe that times out counts as its
  5 s timeout), and the seconds until a full fetch is served again (the stall timeout cut
  the readers off), capped at 60 s.

``main()`` prints each as ``median [min–max]`` over the repetitions. For bench/reliability.py:
`outsider_bytes`, `stalled_readers` take an address, a sha256 and the secret.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.servers import free_port
from loraplane.process import cli_module
from loraplane.v1 import common_pb2, control_plane_pb2_grpc, membership_pb2, membership_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
ADAPTER = ROOT / "tests" / "fixtures" / "adapters" / "shout_embd.gguf"
SECRET_KEY = "loraplane-worker-secret"
PROBE_TIMEOUT_S = 5.0
MiB = 1 << 20
OPTIONS = [("grpc.max_receive_message_length", 64 * MiB), ("grpc.max_send_message_length", 64 * MiB)]


def outsider_bytes(addr: str, sha256: str) -> tuple[int, str]:
    """Bytes ``FetchAdapter(sha256)`` streams to a caller presenting no secret, and how the
    call ended ("OK" or the status code's name)."""
    got = 0
    with grpc.insecure_channel(addr, options=OPTIONS) as ch:
        stub = membership_pb2_grpc.WorkerMembershipStub(ch)
        try:
            for chunk in stub.FetchAdapter(
                membership_pb2.FetchAdapterRequest(sha256=sha256, worker_id="outsider"), timeout=60
            ):
                got += len(chunk.data)
        except grpc.RpcError as exc:
            return got, exc.code().name
    return got, "OK"


def _full_fetch(stub, sha256: str, secret: str, timeout: float) -> str:
    """ "OK" when every byte came and hashes right, else why not (a status code's name)."""
    data = b""
    try:
        for chunk in stub.FetchAdapter(
            membership_pb2.FetchAdapterRequest(sha256=sha256, worker_id="bench"),
            metadata=[(SECRET_KEY, secret)],
            timeout=timeout,
        ):
            data += chunk.data
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK" if hashlib.sha256(data).hexdigest() == sha256 else "hash mismatch"


def stalled_readers(addr: str, sha256: str, secret: str, n: int = 100, probes: int = 10) -> dict:
    """Open ``n`` FetchAdapter streams that read one chunk and stop, then measure.

    Returns:
        ``{"admitted": streams that got a chunk, "refused": RESOURCE_EXHAUSTED ones,
        "probe_worst_s": worst health + ListAdapters round trip while they stall (a timeout
        counts PROBE_TIMEOUT_S), "probe_timeouts": probes that timed out,
        "fetch_back_s": seconds from the stall until a full fetch succeeds (60: never),
        "fetch_last": how the last full fetch ended}``.
    """
    opts = [*OPTIONS, ("grpc.use_local_subchannel_pool", 1), ("grpc.http2.bdp_probe", 0)]
    channels = [grpc.insecure_channel(addr, options=opts) for _ in range(n)]
    req = membership_pb2.FetchAdapterRequest(sha256=sha256, worker_id="stalled")
    md = [(SECRET_KEY, secret)]
    stubs = [membership_pb2_grpc.WorkerMembershipStub(ch) for ch in channels]
    calls = [stub.FetchAdapter(req, metadata=md, timeout=120) for stub in stubs]

    def first(call) -> str:
        try:
            next(call)
            return "admitted"
        except grpc.RpcError as exc:
            return exc.code().name
        except StopIteration:
            return "empty"

    out: dict = {}
    pool = futures.ThreadPoolExecutor(n)
    try:
        t_stall = time.monotonic()
        pending = [pool.submit(first, c) for c in calls]
        futures.wait(pending, timeout=5.0)
        states = [f.result() if f.done() else "waiting" for f in pending]
        out["admitted"] = states.count("admitted")
        out["refused"] = states.count("RESOURCE_EXHAUSTED")
        out["waiting"] = states.count("waiting")
        probe_ch = grpc.insecure_channel(addr, options=OPTIONS)
        health = health_pb2_grpc.HealthStub(probe_ch)
        stub = control_plane_pb2_grpc.ControlPlaneStub(probe_ch)
        worst, timeouts = 0.0, 0
        for _ in range(probes):
            t = time.monotonic()
            try:
                health.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
                stub.ListAdapters(common_pb2.Empty(), timeout=PROBE_TIMEOUT_S)
                worst = max(worst, time.monotonic() - t)
            except grpc.RpcError:
                timeouts += 1
                worst = max(worst, PROBE_TIMEOUT_S)
        out["probe_worst_s"] = worst
        out["probe_timeouts"] = timeouts
        back, last = 60.0, ""
        while time.monotonic() - t_stall < 60.0:
            last = _full_fetch(membership_pb2_grpc.WorkerMembershipStub(probe_ch), sha256, secret, timeout=20.0)
            if last == "OK":
                back = time.monotonic() - t_stall
                break
            time.sleep(0.25)
        out["fetch_back_s"] = back
        out["fetch_last"] = last
        probe_ch.close()
    finally:
        for c in calls:
            c.cancel()
        for ch in channels:
            ch.close()
        pool.shutdown(wait=False, cancel_futures=True)
    return out


def start_control_plane(repo: Path, data_dir: Path, secret: str | None, log_path: Path) -> tuple[subprocess.Popen, str]:
    """A ``control-plane`` subprocess of ``repo`` with ``$LORAPLANE_WORKER_SECRET`` = ``secret``
    (None: default flags, no secret)."""
    addr = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONUNBUFFERED": "1"}
    env.pop("LORAPLANE_ADMIN_TOKEN", None)
    env.pop("LORAPLANE_WORKER_SECRET", None)
    if secret:
        env["LORAPLANE_WORKER_SECRET"] = secret
    cmd = [sys.executable, "-m", cli_module(repo), "control-plane", "--addr", addr, "--data-dir", str(data_dir)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    with grpc.insecure_channel(addr) as ch:
        grpc.channel_ready_future(ch).result(timeout=300)
    return proc, addr


def _upload(addr: str, path: Path) -> str:
    data = path.read_bytes()

    def chunks():
        for i in range(0, len(data), MiB):
            yield common_pb2.AdapterChunk(data=data[i : i + MiB])

    with grpc.insecure_channel(addr, options=OPTIONS) as ch:
        info = control_plane_pb2_grpc.ControlPlaneStub(ch).RegisterAdapter(chunks(), timeout=120)
    return info.sha256


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}–{max(values):.3f}]"


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=ROOT, help="checkout whose control plane to start")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--readers", type=int, default=100)
    args = ap.parse_args(argv)
    repo = args.repo.resolve()
    secret = "bench-worker-secret"
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="lp-fetch-bench-") as tmp:
        proc, addr = start_control_plane(repo, Path(tmp) / "open", None, Path(tmp) / "cp-default.log")
        try:
            sha = _upload(addr, ADAPTER)
            for _ in range(args.repeat):
                got, how = outsider_bytes(addr, sha)
                rows.setdefault("outsider without secret, control plane at default flags: bytes received", []).append(
                    got
                )
                print(f"outsider: {got} bytes ({how})", flush=True)
        finally:
            _stop(proc)
        proc, addr = start_control_plane(repo, Path(tmp) / "secret", secret, Path(tmp) / "cp-secret.log")
        try:
            sha = _upload(addr, ADAPTER)
            for _ in range(args.repeat):
                r = stalled_readers(addr, sha, secret, n=args.readers)
                name = f"{args.readers} stalled FetchAdapter readers: health + reads worst latency (s)"
                rows.setdefault(name, []).append(r["probe_worst_s"])
                rows.setdefault("  probes timed out (of 10)", []).append(r["probe_timeouts"])
                rows.setdefault("  readers admitted (stalled)", []).append(r["admitted"])
                rows.setdefault("  readers refused RESOURCE_EXHAUSTED", []).append(r["refused"])
                rows.setdefault("  a full fetch served again after (s)", []).append(r["fetch_back_s"])
                print(f"stalled readers: {r}", flush=True)
        finally:
            _stop(proc)
    print(f"control plane of {repo}; adapter {ADAPTER.name} ({ADAPTER.stat().st_size} bytes)")
    for name, values in rows.items():
        print(f"{name}: {_summary(values)}")


if __name__ == "__main__":
    main()
