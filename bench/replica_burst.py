"""The replica burst (``python -m bench.reliability --scenarios replica_burst``): do
tenant quotas hold when one instant's requests arrive through every replica?

Per call: its own PostgreSQL (``tests/helpers/postgres_server.py``: needs the repository checkout), two
control planes from the checkout under test sharing it (``control-plane --database``), one
worker registered with both (the bench's ``--model``, default the embedded Gemma 3 270M;
``--slots 4``), all on loopback. Then:

- tenant ``burst`` (``max_concurrent 2``, ``requests_per_minute 10``): 32 streams (24 tokens
  each) released at one instant, 16 through each replica. ``max_in_flight_n``: the most of
  them between their first event and their end at once, as the clients saw it (a lower bound
  of what the replicas held); ``admitted_n``: how many were served;
- tenant ``rpm`` (``requests_per_minute 10`` only): the same burst of 1-token requests;
  ``rpm_admitted_n``: how many were served (the limit allows 10; the target is ≤ 11);
- tenant ``tpm`` (``tokens_per_minute`` 50: 10 requests of a 4-token prompt and 1 token):
  ``tpm_admitted_n``, likewise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.servers import free_port
from clients.client import LoraplaneClient
from clients.errors import LoraplaneError
from loraplane.env import ENV_WORKER_SECRET
from loraplane.process import cli_module, stop_process

BURST = 32
PROMPT = [2, 651, 6114, 3124]  # token ids: what tokens_per_minute counts exactly
SECRET = "bench-replica-burst-secret"
READY_S = 900.0


def _spawn(repo: Path, args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONUNBUFFERED": "1", ENV_WORKER_SECRET: SECRET}
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", cli_module(repo), *args],
            cwd=repo,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def burst(addrs: list[str], key: str, max_tokens: int) -> list[tuple[float, float]]:
    """`BURST` streams of the tenant of ``key`` at one instant, alternately through ``addrs``:
    the (first event, end) interval of each one served (refusals: RESOURCE_EXHAUSTED)."""
    clients = [LoraplaneClient(addrs[i % len(addrs)], api_key=key, timeout=300) for i in range(BURST)]
    start = threading.Barrier(BURST)
    served: list[tuple[float, float]] = []

    def one(lp: LoraplaneClient) -> None:
        lp.list_adapters()  # connected before the barrier
        start.wait(60)
        try:
            first = None
            for _ev in lp.generate_stream(prompt_tokens=PROMPT, adapters={}, max_tokens=max_tokens, ignore_eos=True):
                first = first or time.monotonic()
            served.append((first or time.monotonic(), time.monotonic()))
        except LoraplaneError as exc:
            if exc.code != "RESOURCE_EXHAUSTED":
                raise

    try:
        with ThreadPoolExecutor(BURST) as ex:
            list(ex.map(one, clients))
    finally:
        for lp in clients:
            lp.close()
    return served


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals ``(start, end)`` open at one instant."""
    edges = sorted([(t0, 1) for t0, _ in intervals] + [(t1, -1) for _, t1 in intervals], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def replica_burst(repo: Path, model: str | None, workdir: Path) -> dict[str, float]:
    """One run of the scenario (module docstring) against the checkout ``repo``: its servers'
    files and logs under ``workdir``; ``model``: the worker's base model (None: the embedded
    one)."""
    from tests.helpers.postgres_server import start_postgres

    server = start_postgres()
    procs: list[subprocess.Popen] = []
    try:
        url = server.create_database("burst")
        addrs = [f"127.0.0.1:{free_port()}" for _ in range(2)]
        for i, addr in enumerate(addrs):
            args = ["control-plane", "--addr", addr, "--database", url, "--data-dir", str(workdir / f"cp{i}")]
            procs.append(_spawn(repo, [*args, "--log-level", "warning"], workdir / f"cp{i}.log"))
        worker = ["worker", "--control-plane", ",".join(addrs), "--addr", "127.0.0.1:0", "--worker-id", "w-burst"]
        worker += ["--slots", "4", "--device", "cpu", *(["--model", model] if model else [])]
        procs.append(_spawn(repo, worker, workdir / "worker.log"))
        admins = [LoraplaneClient(a, timeout=120, connect_timeout=READY_S, wait_for_server=True) for a in addrs]
        deadline = time.monotonic() + READY_S
        while not all(any(w.alive for w in lp.list_workers()) for lp in admins):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the replica burst's cluster did not start; logs in {workdir}")
            time.sleep(0.2)
        _, key = admins[0].add_tenant("burst", max_concurrent=2, requests_per_minute=10)
        _, rpm_key = admins[0].add_tenant("rpm", requests_per_minute=10)
        _, tpm_key = admins[0].add_tenant("tpm", tokens_per_minute=10 * (len(PROMPT) + 1))
        time.sleep(1.5)  # the other replica reloads its key table every second
        served = burst(addrs, key, max_tokens=24)
        rpm_served = burst(addrs, rpm_key, max_tokens=1)
        tpm_served = burst(addrs, tpm_key, max_tokens=1)
        for lp in admins:
            lp.close()
        return {
            "max_in_flight_n": float(max_overlap(served)),
            "admitted_n": float(len(served)),
            "rpm_admitted_n": float(len(rpm_served)),
            "tpm_admitted_n": float(len(tpm_served)),
        }
    finally:
        for p in procs:
            stop_process(p, 30)
        server.stop()
