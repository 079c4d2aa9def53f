"""A real ``loraplane serve`` subprocess with the HTTP front and both metrics endpoints on, for
the HTTP-API and metrics tests (one per test module; the embedded model loads in a minute or
two on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from loraplane.process import child_pythonpath, stop_process
from tests.helpers.serve import free_port

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 600


@dataclass
class HttpServe:
    proc: subprocess.Popen
    grpc_addr: str
    http: str  # http://127.0.0.1:PORT
    cp_metrics: str  # http://127.0.0.1:PORT/metrics
    worker_metrics: str
    banner: str  # serve's "serving on …" line

    def stop(self) -> int:
        return stop_process(self.proc, 60) or 0


def start_http_serve(tmp: Path, *extra: str, admin_token: str | None = None) -> HttpServe:
    """``loraplane serve`` on free ports with ``--http-addr``, ``--metrics-addr`` and
    ``--worker-metrics-addr``; returns once serve announced readiness (its stderr line)."""
    ports = [free_port() for _ in range(4)]
    grpc_addr, http_addr, cp_m, w_m = (f"127.0.0.1:{p}" for p in ports)
    log = tmp / "serve.log"
    env = {**os.environ, "PYTHONPATH": child_pythonpath(dict(os.environ))}  # keeps the inherited entries
    if admin_token:
        env["LORAPLANE_ADMIN_TOKEN"] = admin_token
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "clients.cli",
                "serve",
                "--addr",
                grpc_addr,
                "--data-dir",
                str(tmp / "data"),
                "--device",
                "cpu",
                "--log-level",
                "warning",
                "--slots",
                "2",
                "--http-addr",
                http_addr,
                "--metrics-addr",
                cp_m,
                "--worker-metrics-addr",
                w_m,
                *extra,
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        text = log.read_text(errors="replace")
        banner = next((line for line in text.splitlines() if line.startswith("loraplane: serving on")), None)
        if banner:
            return HttpServe(
                proc, grpc_addr, f"http://{http_addr}", f"http://{cp_m}/metrics", f"http://{w_m}/metrics", banner
            )
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc, 10)
            raise RuntimeError(f"serve did not become ready (code {proc.returncode}); log:\n{text[-4000:]}")
        time.sleep(0.5)
