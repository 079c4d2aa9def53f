"""Helpers for tests/parity/test_worker_service.py: a real worker process driven over gRPC, and the
teacher-forced / greedy-argmax comparison against the fixture goldens (fixtures README).

``WorkerProcess`` runs ``serve_worker`` in a child process (``sys.executable -c``), parses
``worker <id> listening on port <port>`` from its stdout, waits for health SERVING, and wraps
the Worker RPCs; ``Result`` collects one request's events off a Decode stream.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraplane.v1 import common_pb2 as pb
from loraplane.v1 import worker_pb2, worker_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
CALL_TIMEOUT = 180.0


# --- worker processes -------------------------------------------------------------------------

_LAUNCH = (
    "import logging, structlog; "
    "structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO)); "
    "from worker.rpc.server import serve_worker; from worker.config import *; "
    "serve_worker(WorkerConfig(addr='127.0.0.1:0', device='cpu', dtype='f32', grammar_warmup=False, {args}))"
)


class WorkerProcess:
    """A ``serve_worker`` child process, its port (parsed from stdout) and gRPC stubs.
    ``prelude``: Python run in the child before the worker starts (a test's fault injection)."""

    def __init__(self, name: str, config_args: str, prelude: str = ""):
        self.name = name
        self.lines: collections.deque[str] = collections.deque(maxlen=400)
        self._port_found = threading.Event()
        self.port = 0
        self.worker_id = ""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", prelude + "\n" + _LAUNCH.format(args=config_args)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        # keep draining stdout (logs go there too) so the child never blocks on a full pipe
        threading.Thread(target=self._drain, daemon=True, name=f"{name}-stdout").start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = re.search(r"worker (\S+) listening on port (\d+)", line)
            if m and not self._port_found.is_set():
                self.worker_id, self.port = m.group(1), int(m.group(2))
                self._port_found.set()

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._port_found.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {self.name} did not start (rc={self.proc.poll()}):\n" + self.log_tail())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        health = health_pb2_grpc.HealthStub(self.channel)
        while True:
            try:
                if (
                    health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {self.name} never reported SERVING:\n" + self.log_tail())
            time.sleep(0.2)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(list(self.lines)[-n:])

    def stop(self) -> None:
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    # --- calls -------------------------------------------------------------------------------
    def load(self, adapter_id: int, path: Path | None = None, data: bytes | None = None) -> pb.AdapterInfo:
        if data is None:
            chunks = [pb.AdapterChunk(id=adapter_id, server_path=str(path))]
        else:  # upload in 1 MiB chunks, header on the first
            step = 1 << 20
            chunks = [pb.AdapterChunk(id=adapter_id, data=data[:step])]
            chunks += [pb.AdapterChunk(data=data[i : i + step]) for i in range(step, len(data), step)]
        return self.stub.LoadAdapter(iter(chunks), timeout=60)

    def stats(self) -> worker_pb2.WorkerStats:
        return self.stub.Stats(pb.Empty(), timeout=10)

    def wait_idle(self, timeout: float = 20.0) -> worker_pb2.WorkerStats:
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s.slots_busy == 0 and s.queue_depth == 0:
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"worker {self.name} still busy after {timeout}s: {s}")
            time.sleep(0.05)

    def decode(self, reqs: list[pb.GenerateRequest], timeout: float = CALL_TIMEOUT) -> dict[str, Result]:
        """Submit ``reqs`` on one Decode stream; collect every request's events until all finish."""
        out = {r.request_id: Result(r.request_id) for r in reqs}
        call = self.stub.Decode(iter([worker_pb2.DecodeRequest(submit=r) for r in reqs]), timeout=timeout)
        for ev in call:
            out[ev.request_id].add(ev)
        for r in out.values():
            assert r.finished, f"{r.rid}: stream ended without a finished event"
        return out

    def run(self, req: pb.GenerateRequest, timeout: float = CALL_TIMEOUT) -> Result:
        return self.decode([req], timeout)[req.request_id]

    def run_concurrently(self, reqs: list[pb.GenerateRequest]) -> dict[str, Result]:
        """One Decode stream per request (what the control plane does), all started together."""
        out: dict[str, Result] = {}
        errors: list[BaseException] = []
        barrier = threading.Barrier(len(reqs))

        def one(r):
            try:
                barrier.wait(10)
                out[r.request_id] = self.run(r)
            except BaseException as exc:  # re-raised in the test thread
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(r,)) for r in reqs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(CALL_TIMEOUT + 10)
        if errors:
            raise errors[0]
        return out

    def error_of(self, req: pb.GenerateRequest) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as info:
            self.run(req, timeout=60)
        return info.value


@dataclass
class Result:
    rid: str
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    steps: list[pb.StepTelemetry] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finished: pb.Finished | None = None
    finished_at: float = 0.0

    def add(self, ev: pb.GenerateEvent) -> None:
        kind = ev.WhichOneof("event")
        if kind == "started":
            self.prompt_ids = list(ev.started.prompt_token_ids)
            self.prompt_logprobs = [e.logprob if e.has_logprob else None for e in ev.started.prompt_logprobs]
        elif kind == "token":
            self.tokens.append(ev.token.token_id)
            self.logprobs.append(ev.token.logprob)
            self.steps.append(ev.token.step)
            self.token_times.append(time.monotonic())
        else:
            self.finished = ev.finished
            self.finished_at = time.monotonic()

    @property
    def telemetry(self) -> pb.RequestTelemetry:
        return self.finished.telemetry


