"""Reliability figures: how fast the service recovers from clients and peers that misbehave.

``python -m bench.reliability [--reps 3] [--model PATH] [--json FILE] [--repo CHECKOUT …]``
starts one ``loraplane serve`` per checkout (`Serve`) and measures, over raw loopback sockets,
each scenario ``--reps`` times: dropped and reset SSE streams (`drop`, `reset_burst`), a
vanished caller (`vanish`), ``/health`` under load (`health`), inputs that can never run
(`huge_input`), a PostgreSQL outage (`pg_outage`), an idle-connection flood (`idle_flood`),
grammar bombs (`grammar_bomb`), a cold burst (`cold_burst`) and, through `bench.replica_burst`,
a tenant's burst through two replicas. Figures are median [min–max].

Each scenario and its target: ``bench/README.md``, "Details per tool".
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from bench.machine import load_avg, machine_info, machine_line
from bench.replica_burst import replica_burst
from bench.servers import free_port
from bench.stats import Figure
from loraplane.process import cli_module
from loraplane.v1 import common_pb2, control_plane_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
SLOTS, QUEUE = 4, 64
BASE_PROMPT = "Once upon a time"


class Serve:
    """``loraplane serve`` on free loopback ports, HTTP front and both metrics endpoints on."""

    def __init__(self, model: str | None, workdir: Path, repo: Path = ROOT) -> None:
        ports = [free_port() for _ in range(4)]
        self.grpc_addr, http, cp_metrics, w_metrics = (f"127.0.0.1:{p}" for p in ports)
        self.http = f"http://{http}"
        self.cp_metrics = f"http://{cp_metrics}/metrics"
        self.worker_metrics = f"http://{w_metrics}/metrics"
        args = [sys.executable, "-m", cli_module(repo), "serve", "--addr", self.grpc_addr]
        args += ["--data-dir", str(workdir / "data"), "--device", "cpu", "--log-level", "warning"]
        args += ["--slots", str(SLOTS), "--queue-limit", str(QUEUE), "--http-addr", http]
        args += ["--metrics-addr", cp_metrics, "--worker-metrics-addr", w_metrics]
        if model:
            args += ["--model", model]
        self.log = workdir / "serve.log"
        env = {**os.environ, "PYTHONPATH": str(repo)}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(args, cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(self.grpc_addr)
        self.cp = control_plane_pb2_grpc.ControlPlaneStub(self.channel)
        self.model_name = ""

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while "loraplane: serving on" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start; see {self.log}:\n{self.log.read_text(errors='replace')}")
            time.sleep(0.2)
        with urllib.request.urlopen(self.http + "/v1/models", timeout=30) as r:
            self.model_name = json.loads(r.read())["data"][0]["id"]

    def in_flight(self) -> int:
        """Requests in flight on the control plane (``ListWorkers``); -1 when it does not
        answer within 10 s."""
        try:
            return sum(w.in_flight for w in self.cp.ListWorkers(common_pb2.Empty(), timeout=10).workers)
        except grpc.RpcError:
            return -1

    def stop(self) -> None:
        self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


WAIT_S = 120.0  # how long one wait may take before it counts as NaN (--timeout)


def wait_until(predicate: Callable[[], bool], timeout_s: float | None = None) -> float:
    """Seconds until ``predicate()`` held (polled every 10 ms); NaN past ``timeout_s``
    (default `WAIT_S`)."""
    limit = WAIT_S if timeout_s is None else timeout_s
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > limit:
            return float("nan")
        time.sleep(0.01)
    return time.monotonic() - t0


def open_request(serve: Serve, *, stream: bool, max_tokens: int) -> socket.socket:
    """A raw HTTP/1.1 completion request, sent; its response left unread."""
    host, port = serve.http.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(
        {
            "model": serve.model_name,
            "prompt": BASE_PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()
    s = socket.create_connection((host, int(port)), timeout=120)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    s.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def reset(s: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a client that crashes does."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()


def first_token_s(serve: Serve) -> float:
    """Seconds from sending a streaming request to its first token chunk."""
    t0 = time.monotonic()
    s = open_request(serve, stream=True, max_tokens=4)
    try:
        seen = b""
        while b'"text"' not in seen:
            chunk = s.recv(65536)
            if not chunk:
                return float("nan")
            seen += chunk
        return time.monotonic() - t0
    finally:
        s.close()


def worker_cancelled(serve: Serve) -> float:
    text = urllib.request.urlopen(serve.worker_metrics, timeout=30).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("loraplane_worker_requests_total{") and 'outcome="cancelled"' in line
    )


def drop(serve: Serve) -> dict[str, float]:
    """12 SSE streams dropped: seconds to in-flight 0 and to a new request's first token."""
    n = SLOTS + 8
    socks = [open_request(serve, stream=True, max_tokens=400) for _ in range(n)]
    wait_until(lambda: serve.in_flight() == n)
    for s in socks[:SLOTS]:
        s.recv(4096)  # the running ones: their first chunk
    t0 = time.monotonic()
    for s in socks:
        reset(s)
    freed = wait_until(lambda: serve.in_flight() == 0)
    served = time.monotonic() - t0 + first_token_s(serve)
    return {"in_flight_zero_s": freed, "new_request_first_token_s": served}


