"""HTTP clients that leave, against a real ``loraplane serve`` (2 slots, queue limit 70) over
raw loopback sockets: the control plane's in-flight count follows each relay's lifetime, so
dropped streams, vanished non-streaming callers and stalled readers give their worker capacity
back at once, and ``/health`` answers while the HTTP front relays dozens of streams.

The in-flight count is read from ``ListWorkers`` (``WorkerInfo.in_flight``), the number the
router admits against (slots + queue limit); ``loraplane_requests_total{outcome="cancelled"}``
on the control plane's ``/metrics`` counts the requests whose client left.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from loraplane.v1 import common_pb2, control_plane_pb2_grpc
from tests.helpers.http_serve import start_http_serve

pytestmark = pytest.mark.slow

SLOTS, QUEUE = 2, 70
CEILING_S = 20.0  # generous wall-clock bound for what is promised within one decode step / 1 s


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    s = start_http_serve(tmp_path_factory.mktemp("http-drop"), "--queue-limit", str(QUEUE))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cp(serve):
    with grpc.insecure_channel(serve.grpc_addr) as channel:
        yield control_plane_pb2_grpc.ControlPlaneStub(channel)


def in_flight(cp) -> int:
    return sum(w.in_flight for w in cp.ListWorkers(common_pb2.Empty(), timeout=10).workers)


def wait_until(predicate, timeout: float = CEILING_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


def open_request(serve, *, stream: bool, max_tokens: int = 2000) -> socket.socket:
    """A raw HTTP/1.1 completion request, sent; the response is left unread."""
    host, port = serve.http.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(
        {
            "model": "gemma-3-270m-q4_k_m",
            "prompt": "Once upon a time",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()
    s = socket.create_connection((host, int(port)), timeout=30)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    s.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def health_seconds(serve) -> float:
    t0 = time.monotonic()
    with urllib.request.urlopen(serve.http + "/health", timeout=60) as r:
        assert r.status == 200
    return time.monotonic() - t0


def cancelled_total(serve) -> float:
    text = urllib.request.urlopen(serve.cp_metrics, timeout=30).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("loraplane_requests_total{") and 'outcome="cancelled"' in line
    )


def complete(serve, max_tokens: int = 4) -> dict:
    req = urllib.request.Request(
        serve.http + "/v1/completions",
        data=json.dumps({"model": "gemma-3-270m-q4_k_m", "prompt": "Hi", "max_tokens": max_tokens}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def worker_outcomes(serve) -> dict[str, float]:
    """``loraplane_worker_requests_total`` by outcome, summed over adapters."""
    out: dict[str, float] = {}
    for line in urllib.request.urlopen(serve.worker_metrics, timeout=30).read().decode().splitlines():
        if line.startswith("loraplane_worker_requests_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = out.get(outcome, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_vanished_non_streaming_client_cancels_its_generation(serve, cp):
    """A non-streaming request (2000 tokens) whose client leaves while it generates: the worker
    ends it as ``cancelled`` (not ``length``: it was not run to the end) and the capacity is
    back."""
    assert wait_until(lambda: in_flight(cp) == 0)
    before = worker_outcomes(serve)
    s = open_request(serve, stream=False, max_tokens=2000)
    try:
        assert wait_until(lambda: in_flight(cp) == 1), in_flight(cp)
        time.sleep(0.5)  # generating now
    finally:
        s.close()
    assert wait_until(lambda: in_flight(cp) == 0), in_flight(cp)
    assert wait_until(lambda: worker_outcomes(serve).get("cancelled", 0) == before.get("cancelled", 0) + 1), (
        before,
        worker_outcomes(serve),
    )
    assert worker_outcomes(serve).get("length", 0) == before.get("length", 0)
    assert complete(serve)["choices"][0]["finish_reason"] == "length"


def test_dropped_streams_free_capacity_and_health_answers_under_load(serve, cp):
    """68 SSE streams admitted (2 running, 66 queued on the worker): ``/health`` still answers;
    the clients close their sockets (some after their first chunk, the queued ones before
    any): the in-flight count returns to 0, each is counted cancelled, and a new request is
    served."""
    n = 68
    before = cancelled_total(serve)
    socks = [open_request(serve, stream=True) for _ in range(n)]
    try:
        assert wait_until(lambda: in_flight(cp) == n), in_flight(cp)
        assert health_seconds(serve) < 5.0  # served on the event loop, not behind relay threads
        # the running ones (whichever reached the worker first) stream: read a first chunk
        ready, _, _ = select.select(socks, [], [], 120)
        assert ready, "no stream produced a byte"
        assert ready[0].recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        for s in socks:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
            s.close()
    assert wait_until(lambda: in_flight(cp) == 0), in_flight(cp)
    assert wait_until(lambda: cancelled_total(serve) - before == n), cancelled_total(serve) - before
    assert complete(serve)["choices"][0]["finish_reason"] in ("length", "stop")


def test_normal_close_of_streams_frees_capacity(serve, cp):
    """The same with an orderly FIN instead of RST, after reading the first chunk."""
    socks = [open_request(serve, stream=True) for _ in range(SLOTS)]
    try:
        for s in socks:
            s.settimeout(120)
            assert b"data: " in s.recv(4096) or b"data: " in s.recv(4096)
        assert in_flight(cp) == SLOTS
    finally:
        for s in socks:
            s.shutdown(socket.SHUT_RDWR)
            s.close()
    assert wait_until(lambda: in_flight(cp) == 0), in_flight(cp)


def test_cancelled_grpc_generate_is_counted_cancelled_and_frees_capacity(serve, cp):
    """The gRPC path shares the accounting: a client cancelling its Generate mid-stream."""
    assert wait_until(lambda: in_flight(cp) == 0)
    before = cancelled_total(serve)
    request = common_pb2.GenerateRequest(text="Once upon a time")
    request.sampling.max_tokens, request.sampling.ignore_eos = 2000, True
    call = cp.Generate(request, timeout=300)
    kinds = []
    for event in call:
        kinds.append(event.WhichOneof("event"))
        if kinds.count("token") == 3:
            break
    call.cancel()
    assert kinds[0] == "started"
    assert wait_until(lambda: in_flight(cp) == 0), in_flight(cp)
    assert wait_until(lambda: cancelled_total(serve) == before + 1), cancelled_total(serve) - before


def worker_pid(serve) -> int:
    """The pid of serve's worker process (its one child), from ``/proc``."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == serve.proc.pid:  # ppid
            children.append(int(stat.parent.name))
    assert len(children) == 1, children
    return children[0]


