"""Structured output cannot take a process down: the crash shapes of a break-it round (a flat
JSON Schema of 1 000 chained ``$defs``, 5 000 chained ``$ref``-s, a Lark grammar of 3 000
chained rules, 5 000 GBNF rules) against a real ``loraplane serve``, over HTTP and gRPC.

The server runs with the grammar limits raised far past the crash points, so the formats reach
the grammar engine: it crashes in a grammar-check child of the control plane, that request
alone gets 400 / INVALID_ARGUMENT, and the same process keeps serving (on main the first one
killed the control plane with SIGSEGV). With the default limits the same formats are refused
before the engine runs (tests/unit/test_grammar_limits.py).

The worker is started with its grammar warm-up (the suite turns it off elsewhere): a cold burst
of 8 constrained + 4 plain requests right after start-up all succeed while heartbeats keep
arriving (four concurrent first constrained requests used to starve them until the worker was
declared dead), and the warm-up finishes before the worker registers.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from loraplane.v1 import common_pb2, control_plane_pb2_grpc
from tests.helpers.grammar_bombs import defs_chain, gbnf_chain, lark_chain, refs_chain
from tests.helpers.http_serve import start_http_serve

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


CRASHERS = {
    "defs": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": defs_chain(1000)}}},
    "refs": {"guided_json": refs_chain(5000)},
    "lark": {"guided_grammar": lark_chain(3000)},
    "gbnf": {"guided_grammar": gbnf_chain(5000)},
}


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    s = start_http_serve(
        tmp_path_factory.mktemp("grammar-serve"),
        "--log-level",
        "info",
        "--grammar-warmup",
        "--grammar-max-depth",
        "1000000",
        "--grammar-max-rules",
        "1000000",
        "--grammar-max-bytes",
        "100000000",
        "--grammar-check-timeout",
        "2",
        "--slots",
        "4",
    )
    yield s
    s.stop()


def chat(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 6, "temperature": 0, **body})


def test_cold_burst_is_served_while_heartbeats_keep_coming(serve):
    log = Path(serve.proc.args[serve.proc.args.index("--data-dir") + 1]).parent / "serve.log"
    text = log.read_text(errors="replace")
    # the warm-up ends before the worker registers: no heartbeat ever waits on its engine holds
    assert text.index('"grammar_vocabulary_ready"') < text.index('"worker_registered"')
    ages: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        with grpc.insecure_channel(serve.grpc_addr) as ch:
            stub = control_plane_pb2_grpc.ControlPlaneStub(ch)
            while not stop.is_set():
                ages.extend(w.last_heartbeat_age_s for w in stub.ListWorkers(common_pb2.Empty(), timeout=10).workers)
                time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    schemas = [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]} for i in range(8)
    ]
    try:
        with httpx.Client(base_url=serve.http, timeout=300) as http, concurrent.futures.ThreadPoolExecutor(12) as ex:
            constrained = [ex.submit(chat, http, guided_json=s) for s in schemas]
            plain = [ex.submit(chat, http) for _ in range(4)]
            answers = [f.result() for f in constrained + plain]
    finally:
        stop.set()
        watcher.join()
    assert [r.status_code for r in answers] == [200] * 12, [r.text[:200] for r in answers]
    for i, r in enumerate(answers[:8]):
        content = r.json()["choices"][0]["message"]["content"]
        assert content.startswith(f'{{"k{i}":'), content
    # heartbeats every 1 s, dead after 3 missed: never near it (the bench measures the gap)
    assert ages and max(ages) < 2.5, max(ages)


@pytest.mark.parametrize("shape", sorted(CRASHERS))
def test_a_crashing_format_is_that_requests_400_and_the_server_goes_on(serve, shape):
    with httpx.Client(base_url=serve.http, timeout=120) as http:
        r = chat(http, **CRASHERS[shape])
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["code"] == "invalid_response_format"
        # the child died (SIGSEGV), or was killed at --grammar-check-timeout (GBNF's conversion
        # to Lark takes seconds before it would crash)
        assert "the grammar engine crashed on this format" in err["message"] or (
            shape == "gbnf" and "took longer than 2 s and was stopped (--grammar-check-timeout)" in err["message"]
        ), err["message"]
        assert len(err["message"]) < 400 and "panicked" not in err["message"]
        # the same process serves the next constrained request
        ok = chat(http, guided_json=SCHEMA)
        assert ok.status_code == 200, ok.text[:300]
        assert ok.json()["choices"][0]["message"]["content"].startswith('{"n":')


def test_responses_formats_and_forced_tools_check_in_the_isolate_too(serve):
    """``/v1/responses`` compiles ``text.format`` and a forced tool's schema in the same
    grammar-check children: a crashing one is that request's 400, named in Responses terms."""
    with httpx.Client(base_url=serve.http, timeout=120) as http:
        fmt = {"type": "json_schema", "name": "x", "schema": defs_chain(1000)}
        r = http.post("/v1/responses", json={"input": "Answer in JSON.", "text": {"format": fmt}})
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("text.format.schema", "invalid_response_format")
        assert "the grammar engine crashed on this format" in err["message"], err["message"]
        tool = {"type": "function", "name": "f", "parameters": defs_chain(1000), "strict": False}
        r = http.post("/v1/responses", json={"input": "Call f.", "tools": [tool], "tool_choice": "required"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text[:300]
        assert "the grammar engine crashed on this format" in r.json()["error"]["message"]
        fmt = {"type": "json_schema", "name": "n", "schema": SCHEMA}
        ok = http.post(
            "/v1/responses", json={"input": "Answer in JSON.", "text": {"format": fmt}, "max_output_tokens": 6}
        )
        assert ok.status_code == 200, ok.text[:300]
        assert ok.json()["output"][0]["content"][0]["text"].startswith('{"n":')


def test_the_grpc_path_checks_in_the_isolate_too(serve):
    rf = common_pb2.ResponseFormat(type=common_pb2.ResponseFormat.TYPE_JSON_SCHEMA, schema=json.dumps(refs_chain(5000)))
    request = common_pb2.GenerateRequest(
        text="Hi", sampling=common_pb2.SamplingParams(max_tokens=4, response_format=rf)
    )
    with grpc.insecure_channel(serve.grpc_addr) as ch:
        stub = control_plane_pb2_grpc.ControlPlaneStub(ch)
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Generate(request, timeout=60))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the grammar engine crashed" in exc.value.details()
        assert stub.ListWorkers(common_pb2.Empty(), timeout=10).workers[0].state == "alive"


def test_a_huge_choice_list_is_refused_at_once_naming_the_limit(serve):
    with httpx.Client(base_url=serve.http, timeout=120) as http:
        t0 = time.monotonic()
        r = chat(http, guided_choice=[f"choice number {i}" for i in range(100_000)])
        assert r.status_code == 400
        assert time.monotonic() - t0 < 30  # was 101-103 s of the worker, then a 400 with a Rust panic
        err = r.json()["error"]
        assert err["param"] == "guided_choice"
        assert (
            "'guided_choice': the number of choices is 100000, over the limit of 1024 (--grammar-max-choices)"
            in (err["message"])
        )
        ok = chat(http, guided_choice=["yes", "no"])
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in ("yes", "no")