def gen(
    rid: str,
    *,
    text: str | None = None,
    tokens: list[int] | None = None,
    adapters: list[tuple[int, float]] | None = (),
    max_tokens: int = 24,
    prompt_logprobs: bool = False,
    ignore_eos: bool = True,
    logprobs: int = 0,
) -> pb.GenerateRequest:
    """A greedy GenerateRequest; ``adapters=None`` leaves the adapter map unset."""
    r = pb.GenerateRequest(
        request_id=rid,
        sampling=pb.SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            prompt_logprobs=prompt_logprobs,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
        ),
    )
    if text is not None:
        r.text = text
    else:
        r.tokens.ids.extend(tokens)
    if adapters is not None:
        r.adapters.SetInParent()  # present even when empty: "exactly these adapters"
        r.adapters.entries.extend(pb.AdapterScale(id=i, scale=s) for i, s in adapters)
    return r


# --- parity helpers ---------------------------------------------------------------------------


def find_last(tokens: list[int], needle: tuple[int, ...]) -> int:
    for s in range(len(tokens) - len(needle), -1, -1):
        if tuple(tokens[s : s + len(needle)]) == needle:
            return s
    return -1


def teacher_forced(
    w: WorkerProcess, cases: list[tuple[list[int], list[int], list[tuple[int, float]]]], tag: str
) -> list[Result]:
    """Send prompt + reference tokens with prompt_logprobs; returns one Result per case (its
    ``prompt_logprobs[len(prompt) + j]`` is our log-prob of reference token j)."""
    reqs = [
        gen(f"{tag}-tf-{i}", tokens=p + ref, adapters=ad, max_tokens=1, prompt_logprobs=True)
        for i, (p, ref, ad) in enumerate(cases)
    ]
    res = w.decode(reqs)
    return [res[r.request_id] for r in reqs]


def greedy_argmax(w: WorkerProcess, prompt: list[int], ref: list[int], adapters, tag: str) -> list[int]:
    """Our argmax at every reference position (teacher-forced), via greedy restarts."""
    ours: list[int] = []
    calls = 0
    while len(ours) < len(ref):
        j = len(ours)
        res = w.run(gen(f"{tag}-am-{calls}", tokens=prompt + ref[:j], adapters=adapters, max_tokens=len(ref) - j))
        calls += 1
        for tok in res.tokens:
            ours.append(tok)
            if tok != ref[len(ours) - 1] or len(ours) == len(ref):
                break
    return ours


def greedy_argmax_many(w: WorkerProcess, cases, tag: str) -> list[list[int]]:
    """``greedy_argmax`` for every case, all at once (one thread and stream per case)."""
    out: list[list[int] | None] = [None] * len(cases)
    errors: list[BaseException] = []

    def one(i, p, ref, ad):
        try:
            out[i] = greedy_argmax(w, p, ref, ad, f"{tag}-{i}")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i, *c)) for i, c in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors:
        raise errors[0]
    return out


@dataclass
class GroupStats:
    name: str
    case_means: list[float]
    deltas: list[float]
    argmax_hits: int
    argmax_total: int

    @property
    def p95(self) -> float:
        return float(np.percentile(self.deltas, 95))

    @property
    def argmax_rate(self) -> float:
        return self.argmax_hits / self.argmax_total if self.argmax_total else 1.0

    def __str__(self) -> str:
        return (
            f"{self.name}: cases={len(self.case_means)} mean|d|={np.mean(self.deltas):.4f} "
            f"worst case mean={max(self.case_means):.4f} p95={self.p95:.4f} max={max(self.deltas):.4f} "
            f"argmax={self.argmax_hits}/{self.argmax_total} ({self.argmax_rate * 100:.1f}%)"
        )


def group_stats(
    name: str,
    prompts: list[list[int]],
    refs: list[list[dict]],
    tf: list[Result],
    argmax: list[list[int]] | None,
    margin: float = 0.1,
) -> GroupStats:
    means, deltas, hits, total = [], [], 0, 0
    for i, (p, steps, res) in enumerate(zip(prompts, refs, tf, strict=False)):
        d = []
        for j, st in enumerate(steps):
            ours = res.prompt_logprobs[len(p) + j]
            assert ours is not None and res.prompt_ids[len(p) + j] == st["id"]
            d.append(abs(ours - st["logprob"]))
            top = st["top"]
            if argmax is not None and len(top) > 1 and top[0]["logprob"] - top[1]["logprob"] > margin:
                total += 1
                hits += int(argmax[i][j] == top[0]["id"])
        means.append(float(np.mean(d)))
        deltas += d
    return GroupStats(name, means, deltas, hits, total)


# --- adapter files -------------------------------------------------------------------------------


def second_alora_gguf(src: Path, dst: Path, invocation: list[int]) -> bytes:
    """critic_alora.gguf's metadata and tensors, rewritten with other invocation tokens."""
    import gguf

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, arch=r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "adapter.alora.invocation_tokens":  # uint32 array, as the original
            w.add_key_value(name, list(invocation), gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT32)
        elif name == "general.name":
            w.add_string(name, "critic_alora_copy")
        elif f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(name, f.contents(), f.types[0])
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst.read_bytes()
