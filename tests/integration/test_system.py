"""The whole system with real processes: control plane + worker subprocesses on localhost.

- a default-set change affects only requests admitted afterwards;
- killing the worker ends in-flight streams with UNAVAILABLE, the control plane marks it
  dead, and new requests are served once a worker is back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from clients.cli.serve import worker_command
from clients.client import LoraplaneClient
from clients.errors import LoraplaneError
from clients.results import FinishedEvent, TokenEvent
from loraplane.env import ENV_WORKER_SECRET
from loraplane.process import stop_process
from tests.helpers.live_servers import WORKER_SECRET

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The weather today is"


def start_worker(cp_addr: str, worker_id: str) -> subprocess.Popen:
    return subprocess.Popen(
        worker_command(cp_addr, worker_id, ["--slots", "4", "--device", "cpu", "--n-ctx", "512"]),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), ENV_WORKER_SECRET: WORKER_SECRET},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def wait_alive(lp: LoraplaneClient, worker_id: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(w.worker_id == worker_id and w.alive for w in lp.list_workers()):
            return
        time.sleep(0.5)
    raise AssertionError(f"worker {worker_id} never became alive")


@pytest.fixture
def system(start_control_plane, fixtures_dir):
    cp = start_control_plane(
        adapter_dirs=(str(fixtures_dir / "adapters"),), heartbeat_interval_s=0.5, dead_after_missed=3
    )
    procs: list[subprocess.Popen] = []

    def spawn(worker_id: str) -> subprocess.Popen:
        p = start_worker(cp.addr, worker_id)
        procs.append(p)
        return p

    lp = LoraplaneClient(cp.addr, timeout=600)
    yield cp, lp, spawn
    lp.close()
    for p in procs:
        stop_process(p, 60)


def test_default_set_change_affects_only_later_requests(system, fixtures_dir):
    cp, lp, spawn = system
    spawn("w-default")
    wait_alive(lp, "w-default")
    shout = lp.add_adapter(str(fixtures_dir / "adapters" / "shout.gguf"), server_path=True).id
    want_shout = lp.generate(PROMPT, adapters={shout: 1.0}, max_tokens=16).token_ids
    want_base = lp.generate(PROMPT, adapters={}, max_tokens=16).token_ids
    assert want_shout != want_base
    lp.set_default({shout: 1.0})
    got: list[int] = []
    first = threading.Event()

    def run_old():
        for ev in lp.generate_stream(PROMPT, max_tokens=16):  # no map: default as admitted
            if isinstance(ev, TokenEvent):
                got.append(ev.token_id)
                first.set()

    t = threading.Thread(target=run_old)
    t.start()
    assert first.wait(300)
    lp.set_default({})  # after admission: must not touch the running request
    later = lp.generate(PROMPT, max_tokens=16).token_ids
    t.join(300)
    assert got == list(want_shout)
    assert list(later) == list(want_base)


def test_killed_worker_unavailable_marked_dead_then_replaced(system):
    cp, lp, spawn = system
    proc = spawn("w-doomed")
    wait_alive(lp, "w-doomed")
    seen = threading.Event()
    outcome: dict = {}

    def run():
        try:
            for ev in lp.generate_stream(PROMPT, max_tokens=400, ignore_eos=True, adapters={}):
                if isinstance(ev, TokenEvent):
                    seen.set()
                if isinstance(ev, FinishedEvent):
                    outcome["finished"] = ev
        except LoraplaneError as err:
            outcome["error"] = err

    t = threading.Thread(target=run)
    t.start()
    assert seen.wait(300)
    proc.send_signal(signal.SIGKILL)
    t.join(120)
    assert "finished" not in outcome
    err = outcome["error"]
    assert err.code == "UNAVAILABLE" and "w-doomed" in err.message, err
    deadline = time.monotonic() + 30
    while any(w.worker_id == "w-doomed" and w.alive for w in lp.list_workers()):
        assert time.monotonic() < deadline, "dead worker still listed alive"
        time.sleep(0.2)
    with pytest.raises(LoraplaneError) as no_worker:
        lp.generate(PROMPT, adapters={}, max_tokens=2)
    assert no_worker.value.code == "UNAVAILABLE"
    spawn("w-phoenix")
    wait_alive(lp, "w-phoenix")
    res = lp.generate(PROMPT, adapters={}, max_tokens=4)
    assert len(res.token_ids) == 4 and res.telemetry["worker_id"] == "w-phoenix"
