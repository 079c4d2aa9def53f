"""Start and stop a real ``loraplane serve`` subprocess for integration tests.

Used where the control plane and worker are installed (``HAVE_SERVERS``); the embedded base
model loads on CPU, so a start takes a minute or two on a small machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

from bench.servers import free_port
from clients.client import LoraplaneClient
from loraplane.process import child_pythonpath, stop_process

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "loraplane" / "demo" / "adapters"
HAVE_SERVERS = find_spec("control_plane.server") is not None and find_spec("worker.rpc.server") is not None
READY_TIMEOUT_S = 600


def start_serve(data_dir: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """``loraplane serve`` with shout (id 0) and sea (id 1) loaded, default set empty."""
    addr = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "clients.cli",
            "serve",
            "--addr",
            addr,
            "--data-dir",
            str(data_dir),
            "--lora",
            str(DEMO / "shout.gguf"),
            "--lora",
            str(DEMO / "sea.gguf"),
            "--lora-init-without-apply",
            "--device",
            "cpu",
            "--log-level",
            "warning",
            *extra,
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": child_pythonpath(dict(os.environ))},  # keeps the inherited entries
    )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        with LoraplaneClient(addr, wait_for_server=True, connect_timeout=READY_TIMEOUT_S) as lp:
            while not any(w.alive for w in lp.list_workers()):
                if proc.poll() is not None:
                    raise RuntimeError(f"loraplane serve exited with {proc.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError("the worker never registered")
                time.sleep(0.5)
    except BaseException:
        stop_serve(proc)
        raise
    return proc, addr


def stop_serve(proc: subprocess.Popen, timeout: float = 60) -> int:
    """SIGTERM, wait; returns the exit code (kills after ``timeout``)."""
    code = stop_process(proc, timeout)
    assert code is not None
    return code
