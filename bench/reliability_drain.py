"""Rolling restart of workers under load: how many generations are cut short.

Starts a control plane (``loraplane control-plane``) and ``--workers`` workers (``loraplane
worker``, real processes on loopback), keeps ``--streams`` client streams generating
``--max-tokens`` tokens each (ignore_eos) through the control plane, and meanwhile restarts
every worker in turn as a rolling update does: SIGTERM, wait for the process to exit (it
drains), start it again under the same id, wait until it is listed alive, next one.

A generation counts as *cut short* when its stream ends with an error after at least one
token, or finishes with fewer tokens than asked; one refused before any token is *refused*
(the client may retry it; the control plane itself retries a worker that refuses before any
event). Printed as one JSON object; ``main`` returns it too.

Usage: ``python -m bench.reliability_drain [--model GGUF] [--workers 2] [--streams 4]
[--max-tokens 200] [--drain-timeout 45]`` (default model: the embedded Gemma 3 270M; the tiny
synthetic Llama of ``tests/helpers/tiny_models.py`` with ``--tiny``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from bench.servers import free_port
from loraplane.env import ENV_WORKER_SECRET
from loraplane.v1 import common_pb2, control_plane_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
SECRET = "bench-reliability-drain-secret"


def _env() -> dict[str, str]:
    return {**os.environ, ENV_WORKER_SECRET: SECRET, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def _cli(*args: str, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "clients.cli", *args],
            cwd=ROOT,
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.2)


class _Load:
    """``streams`` threads generating back to back until stopped; outcome counters."""

    def __init__(self, stub, streams: int, max_tokens: int) -> None:
        self.stub, self.max_tokens = stub, max_tokens
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.counts = {"completed": 0, "cut_short": 0, "refused": 0}
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(streams)]

    def _run(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            req = common_pb2.GenerateRequest(
                text=f"stream {i} request {n}:",
                sampling=common_pb2.SamplingParams(max_tokens=self.max_tokens, ignore_eos=True),
            )
            tokens, finished, error = 0, None, ""
            try:
                for ev in self.stub.Generate(req, timeout=600):
                    if ev.HasField("token"):
                        tokens += 1
                    elif ev.HasField("finished"):
                        finished = ev.finished
            except grpc.RpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"
            with self.lock:
                if finished is not None and tokens == self.max_tokens:
                    self.counts["completed"] += 1
                elif tokens == 0 and finished is None:
                    self.counts["refused"] += 1
                    self.errors.append(error)
                    time.sleep(0.2)
                else:
                    self.counts["cut_short"] += 1
                    self.errors.append(f"{tokens}/{self.max_tokens} tokens: {error or 'finished early'}")

    def __enter__(self) -> _Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(600)


def run(
    model: Path | None, workers: int, streams: int, max_tokens: int, drain_timeout: float, tmp: Path
) -> dict[str, object]:
    """The measurement (see the module docstring); returns the figures."""
    cp_addr = f"127.0.0.1:{free_port()}"
    model_args = ["--model", str(model)] if model else []
    procs: dict[str, subprocess.Popen] = {}
    cp = _cli(
        "control-plane",
        "--addr",
        cp_addr,
        "--data-dir",
        str(tmp / "data"),
        "--heartbeat-interval",
        "0.5",
        *model_args,
        log=tmp / "cp.log",
    )
    channel = grpc.insecure_channel(cp_addr)
    stub = control_plane_pb2_grpc.ControlPlaneStub(channel)

    def alive() -> set[str]:
        try:
            return {w.worker_id for w in stub.ListWorkers(common_pb2.Empty(), timeout=2).workers if w.state == "alive"}
        except grpc.RpcError:
            return set()

    def start(wid: str) -> None:
        procs[wid] = _cli(
            "worker",
            "--control-plane",
            cp_addr,
            "--worker-id",
            wid,
            "--device",
            "cpu",
            "--slots",
            "2",
            "--drain-timeout",
            str(drain_timeout),
            *model_args,
            log=tmp / f"{wid}.log",
        )

    try:
        ids = [f"w{i}" for i in range(workers)]
        for wid in ids:
            start(wid)
        _wait(lambda: alive() >= set(ids), 600, "the workers to register")
        restarts = []
        t0 = time.monotonic()
        with _Load(stub, streams, max_tokens) as load:
            time.sleep(2.0)  # load in flight on every worker
            for wid in ids:
                t = time.monotonic()
                procs[wid].send_signal(signal.SIGTERM)
                code = procs[wid].wait(drain_timeout + 30)
                drained_s = time.monotonic() - t
                start(wid)
                _wait(lambda wid=wid: wid in alive(), 600, f"{wid} to come back")
                restarts.append({"worker": wid, "exit_code": code, "drain_s": round(drained_s, 2)})
            time.sleep(2.0)
        return {
            "scenario": "rolling restart under load",
            "workers": workers,
            "streams": streams,
            "max_tokens": max_tokens,
            "drain_timeout_s": drain_timeout,
            "seconds": round(time.monotonic() - t0, 1),
            "restarts": restarts,
            **load.counts,
            "errors": load.errors[:10],
        }
    finally:
        channel.close()
        for p in [*procs.values(), cp]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [*procs.values(), cp]:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv: list[str] | None = None) -> dict[str, object]:
    """Parse ``argv``, run, print the JSON figures and return them."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="base model GGUF (default: the embedded one)")
    ap.add_argument("--tiny", action="store_true", help="the tiny synthetic Llama of tests/helpers/tiny_models.py")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--drain-timeout", type=float, default=45.0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="loraplane-bench-drain-") as d:
        tmp = Path(d)
        model = args.model
        if args.tiny:
            sys.path.insert(0, str(ROOT))
            from tests.helpers import tiny_models

            model = tiny_models.model_llama(tmp / "tiny.gguf")
        result = run(model, args.workers, args.streams, args.max_tokens, args.drain_timeout, tmp)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
