"""`CompletionStream` on scripted ``GenerateEvent`` lists: the exact server-sent events and JSON
bodies a client receives, errors before and after the first token, and when the worker call is
cancelled. No model, no processes."""

from __future__ import annotations

import json
import threading

import anyio
import grpc
import pytest

from control_plane.errors import UnavailableError
from control_plane.http.errors import OpenAIError
from control_plane.http.responses import token_text_of
from control_plane.http.streaming import CompletionStream, RelayResponse
from control_plane.router import WorkerRequestError
from tests.helpers.http_fakes import CREATED, FakeTokenizer, endless_stream, finished, scripted, started, token

# prompt of 3 tokens; "Hel" + "lo" + "" streamed; the worker's finished text adds a held-back "!"
EVENTS = [
    started(5, 6, 7),
    token(10, "Hel", -0.25, [(10, -0.25), (11, -1.5), (12, -3.0)]),
    token(11, "lo", -0.125, [(11, -0.125), (9, -2.0)]),
    token(12, "", -1.0, [(12, -1.0)]),
    finished("Hello!", "stop", cached=2),
]
USAGE = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 2}}


class Cancel:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def make(events, *, chat: bool, logprobs: int | None = None, cancel: Cancel | None = None) -> CompletionStream:
    return CompletionStream(
        scripted(*events),
        cancel=cancel or Cancel(),
        request_id="chatcmpl-1" if chat else "cmpl-1",
        created=CREATED,
        model="m",
        chat=chat,
        logprobs=logprobs,
        token_text=token_text_of(FakeTokenizer()),
    )


def data(chunks: list[str]) -> list[dict]:
    """The JSON of each event but the final ``[DONE]``."""
    assert all(c.startswith("data: ") and c.endswith("\n\n") for c in chunks)
    assert chunks[-1] == "data: [DONE]\n\n"
    return [json.loads(c[len("data: ") :]) for c in chunks[:-1]]


def cmpl_chunk(text: str, logprobs=None, finish_reason=None) -> dict:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": CREATED,
        "model": "m",
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def chat_chunk(delta: dict, logprobs=None, finish_reason=None) -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


# ---- streaming: the exact events --------------------------------------------------------------


def test_completion_stream_exact_bytes_with_logprobs_and_usage():
    cancel = Cancel()
    chunks = list(make(EVENTS, chat=False, logprobs=1, cancel=cancel).sse_chunks(include_usage=True))
    head = '{"id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m", '
    assert chunks == [
        "data: "
        + head
        + '"choices": [{"index": 0, "text": "Hel", "logprobs": {"tokens": ["<10>"], "token_logprobs": [-0.25], '
        '"top_logprobs": [{"<10>": -0.25}], "text_offset": [0]}, "finish_reason": null}]}\n\n',
        "data: "
        + head
        + '"choices": [{"index": 0, "text": "lo", "logprobs": {"tokens": ["<11>"], "token_logprobs": [-0.125], '
        '"top_logprobs": [{"<11>": -0.125}], "text_offset": [3]}, "finish_reason": null}]}\n\n',
        "data: "
        + head
        + '"choices": [{"index": 0, "text": "", "logprobs": {"tokens": ["<12>"], "token_logprobs": [-1.0], '
        '"top_logprobs": [{"<12>": -1.0}], "text_offset": [5]}, "finish_reason": null}]}\n\n',
        "data: " + head + '"choices": [{"index": 0, "text": "!", "logprobs": null, "finish_reason": "stop"}]}\n\n',
        "data: " + head + '"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6, '
        '"prompt_tokens_details": {"cached_tokens": 2}}}\n\n',
        "data: [DONE]\n\n",
    ]
    assert cancel.calls == 0  # the stream's owner (RelayResponse) cancels; see the tests below


def test_chat_stream_role_first_then_deltas_finish_usage_done():
    chunks = list(make(EVENTS, chat=True).sse_chunks(include_usage=True))
    assert chunks[0] == (
        'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m", '
        '"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, '
        '"finish_reason": null}]}\n\n'
    )
    assert data(chunks) == [
        chat_chunk({"role": "assistant", "content": ""}),
        chat_chunk({"content": "Hel"}),
        chat_chunk({"content": "lo"}),
        chat_chunk({"content": ""}),
        chat_chunk({"content": "!"}, finish_reason="stop"),
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": "m",
            "choices": [],
            "usage": USAGE,
        },
    ]


