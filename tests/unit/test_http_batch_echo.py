"""``/v1/completions`` batches (``prompt`` as a list of strings or of token-id lists) and
``echo`` (the prompt back, with its tokens' log-probs), over the fake router: what reaches the
router and the response's shape (the real worker: tests/integration/test_http_batch_echo.py)."""

from __future__ import annotations

import json

import pytest

from control_plane.http.schemas import MAX_PROMPTS
from loraplane.v1 import common_pb2
from tests.helpers.http_fakes import EVENTS, Front, finished, token


def _error(r):
    return r.json()["error"]


def _sse(body: bytes) -> list:
    frames = [f[len("data: ") :] for f in body.decode().split("\n\n") if f.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def test_a_list_of_strings_is_one_choice_per_prompt_in_order():
    front = Front()
    r = front.post("/v1/completions", {"prompt": ["ab", "c", "def"], "max_tokens": 5}, EVENTS)
    assert r.status == 200, r.body
    body = r.json()
    reqs = front.router.requests
    assert [q.text for q in reqs] == ["ab", "c", "def"]
    assert [q.sampling.max_tokens for q in reqs] == [5, 5, 5]
    ids = [q.request_id for q in reqs]
    assert ids == [f"{body['id']}-{i}" for i in range(3)]  # one response id, a request id per prompt
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == ["Hi there."] * 3
    assert body["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": 6,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_a_list_of_token_id_lists_is_a_batch_too():
    front = Front()
    r = front.post("/v1/completions", {"prompt": [[5, 6], [7]], "return_token_ids": True}, EVENTS)
    assert r.status == 200, r.body
    assert [list(q.tokens.ids) for q in front.router.requests] == [[5, 6], [7]]
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["token_ids"] for c in choices] == [[10, 11], [10, 11]]
    assert [c["prompt_token_ids"] for c in choices] == [[5, 6], [5, 6]]  # what the worker reported


def test_one_string_in_a_list_stays_a_single_prompt():
    front = Front()
    r = front.post("/v1/completions", {"prompt": ["hello"]}, EVENTS)
    assert r.status == 200 and len(r.json()["choices"]) == 1
    (req,) = front.router.requests
    assert req.text == "hello" and req.request_id == r.json()["id"]


def test_a_streamed_batch_interleaves_indexed_chunks_and_sums_usage():
    front = Front()
    body = {"prompt": ["a", "b"], "stream": True, "stream_options": {"include_usage": True}}
    r = front.post("/v1/completions", body, EVENTS)
    assert r.status == 200, r.body
    chunks = _sse(r.body)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 4 and usage["usage"]["completion_tokens"] == 4
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == "Hi there."
        assert [c["finish_reason"] for c in mine][-1] == "stop"
    assert len({c["id"] for c in chunks}) == 1


def test_a_batch_is_bounded_and_each_prompt_checked():
    front = Front()
    r = front.post("/v1/completions", {"prompt": ["x"] * (MAX_PROMPTS + 1)}, EVENTS)
    assert r.status == 400 and _error(r)["param"] == "prompt" and _error(r)["code"] == "too_many_items"
    r = front.post("/v1/completions", {"prompt": ["x", ""]}, EVENTS)
    assert r.status == 400 and _error(r)["param"] == "prompt" and "'prompt[1]' is empty" in _error(r)["message"]
    r = front.post("/v1/completions", {"prompt": [[1, 2], [3, -1]]}, EVENTS)
    assert r.status == 400 and _error(r)["code"] == "invalid_token_id"
    r = front.post("/v1/completions", {"prompt": [[1, 2], "x"]}, EVENTS)
    assert r.status == 400 and _error(r)["param"] == "prompt"
    assert front.router.requests == []  # nothing ran


def test_a_failing_prompt_fails_the_batch():
    from tests.helpers.http_fakes import worker_error

    front = Front()
    r = front.post("/v1/completions", {"prompt": ["a", "b"]}, [worker_error("worker went away")])
    assert r.status == 503 and "worker went away" in _error(r)["message"]


def _started_with_logprobs() -> common_pb2.GenerateEvent:
    plp = [
        common_pb2.PromptLogprob(),
        common_pb2.PromptLogprob(
            has_logprob=True,
            token_id=6,
            logprob=-1.5,
            rank=2,
            top=[common_pb2.TokenLogprob(token_id=9, logprob=-0.5)],
        ),
    ]
    return common_pb2.GenerateEvent(started=common_pb2.Started(prompt_token_ids=[5, 6], prompt_logprobs=plp))


def test_echo_with_max_tokens_0_gives_the_prompts_logprobs_only():
    """lm-eval's log-likelihood request: ``echo``, ``logprobs`` and ``max_tokens: 0``."""
    front = Front()
    events = [_started_with_logprobs(), token(10, "Hi", -0.5, top=[(10, -0.5)]), finished("Hi", "length")]
    r = front.post("/v1/completions", {"prompt": [5, 6], "echo": True, "logprobs": 1, "max_tokens": 0}, events)
    assert r.status == 200, r.body
    (req,) = front.router.requests
    assert req.sampling.max_tokens == 1  # one token computes the prompt; it is dropped
    assert req.sampling.prompt_logprobs and req.sampling.prompt_logprobs_top == 1
    (choice,) = r.json()["choices"]
    assert choice["text"] == "<5><6>" and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {
        "tokens": ["<5>", "<6>"],
        "token_logprobs": [None, -1.5],
        "top_logprobs": [None, {"<9>": -0.5}],
        "text_offset": [0, 3],
    }
    assert r.json()["usage"]["completion_tokens"] == 0 and r.json()["usage"]["prompt_tokens"] == 2


def test_echo_puts_the_prompt_before_the_generated_text():
    front = Front()
    events = [_started_with_logprobs(), token(10, "Hi", -0.25, top=[(10, -0.25)]), finished("Hi", "length")]
    r = front.post("/v1/completions", {"prompt": "ab", "echo": True, "max_tokens": 1}, events)
    assert r.json()["choices"][0]["text"] == "abHi" and r.json()["choices"][0]["logprobs"] is None
    r = front.post("/v1/completions", {"prompt": "ab", "echo": True, "max_tokens": 1, "logprobs": 0}, events)
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["<5>", "<6>", "<10>"]
    assert lp["token_logprobs"] == [None, -1.5, -0.25]
    assert lp["top_logprobs"] == [None, {"<6>": -1.5}, {"<10>": -0.25}]  # 0 alternatives: the token alone
    assert lp["text_offset"] == [0, 3, 6]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "echo": True, "stream": True}, "echo"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ],
)
def test_echo_refusals_name_the_parameter(path, body, param):
    r = Front().post(path, body, EVENTS)
    assert r.status == 400 and _error(r)["param"] == param, r.body


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk():
    """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): each chunk
    carries the usage up to it; without it, only the last chunk has usage."""
    front = Front()
    options = {"include_usage": True, "continuous_usage_stats": True}
    for path, base in (
        ("/v1/completions", {"prompt": "ab"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        r = front.post(path, {**base, "stream": True, "stream_options": options}, EVENTS)
        chunks = _sse(r.body)
        assert all("usage" in c for c in chunks), path
        completion = [c["usage"]["completion_tokens"] for c in chunks]
        assert completion == sorted(completion) and completion[-1] == 2
        assert {c["usage"]["prompt_tokens"] for c in chunks} == {2}
        plain = _sse(front.post(path, {**base, "stream": True, "stream_options": {"include_usage": True}}, EVENTS).body)
        assert [("usage" in c) for c in plain] == [False] * (len(plain) - 1) + [True]


def test_n_probs_is_refused_with_the_openai_name():
    r = Front().post("/v1/completions", {"prompt": "ab", "n_probs": 3}, EVENTS)
    err = _error(r)
    assert r.status == 400 and err["param"] == "n_probs" and "'logprobs'" in err["message"]


def test_errors_name_the_prompt_of_a_batch():
    """A bad id or a prompt too long names its prompt (``prompt[i]`` in a batch) and the id's
    place in it; a text prompt that cannot fit the context is a 400 before routing
    (``context_length_exceeded``, counted with the base tokenizer), not the worker's error."""
    front = Front()
    front.deps.n_ctx = 10
    cases = [
        ({"prompt": [[2, 3], [2, -5]]}, "invalid_token_id", "prompt[1][1]: token id -5 is out of range"),
        ({"prompt": [[2, 99999999999]]}, "invalid_token_id", "prompt[0][1]: token id 99999999999"),
        ({"prompt": "x" * 20}, "context_length_exceeded", "'prompt' has 20 tokens; this model's context is 10"),
        ({"prompt": ["hi", "x" * 20]}, "context_length_exceeded", "'prompt[1]' has 20 tokens"),
        ({"prompt": [[1, 2], [1] * 12]}, "context_length_exceeded", "'prompt[1]' has 12 tokens"),
        ({"prompt": ""}, None, "'prompt' is empty"),
    ]
    for body, code, message in cases:
        r = front.post("/v1/completions", body, EVENTS)
        err = _error(r)
        assert r.status == 400 and err["param"] == "prompt" and err["code"] == code, (body, r.body)
        assert err["message"].startswith(message) or message in err["message"], (body, err["message"])
    assert front.router.requests == []


def test_a_large_batch_runs_at_most_batch_in_flight_prompts_at_once():
    """A batch of `MAX_PROMPTS` fits any worker's queue: at most `BATCH_IN_FLIGHT` of its prompts
    run at once, the rest start as those finish (streamed and not), and every prompt answers."""
    import threading
    import time

    from control_plane.http.streaming import BATCH_IN_FLIGHT
    from tests.helpers.http_fakes import FakeRouter

    class CountingRouter(FakeRouter):
        def __init__(self) -> None:
            super().__init__()
            self.live = self.peak = 0
            self.lock = threading.Lock()

        def generate(self, request, context, *, principal=None):
            with self.lock:
                self.live += 1
                self.peak = max(self.peak, self.live)
            try:
                for ev in super().generate(request, context, principal=principal):
                    time.sleep(0.002)
                    yield ev
            finally:
                with self.lock:
                    self.live -= 1

    for stream in (False, True):
        front = Front()
        front.router = front.deps.router = CountingRouter()
        r = front.post("/v1/completions", {"prompt": ["x"] * MAX_PROMPTS, "stream": stream}, EVENTS)
        assert r.status == 200, r.body
        if stream:
            chunks = _sse(r.body)
            assert {c["choices"][0]["index"] for c in chunks} == set(range(MAX_PROMPTS))
        else:
            assert [c["index"] for c in r.json()["choices"]] == list(range(MAX_PROMPTS))
        assert len(front.router.requests) == MAX_PROMPTS
        assert 1 < front.router.peak <= BATCH_IN_FLIGHT, (stream, front.router.peak)


def test_return_token_ids_puts_the_prompt_ids_on_the_completion_choice():
    """vLLM's completions carry ``prompt_token_ids`` on the choice; the response keeps it too
    for a single prompt (chat: on the response only)."""
    front = Front()
    single = front.post("/v1/completions", {"prompt": [5, 6], "return_token_ids": True}, EVENTS).json()
    assert single["prompt_token_ids"] == single["choices"][0]["prompt_token_ids"] == [5, 6]
    batch = front.post("/v1/completions", {"prompt": [[5, 6], [7]], "return_token_ids": True}, EVENTS).json()
    assert "prompt_token_ids" not in batch and all("prompt_token_ids" in c for c in batch["choices"])
    chat = {"messages": [{"role": "user", "content": "x"}], "return_token_ids": True}
    body = front.post("/v1/chat/completions", chat, EVENTS).json()
    assert body["prompt_token_ids"] == [5, 6] and "prompt_token_ids" not in body["choices"][0]
