"""A request whose client went away frees the worker's queue at once (tiny llama-MoE model,
in-process; the worker's gRPC server on a real loopback port for the Decode call):

- a cancelled request takes no place in ``--slots`` + ``--queue-limit`` even before the loop
  drops it (the loop may be in the middle of a long step);
- a Decode call cancelled while its request is still being submitted (here: waiting for the
  tokenizer, which runs one text at a time) does not leave that request queued and running for
  nobody: the slot is free for the next request at once.
"""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest

from loraplane.adapter_scales import NO_ADAPTERS
from loraplane.v1 import worker_pb2, worker_pb2_grpc
from tests.helpers.live_servers import wait_until
from tests.helpers.worker_service import gen
from worker.config import WorkerConfig
from worker.errors import QueueFullError
from worker.runtime.sampling import SamplingParams
from worker.serving.engine import WorkerEngine
from worker.serving.request import ErrorEvent, FinishedEvent

PROMPT = [1, 450, 4996, 17354]


def _config(fixtures_dir, **fields) -> WorkerConfig:
    return WorkerConfig(
        model_path=str(fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"),
        device="cpu",
        grammar_warmup=False,
        **fields,
    )


def _submit(e: WorkerEngine, rid: str, events: queue.Queue, max_tokens: int = 4):
    return e.submit(
        request_id=rid,
        prompt_tokens=PROMPT,
        prompt_text=None,
        params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        adapters=NO_ADAPTERS,
        emit=lambda ev: events.put((rid, ev)),
    )


def _end_of(events: queue.Queue, rid: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got, ev = events.get(timeout=deadline - time.monotonic())
        if got == rid and isinstance(ev, (FinishedEvent, ErrorEvent)):
            return ev
    raise AssertionError(f"{rid} did not end")


def test_a_cancelled_request_takes_no_queue_place_before_the_loop_drops_it(fixtures_dir):
    e = WorkerEngine(_config(fixtures_dir, n_seqs=1, queue_limit=1, n_ctx_seq=256))
    events: queue.Queue = queue.Queue()
    in_step, release = threading.Event(), threading.Event()
    # the loop held between two turns, as by a long step: it drops nothing meanwhile
    e.scheduler.run_soon(lambda: (in_step.set(), release.wait(30)))
    try:
        assert in_step.wait(10)
        _submit(e, "first", events)
        gone = _submit(e, "gone", events)  # slots 1 + --queue-limit 1: full now
        with pytest.raises(QueueFullError):
            _submit(e, "refused", events)
        gone.cancelled.set()  # its client went away
        _submit(e, "next", events)  # takes the place the cancelled one left
    finally:
        release.set()
    try:
        assert _end_of(events, "first").finish_reason == "length"
        assert _end_of(events, "next").finish_reason == "length"
        assert e.stats().scheduler.queue_depth == 0
    finally:
        e.close()


@pytest.mark.slow  # ~1 s: a gRPC server and two calls
def test_a_call_cancelled_during_its_submit_leaves_no_request_running(fixtures_dir):
    from worker.rpc.server import create_server

    server, port, e = create_server(_config(fixtures_dir, addr="127.0.0.1:0", n_seqs=1, queue_limit=0, n_ctx_seq=2048))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = worker_pb2_grpc.WorkerStub(channel)
    try:
        with e._tokenize_lock:  # another text being tokenized: this request's submit waits
            call = stub.Decode(
                iter([worker_pb2.DecodeRequest(submit=gen("gone", text="hello", max_tokens=1500))]), timeout=60
            )
            assert wait_until(lambda: server.servicer.open_decode_calls() == 1, 10, 0.01)
            time.sleep(0.2)  # the reader thread has taken the request and waits for the tokenizer
            call.cancel()  # the client went away (the control plane cancels the worker call)
            assert wait_until(lambda: server.servicer.open_decode_calls() == 0, 10, 0.01)
        # the submit completes now, for a call that is over: the request must not hold the slot
        time.sleep(0.2)  # (the submit ends within milliseconds once the tokenizer is free)
        assert wait_until(lambda: e.stats().scheduler.slots_busy + e.stats().scheduler.queue_depth == 0, 2, 0.01)
        done = list(
            stub.Decode(iter([worker_pb2.DecodeRequest(submit=gen("next", text="hi", max_tokens=2))]), timeout=30)
        )
        assert done[-1].finished.finish_reason == "length"
        assert e.stats().scheduler.tokens_generated < 10  # "gone" ran a step at most, never its 1500 tokens
    finally:
        channel.close()
        server.stop(0).wait()
        e.close()