def test_chat_stream_logprobs_per_token_with_top_alternatives():
    got = data(list(make(EVENTS, chat=True, logprobs=2).sse_chunks()))
    assert [c["choices"][0]["logprobs"] for c in got] == [
        None,
        {
            "content": [
                {
                    "token": "<10>",
                    "logprob": -0.25,
                    "bytes": [60, 49, 48, 62],
                    "top_logprobs": [
                        {"token": "<10>", "logprob": -0.25, "bytes": [60, 49, 48, 62]},
                        {"token": "<11>", "logprob": -1.5, "bytes": [60, 49, 49, 62]},
                    ],
                }
            ]
        },
        {
            "content": [
                {
                    "token": "<11>",
                    "logprob": -0.125,
                    "bytes": [60, 49, 49, 62],
                    "top_logprobs": [
                        {"token": "<11>", "logprob": -0.125, "bytes": [60, 49, 49, 62]},
                        {"token": "<9>", "logprob": -2.0, "bytes": [60, 57, 62]},
                    ],
                }
            ]
        },
        {
            "content": [
                {
                    "token": "<12>",
                    "logprob": -1.0,
                    "bytes": [60, 49, 50, 62],
                    "top_logprobs": [{"token": "<12>", "logprob": -1.0, "bytes": [60, 49, 50, 62]}],
                }
            ]
        },
        None,  # the finish chunk carries no log-probs
    ]


def test_completion_stream_without_logprobs_or_usage():
    assert data(list(make(EVENTS, chat=False).sse_chunks())) == [
        cmpl_chunk("Hel"),
        cmpl_chunk("lo"),
        cmpl_chunk(""),
        cmpl_chunk("!", finish_reason="stop"),
    ]


def test_text_offsets_count_characters_and_non_ascii_stays_literal():
    events = [started(1), token(3, "é"), token(4, "日本"), token(5, "x"), finished("é日本x", "length")]
    chunks = list(make(events, chat=False, logprobs=0).sse_chunks())
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in data(chunks)[:3]] == [[0], [1], [3]]
    assert '"text": "日本"' in chunks[1]  # UTF-8 in the event, not \\u escapes
    assert data(chunks)[3] == cmpl_chunk("", finish_reason="length")


@pytest.mark.parametrize(
    "final_text, rest",
    [
        ("abc!", "c!"),  # the tail the worker held back (a possible stop string) arrives at the finish
        ("ab", ""),  # everything was streamed
        ("xyz", ""),  # the finished text does not extend what was streamed: nothing more is sent
    ],
)
def test_finish_chunk_sends_the_unstreamed_tail(final_text, rest):
    events = [started(1), token(3, "a"), token(4, "b"), finished(final_text, "stop")]
    assert data(list(make(events, chat=False).sse_chunks()))[-1] == cmpl_chunk(rest, finish_reason="stop")
    assert data(list(make(events, chat=True).sse_chunks()))[-1] == chat_chunk(
        {"content": rest} if rest else {}, finish_reason="stop"
    )


def test_finish_without_tokens():
    events = [started(1, 2), finished("", "length")]
    assert data(list(make(events, chat=True).sse_chunks(include_usage=True))) == [
        chat_chunk({"role": "assistant", "content": ""}),
        chat_chunk({}, finish_reason="length"),
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": "m",
            "choices": [],
            "usage": {
                "prompt_tokens": 2,
                "completion_tokens": 0,
                "total_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        },
    ]


# ---- errors ------------------------------------------------------------------------------------


def test_error_before_first_token_raises_with_its_status_and_cancels():
    cancel = Cancel()
    stream = make([UnavailableError("no live worker")], chat=True, cancel=cancel)
    with pytest.raises(OpenAIError) as err:
        stream.sse_chunks()
    assert (err.value.status, err.value.body()) == (
        503,
        {"error": {"message": "no live worker", "type": "service_unavailable", "param": None, "code": None}},
    )
    assert cancel.calls == 1


def test_worker_refusal_after_started_keeps_the_worker_code():
    events = [started(1), WorkerRequestError(grpc.StatusCode.OUT_OF_RANGE, "prompt too long")]
    with pytest.raises(OpenAIError) as err:
        make(events, chat=False).sse_chunks()
    assert err.value.status == 400 and err.value.code == "out_of_range"


def test_error_mid_stream_is_an_error_event_then_done_without_usage():
    cancel = Cancel()
    events = [started(1), token(3, "ab"), UnavailableError("worker died")]
    chunks = list(make(events, chat=False, cancel=cancel).sse_chunks(include_usage=True))
    assert chunks == [
        'data: {"id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m", '
        '"choices": [{"index": 0, "text": "ab", "logprobs": null, "finish_reason": null}]}\n\n',
        'data: {"error": {"message": "worker died", "type": "service_unavailable", "param": null, "code": null}}\n\n',
        "data: [DONE]\n\n",
    ]


def test_no_events_at_all_ends_with_an_empty_finish():
    assert data(list(make([], chat=False).sse_chunks(include_usage=True))) == [
        cmpl_chunk(""),
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": CREATED,
            "model": "m",
            "choices": [],
            "usage": {
                "prompt_tokens": 0,
                "completion_tokens": 0,
                "total_tokens": 0,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        },
    ]


# ---- non-streaming -----------------------------------------------------------------------------


def test_full_completion_body_with_logprobs_and_token_ids():
    cancel = Cancel()
    body = make(EVENTS, chat=False, logprobs=2, cancel=cancel).full_response(return_token_ids=True)
    assert body == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": CREATED,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "Hello!",
                "logprobs": {
                    "tokens": ["<10>", "<11>", "<12>"],
                    "token_logprobs": [-0.25, -0.125, -1.0],
                    "top_logprobs": [{"<10>": -0.25, "<11>": -1.5}, {"<11>": -0.125, "<9>": -2.0}, {"<12>": -1.0}],
                    "text_offset": [0, 3, 5],
                },
                "finish_reason": "stop",
                "token_ids": [10, 11, 12],
                "prompt_token_ids": [5, 6, 7],  # vLLM's place for completions
            }
        ],
        "usage": USAGE,
        "prompt_token_ids": [5, 6, 7],
    }
    assert cancel.calls == 1