def worker_holds(serve: Serve) -> float:
    """Requests the worker holds (``slots_busy`` + ``requests_waiting`` on its /metrics)."""
    text = urllib.request.urlopen(serve.worker_metrics, timeout=30).read().decode()
    names = ("loraplane_worker_slots_busy ", "loraplane_worker_requests_waiting ")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(names))


def reset_burst(serve: Serve) -> dict[str, float]:
    """12 SSE streams with ~4 KB prompts reset as soon as the control plane relays them all
    (the worker tokenizes one text at a time, so some are still being submitted): seconds until
    the worker holds none of them, and until a new streaming request gets its first token. A
    request whose call ended during its submit used to run its 400 tokens for nobody."""
    n = SLOTS + 8
    wait_until(lambda: serve.in_flight() == 0 and worker_holds(serve) == 0)
    host, port = serve.http.removeprefix("http://").rsplit(":", 1)
    prompt = " ".join(f"{BASE_PROMPT} {i}" for i in range(200))  # ~4 KB, ~1000 tokens
    body = {"model": serve.model_name, "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=120)
        s.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        socks.append(s)
    wait_until(lambda: serve.in_flight() == n)
    t0 = time.monotonic()
    for s in socks:
        reset(s)
    idle = wait_until(lambda: worker_holds(serve) == 0)
    served = time.monotonic() - t0 + first_token_s(serve)
    return {"worker_holds_none_s": idle, "new_request_first_token_s": served}


def vanish(serve: Serve) -> dict[str, float]:
    """A non-streaming client gone mid-generation: seconds to capacity back and to cancelled."""
    wait_until(lambda: serve.in_flight() == 0)
    before = worker_cancelled(serve)
    s = open_request(serve, stream=False, max_tokens=2000)
    wait_until(lambda: serve.in_flight() == 1)
    time.sleep(0.5)
    t0 = time.monotonic()
    s.close()
    freed = wait_until(lambda: serve.in_flight() == 0)
    cancelled = wait_until(lambda: worker_cancelled(serve) > before)
    at = time.monotonic() - t0 if cancelled == cancelled else float("nan")  # NaN: never cancelled
    return {"in_flight_zero_s": freed, "worker_cancelled_s": at}


def health(serve: Serve, probes: int = 10) -> dict[str, float]:
    """``/health`` latency (median of ``probes``) with 68 streams admitted."""
    n = SLOTS + QUEUE
    socks = [open_request(serve, stream=True, max_tokens=200) for _ in range(n)]
    try:
        wait_until(lambda: serve.in_flight() == n)
        times = []
        for _ in range(probes):
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(serve.http + "/health", timeout=WAIT_S) as r:
                    r.read()
                times.append(time.monotonic() - t0)
            except TimeoutError:
                times.append(float("nan"))  # no answer within --timeout: the others would not either
                break
        answered = sorted(t for t in times if t == t)
        if len(answered) < len(times):
            return {"health_s": float("nan"), "health_max_s": float("nan")}
        return {"health_s": answered[len(answered) // 2], "health_max_s": answered[-1]}
    finally:
        for s in socks:
            reset(s)
        wait_until(lambda: serve.in_flight() == 0)


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MB (``/proc/<pid>/status`` VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def post_chat(serve: Serve, n_bytes: int) -> tuple[int, float]:
    """A chat whose one message is ``n_bytes`` of text: (HTTP status, seconds to the answer)."""
    body = {"model": serve.model_name, "messages": [{"role": "user", "content": "a" * n_bytes}], "max_tokens": 1}
    req = urllib.request.Request(
        serve.http + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=WAIT_S) as r:
            status = r.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (TimeoutError, urllib.error.URLError, ConnectionError):
        return 0, float("nan")  # no answer within --timeout
    return status, time.monotonic() - t0


def huge_input(serve: Serve) -> dict[str, float]:
    """Input that can never run: a 4 MB and a 1 MB chat prompt (seconds to the 400), and a body
    that claims 300 MB after 64 KiB (seconds to the 413, and the serve process's RSS growth in
    MB: the control plane runs in it)."""
    out: dict[str, float] = {}
    for label, n in (("chat_4mb_refused_s", 4 << 20), ("chat_1mb_refused_s", 1 << 20)):
        status, seconds = post_chat(serve, n)
        out[label] = seconds if status == 400 else float("nan")
    host, port = serve.http.removeprefix("http://").rsplit(":", 1)
    before = rss_mb(serve.proc.pid)
    conn = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(300_000_000))
    conn.endheaders()
    conn.send(b'{"model": "x", "messages": [{"role": "user", "content": "' + b"a" * 65536)
    t0 = time.monotonic()
    try:
        resp = conn.getresponse()
        resp.read()
        out["body_300mb_413_s"] = time.monotonic() - t0 if resp.status == 413 else float("nan")
    except (TimeoutError, ConnectionError):
        out["body_300mb_413_s"] = float("nan")  # the server waits for the 300 MB it was promised
    conn.close()
    time.sleep(0.2)
    out["body_300mb_rss_growth_mb"] = rss_mb(serve.proc.pid) - before
    return out


def pg_outage(_serve: Serve | None = None, calls: int = 5) -> dict[str, float]:
    """A PostgreSQL outage seen by the store (no serve needed): seconds per failed call with the
    server stopped and with it hung (every process SIGSTOPped), and seconds to the first
    success once it is back. Starts its own PostgreSQL (``tests/helpers/postgres_server.py``: needs
    the repository checkout)."""
    from control_plane.errors import DatabaseUnavailableError
    from control_plane.store import open_store
    from tests.helpers.postgres_server import start_postgres

    server = start_postgres()
    out: dict[str, float] = {}
    try:
        store = open_store(server.create_database("bench"), tempfile.mkdtemp(prefix="loraplane-bench-pg-"))
        store.list()
        for kind in ("stopped", "hung"):
            frozen: list[int] = []
            if kind == "stopped":
                server.halt()
            else:
                frozen = server.freeze()
            seconds = []
            try:
                for _ in range(calls):
                    t0 = time.monotonic()
                    try:
                        store.list()
                        raise RuntimeError("a store call succeeded during the outage")
                    except DatabaseUnavailableError:
                        seconds.append(time.monotonic() - t0)
            finally:
                if kind == "stopped":
                    server.resume_after_halt()
                else:
                    server.thaw(frozen)

            def back() -> bool:
                try:
                    store.list()
                    return True
                except DatabaseUnavailableError:
                    return False

            out[f"{kind}_call_s"] = sorted(seconds)[len(seconds) // 2]
            out[f"{kind}_first_success_after_back_s"] = wait_until(back)
        store.close()
    finally:
        server.stop()
    return out


def flood_health_ok(url: str) -> bool:
    """One ``GET url`` answered 200 within 2 s (a refused or reset connection: False)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            r.read()
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def idle_flood(serve: Serve, n: int = 1100, addresses: int = 8) -> dict[str, float]:
    """``n`` idle connections (not a byte sent) to the HTTP API from 127.0.0.2, .3, … (``addresses``
    of them, round robin: below any per-client cap), more than its default cap of 1024: seconds
    for ``GET /health`` on ``--metrics-addr`` right after the flood (older checkouts answer
    there with prometheus-client's server), and seconds from the flood's end until ``GET /health``
    on the API's port answers again (how long the API stays unavailable)."""
    host, port = serve.http.removeprefix("http://").rsplit(":", 1)
    api_health = serve.http + "/health"
    metrics_health = serve.cp_metrics.rsplit("/", 1)[0] + "/health"
    socks: list[socket.socket] = []
    try:
        for i in range(n):
            try:
                src = (f"127.0.0.{2 + i % addresses}", 0)
                socks.append(socket.create_connection((host, int(port)), timeout=5, source_address=src))
            except OSError:
                pass  # the listen backlog full: the flood is as big as it gets
        flood_end = time.monotonic()
        t0 = time.monotonic()
        ok = flood_health_ok(metrics_health)
        health_s = time.monotonic() - t0 if ok else float("nan")
        back = wait_until(lambda: flood_health_ok(api_health))
        return {
            "metrics_port_health_s": health_s,
            "api_unavailable_s": time.monotonic() - flood_end if back == back else back,
        }
    finally:
        for s in socks:
            s.close()
        wait_until(lambda: flood_health_ok(api_health))


def chat_json(serve: Serve, body: dict, timeout_s: float = 300) -> tuple[int, str]:
    """``POST /v1/chat/completions``: (status, body text); status 0 when no answer came."""
    req = urllib.request.Request(
        serve.http + "/v1/chat/completions",
        data=json.dumps(
            {"model": serve.model_name, "messages": [{"role": "user", "content": "JSON please"}], **body}
        ).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, str(exc)


def grammar_bomb(serve: Serve) -> dict[str, float]:
    """The structured-output crash shapes (a 75 KB JSON Schema of 1 000 chained ``$defs``, 5 000
    chained ``$ref``-s, a Lark grammar of 3 000 chained rules, 5 000 GBNF rules, 100 000
    ``guided_choice`` strings), one at a time: the median seconds to the answer, how many were
    400s, and whether the server still serves a plain request afterwards (1) or not (0: the
    control plane died; an old checkout's serve ends here)."""
    from tests.helpers.grammar_bombs import defs_chain, gbnf_chain, lark_chain, refs_chain

    bombs: list[dict[str, Any]] = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": defs_chain(1000)}}},
        {"guided_json": refs_chain(5000)},
        {"guided_grammar": lark_chain(3000)},
        {"guided_grammar": gbnf_chain(5000)},
        {"guided_choice": [f"choice number {i}" for i in range(100_000)]},
    ]
    seconds, refused = [], 0
    for body in bombs:
        t0 = time.monotonic()
        status, _ = chat_json(serve, {**body, "max_tokens": 4}, timeout_s=WAIT_S)
        seconds.append(time.monotonic() - t0 if status else float("nan"))
        refused += status == 400
    status, _ = chat_json(serve, {"max_tokens": 2}, timeout_s=30)
    finite = sorted(x for x in seconds if x == x)
    return {
        "answer_s": finite[len(finite) // 2] if finite else float("nan"),
        "refused_400_n": float(refused),
        "serving_after": float(status == 200),
    }


def cold_burst(repo: Path, model: str | None, workdir: Path) -> dict[str, float]:
    """A fresh ``serve``; the moment it is ready, 8 constrained (each its own JSON Schema) + 4
    plain chat requests at once while ``ListWorkers`` is polled every 20 ms: the longest
    heartbeat age seen (heartbeats every 1 s: its lateness is the age beyond 1 s), failed
    requests, seconds until all answered, and seconds from start to ready."""
    t_start = time.monotonic()
    serve = Serve(model, workdir, repo)
    try:
        serve.wait_ready()
        ready_s = time.monotonic() - t_start
        ages: list[float] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                try:
                    ws = serve.cp.ListWorkers(common_pb2.Empty(), timeout=5).workers
                    live = [w.last_heartbeat_age_s for w in ws if w.state != "dead"]
                    ages.extend(live or [float("inf")])  # declared dead (or dropped): no heartbeat in time
                except grpc.RpcError:
                    pass
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        schemas = [
            {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]} for i in range(8)
        ]
        bodies = [{"guided_json": sc, "max_tokens": 8} for sc in schemas] + [{"max_tokens": 8}] * 4
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
            statuses = [status for status, _ in ex.map(lambda b: chat_json(serve, b), bodies)]
        burst_s = time.monotonic() - t0
        stop.set()
        watcher.join()
        longest = max(ages) if ages else float("nan")
        return {
            "heartbeat_max_age_s": longest,
            "heartbeat_late_s": max(0.0, longest - 1.0),
            "failed_n": float(sum(st != 200 for st in statuses)),
            "burst_s": burst_s,
            "ready_s": ready_s,
        }
    finally:
        serve.stop()


SCENARIOS: dict[str, Callable[[Serve], dict[str, float]]] = {
    "drop": drop,
    "reset_burst": reset_burst,
    "vanish": vanish,
    "health": health,
    "input": huge_input,
    "pg": pg_outage,
    "idle_flood": idle_flood,
    "grammar_bomb": grammar_bomb,  # last of those on one serve: an old checkout's dies here
}
NEEDS_SERVE = ("drop", "reset_burst", "vanish", "health", "input", "idle_flood", "grammar_bomb")
OWN_SERVE: dict[str, Callable[[Path, str | None, Path], dict[str, float]]] = {
    "cold_burst": cold_burst,
    "replica_burst": replica_burst,
}
"""Scenarios that start a fresh ``serve`` of each checkout per repetition."""


def git_head(repo: Path) -> str:
    """``repo``'s short commit id ("?" outside git)."""
    r = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "?"


def main(argv: list[str] | None = None) -> int:
    global WAIT_S
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default=None, help="base model GGUF (default: the embedded Gemma 3 270M)")
    every = [*SCENARIOS, *OWN_SERVE]
    ap.add_argument("--scenarios", default=",".join(every), help="comma-separated subset of " + ",".join(every))
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--timeout", type=float, default=WAIT_S, help="seconds one wait may take (then NaN)")
    ap.add_argument(
        "--repo",
        action="append",
        default=None,
        help="serve from this checkout (repeat: before vs after in one run, each scenario for each; default: this one)",
    )
    args = ap.parse_args(argv)
    WAIT_S = args.timeout
    machine = machine_info("packed", "cpu", "float32")
    print(machine_line(machine), f"load {load_avg()}", flush=True)
    results: dict[str, dict] = {}
    names = args.scenarios.split(",")

    repos = [Path(r).resolve() for r in (args.repo or [str(ROOT)])]

    def run(name: str, serve: Serve | None, label: str = "", repo: Path | None = None) -> None:
        if name in OWN_SERVE:
            runs = []
            for _ in range(args.reps):
                with tempfile.TemporaryDirectory(prefix="loraplane-bench-reliability-") as tmp:
                    runs.append(OWN_SERVE[name](repo or ROOT, args.model, Path(tmp)))
        else:
            runs = [SCENARIOS[name](serve) for _ in range(args.reps)]  # type: ignore[arg-type]
        for key in runs[0]:
            unit = "MB" if key.endswith("_mb") else "" if key.endswith(("_n", "_after")) else "s"
            fig = Figure.of((r[key] for r in runs), unit)
            results[f"{label}{name}.{key}"] = fig.to_json()
            spread = f"[{fig.min:.3f}–{fig.max:.3f}] (n={fig.n})"
            print(f"{label}{name:8s} {key:36s} {fig.median:8.3f} {unit:2s} {spread}", flush=True)

    for repo in repos if any(n in NEEDS_SERVE for n in names) else []:
        label = f"{repo.name}@{git_head(repo)}: " if len(repos) > 1 else ""
        with tempfile.TemporaryDirectory(prefix="loraplane-bench-reliability-") as tmp:
            serve = Serve(args.model, Path(tmp), repo)
            try:
                serve.wait_ready()
                # grammar_bomb last: an old checkout's control plane does not survive it
                for name in sorted((n for n in names if n in NEEDS_SERVE), key=lambda n: n == "grammar_bomb"):
                    run(name, serve, label)
            finally:
                serve.stop()
    for repo in repos:
        label = f"{repo.name}@{git_head(repo)}: " if len(repos) > 1 else ""
        for name in names:
            if name in OWN_SERVE:
                run(name, None, label, repo)
    for name in names:
        if name not in NEEDS_SERVE and name not in OWN_SERVE:
            run(name, None)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