def test_stopped_worker_releases_its_clients_once_declared_dead(serve, cp):
    """``kill -STOP`` of the worker with streams running used to leave every client without a
    byte for as long as it stayed stopped. Here (a real worker process, real gRPC and HTTP
    clients), once the control plane declares it dead (3 missed heartbeats of 1 s), each relay
    is cut: the gRPC stream ends UNAVAILABLE naming the worker and why, the HTTP stream with
    its error event; in-flight is back to 0; after SIGCONT the worker serves again."""
    assert wait_until(lambda: in_flight(cp) == 0)
    req = common_pb2.GenerateRequest(
        text="Once upon a time",
        adapters=common_pb2.AdapterMap(),
        sampling=common_pb2.SamplingParams(max_tokens=2000, ignore_eos=True),
    )
    # one gRPC and one HTTP stream: both slots generating; the deadline only bounds a failure
    calls = [cp.Generate(req, timeout=3.0 + 2 * CEILING_S)]
    for call in calls:
        while not next(call).HasField("token"):
            pass
    s = open_request(serve, stream=True, max_tokens=2000)
    s.settimeout(CEILING_S)
    received = b""
    while b'"text"' not in received:  # its first token chunk
        chunk = s.recv(65536)
        assert chunk, received
        received += chunk
    pid = worker_pid(serve)
    assert wait_until(lambda: in_flight(cp) == 2), in_flight(cp)
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                for _ in call:
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "declared dead (no heartbeat for" in info.value.details()
        while b"data: [DONE]" not in received:
            chunk = s.recv(65536)
            assert chunk, received[-500:]
            received += chunk
        took = time.monotonic() - started
        assert b"declared dead" in received
        assert took < 3.0 + CEILING_S
        assert wait_until(lambda: in_flight(cp) == 0), in_flight(cp)
    finally:
        s.close()
        os.kill(pid, signal.SIGCONT)
    assert wait_until(lambda: any(w.state == "alive" for w in cp.ListWorkers(common_pb2.Empty()).workers))
    assert complete(serve)["choices"][0]["finish_reason"] in ("length", "stop")