def test_full_chat_body():
    assert make(EVENTS, chat=True).full_response() == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": CREATED,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello!"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": USAGE,
    }


def test_full_response_error_raises_and_cancels():
    cancel = Cancel()
    events = [started(1), token(3, "ab"), WorkerRequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")]
    with pytest.raises(OpenAIError) as err:
        make(events, chat=False, cancel=cancel).full_response()
    assert (err.value.status, err.value.type, err.value.code) == (429, "rate_limit_error", "resource_exhausted")
    assert cancel.calls == 1


def test_token_text_without_a_tokenizer_is_empty():
    events = [started(1), token(3, "a", -0.5), finished("a", "stop")]
    stream = CompletionStream(
        scripted(*events),
        cancel=Cancel(),
        request_id="cmpl-1",
        created=CREATED,
        model="m",
        chat=False,
        logprobs=0,
        token_text=token_text_of(None),
    )
    assert stream.full_response()["choices"][0]["logprobs"]["tokens"] == [""]


# ---- the HTTP response: cancellation -----------------------------------------------------------


class Client:
    """A scripted ASGI client: ``receive`` answers ``http.disconnect`` once ``leave`` is set;
    ``send`` records messages and blocks forever once ``stall`` is set (a client that stops
    reading, its socket buffers full)."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.leave = threading.Event()
        self.stall = False

    async def receive(self) -> dict:
        while not self.leave.is_set():
            await anyio.sleep(0.005)
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if self.stall:
            await anyio.sleep_forever()
        self.sent.append(message)

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


def relay(response: RelayResponse, client: Client) -> None:
    anyio.run(response, {"type": "http"}, client.receive, client.send)


def test_relay_response_sends_every_event_then_cancels_once():
    cancel = Cancel()
    client = Client()
    relay(RelayResponse(make(EVENTS, chat=False, cancel=cancel), sse=True), client)
    assert client.sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in client.sent[0]["headers"]
    assert client.body().decode() == "".join(make(EVENTS, chat=False).sse_chunks())
    assert client.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert cancel.calls == 1


def test_relay_response_json_body():
    cancel = Cancel()
    client = Client()
    relay(RelayResponse(make(EVENTS, chat=True, cancel=cancel), sse=False), client)
    assert client.sent[0]["status"] == 200
    assert json.loads(client.body()) == make(EVENTS, chat=True).full_response()
    assert cancel.calls == 1


@pytest.mark.parametrize("sse", [True, False])
def test_a_response_sent_whole_is_not_a_client_gone(sse):
    # uvicorn answers receive() with http.disconnect as soon as the last body message is sent,
    # and its send then yields: every completed response was logged "http_client_gone"
    import structlog

    client = Client()
    sent_all = anyio.Event()

    async def receive() -> dict:
        await sent_all.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        client.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            sent_all.set()
            await anyio.sleep(0)  # uvicorn's send awaits the transport's drain

    with structlog.testing.capture_logs() as logs:
        anyio.run(RelayResponse(make(EVENTS, chat=False), sse=sse), {"type": "http"}, receive, send)
    assert client.sent[-1]["more_body"] is False
    assert [e for e in logs if e["event"] == "http_client_gone"] == []


def test_relay_response_disconnect_mid_stream_cancels_the_call():
    consumed: list[int] = []
    released = threading.Event()
    client = Client()
    response = RelayResponse(endless_stream(consumed, released), sse=True)

    async def leave_after_first_chunk(message: dict) -> None:
        client.sent.append(message)
        if message.get("body"):
            client.leave.set()

    anyio.run(response, {"type": "http"}, client.receive, leave_after_first_chunk)
    assert released.is_set()
    assert 1 <= len(consumed) < 10_000
    assert b"[DONE]" not in client.body()


def test_relay_response_disconnect_before_the_first_token_cancels_the_call():
    """A request still queued on its worker (no token yet) when the client leaves."""
    consumed: list[int] = []
    released = threading.Event()
    never = threading.Event()
    client = Client()
    client.leave.set()
    for sse in (True, False):
        released.clear()
        client.sent.clear()
        relay(RelayResponse(endless_stream(consumed, released, first_token_after=never), sse=sse), client)
        assert released.is_set()
        assert consumed == []
        assert client.sent == []


def test_relay_response_non_streaming_disconnect_cancels_generation():
    consumed: list[int] = []
    released = threading.Event()
    client = Client()
    threading.Timer(0.1, client.leave.set).start()
    relay(RelayResponse(endless_stream(consumed, released), sse=False), client)
    assert released.is_set()
    assert 0 < len(consumed) < 10_000
    assert client.sent == []


def test_relay_response_stalled_reader_is_cut_after_the_write_timeout():
    consumed: list[int] = []
    released = threading.Event()
    client = Client()
    client.stall = True
    relay(RelayResponse(endless_stream(consumed, released), sse=True, write_timeout_s=0.2), client)
    assert released.is_set()
    assert len(consumed) < 10_000


# ---- non-finite log-probs (an adapter at scale 1e30: NaN logits) ------------------------------

NAN, INF = float("nan"), float("inf")
NON_FINITE = [
    started(1),
    token(3, "a", NAN, [(3, NAN), (4, -INF), (5, INF)]),
    token(4, "b", -INF, [(4, -INF), (6, -12345.0)]),
    finished("ab", "length"),
]


def strict_json(text: str | bytes):
    """``json.loads`` that refuses ``NaN`` / ``Infinity`` / ``-Infinity`` (not JSON)."""

    def refuse(constant: str):
        raise ValueError(f"non-JSON constant {constant} in {text!r}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("chat", [False, True])
def test_non_finite_logprobs_are_clamped_in_every_sse_chunk(chat):
    chunks = list(make(NON_FINITE, chat=chat, logprobs=3).sse_chunks(include_usage=True))
    assert chunks[-1] == "data: [DONE]\n\n"
    bodies = [strict_json(c[len("data: ") :]) for c in chunks[:-1]]
    logprobs = [b["choices"][0]["logprobs"] for b in bodies if b["choices"] and b["choices"][0]["logprobs"]]
    if chat:
        entries = [e for lp in logprobs for e in lp["content"]]
        assert [e["logprob"] for e in entries] == [-9999.0, -9999.0]
        assert [[t["logprob"] for t in e["top_logprobs"]] for e in entries] == [
            [-9999.0, -9999.0, 0.0],
            [-9999.0, -9999.0],
        ]
    else:
        assert [lp["token_logprobs"] for lp in logprobs] == [[-9999.0], [-9999.0]]
        assert [lp["top_logprobs"] for lp in logprobs] == [
            [{"<3>": -9999.0, "<4>": -9999.0, "<5>": 0.0}],
            [{"<4>": -9999.0, "<6>": -9999.0}],
        ]


@pytest.mark.parametrize("chat", [False, True])
def test_non_finite_logprobs_give_a_json_body_not_a_500(chat):
    client = Client()
    relay(RelayResponse(make(NON_FINITE, chat=chat, logprobs=0), sse=False), client)
    assert client.sent[0]["status"] == 200
    body = strict_json(client.body())
    logprobs = body["choices"][0]["logprobs"]
    if chat:
        assert [e["logprob"] for e in logprobs["content"]] == [-9999.0, -9999.0]
    else:
        assert logprobs["token_logprobs"] == [-9999.0, -9999.0]
        assert logprobs["top_logprobs"] == [{"<3>": -9999.0}, {"<4>": -9999.0}]


def test_json_logprob_rule():
    from control_plane.http.responses import json_logprob

    assert [json_logprob(x) for x in (NAN, -INF, INF, -1e5, -9999.0, -0.5, 0.0)] == [
        -9999.0,
        -9999.0,
        0.0,
        -9999.0,
        -9999.0,
        -0.5,
        0.0,
    ]
