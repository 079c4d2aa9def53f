"""Fast checks of the worker lifecycle (drain, restarts, stale folders; a real control plane in this process,
the scripted workers of ``tests/helpers/scripted_worker.py`` over real sockets; no model):

- a heartbeat saying ``draining`` takes the worker out of routing at once, and it stays listed
  (state "draining"); a worker that refuses UNAVAILABLE before any event is retried elsewhere;
- the supervisor's restart count in the hello is the floor of ``restarts``;
- stale adapter cache directories of dead worker pids are removed, live ones kept;
- the worker's signal handling: first signal drains, the second stops now, each arming the
  kernel deadline first (drain timeout + grace, then the grace); an armed deadline is only
  ever brought forward.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.helpers.live_servers import wait_until
from tests.helpers.scripted_worker import generate, workers_of
from worker.lora.host_cache import CACHE_DIR_PREFIX, remove_stale_cache_dirs


def test_a_draining_worker_is_listed_but_gets_no_request(cluster):
    cp, (w1, w2) = cluster(2)
    w1.hello.draining = True  # what its heartbeats say from SIGTERM on
    assert wait_until(lambda: workers_of(cp)["w1"].state == "draining")
    for i in range(6):
        assert generate(cp, f"after drain {i}")[-1].HasField("finished")
    assert not [r for r in w1.servicer.submitted if r.text.startswith("after drain")]
    assert len([r for r in w2.servicer.submitted if r.text.startswith("after drain")]) == 6
    w1.hello.draining = False  # (a drain never ends this way; the flag just follows heartbeats)
    assert wait_until(lambda: workers_of(cp)["w1"].state == "alive")


def test_a_worker_refusing_unavailable_before_any_event_is_retried_elsewhere(cluster):
    cp, (w1, w2) = cluster(2)
    w1.servicer.down = True  # a drain that started before its heartbeat reached us
    for i in range(4):
        assert generate(cp, f"retry {i}")[-1].HasField("finished")
    assert len([r for r in w2.servicer.submitted if r.text.startswith("retry")]) == 4


def test_supervisor_restarts_are_the_floor_of_the_restart_count(cluster):
    cp, (w1,) = cluster(1)
    assert workers_of(cp)["w1"].restarts == 0
    w1.hello.supervisor_restarts = 3  # serve restarted it 3 times; 2 died before registering
    assert wait_until(lambda: workers_of(cp)["w1"].restarts == 3)


def test_stale_cache_dirs_of_dead_pids_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{CACHE_DIR_PREFIX}{dead.pid}-abc"
    (stale / "sub").mkdir(parents=True)
    (stale / "x.gguf").write_bytes(b"x")
    live = tmp_path / f"{CACHE_DIR_PREFIX}{os.getppid()}-def"
    live.mkdir()
    other = tmp_path / "loraplane-something-else-1-x"
    other.mkdir()
    assert remove_stale_cache_dirs(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and other.exists()


def test_first_signal_drains_second_stops_now():
    from worker.rpc.server import Shutdown

    armed: list[float] = []
    s = Shutdown(45.0, hard_stop=armed.append)
    s.on_signal(signal.SIGTERM)
    assert s.draining.is_set() and not s.now.is_set()
    assert armed == [50.0]  # --drain-timeout 45 + STOP_GRACE_S 5
    s.on_signal(signal.SIGINT)
    assert s.now.is_set()
    assert armed == [50.0, 5.0]


def test_the_stop_deadline_is_only_brought_forward():
    from worker.rpc import deadline

    assert deadline.remaining() == 0.0
    try:
        deadline.arm(300.0)
        assert 299.0 < deadline.remaining() <= 300.0
        deadline.arm(600.0)  # later: the earlier one stays
        assert 299.0 < deadline.remaining() <= 300.0
        deadline.arm(200.0)
        assert 199.0 < deadline.remaining() <= 200.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)  # disarm: it would end the test process
    assert deadline.remaining() == 0.0
