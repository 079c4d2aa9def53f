"""vLLM / llama-server API parity of the HTTP front, in-process over fakes (`tests.helpers.http_fakes`):
sampling fields that reach the GenerateRequest, ``model`` optional, prompt log-probs in vLLM's
shape, ``/v1/models/{id}``, ``/tokenize`` / ``/detokenize``, ``/openapi.json`` without a docs
page, and the parameter rule (known + non-default + unimplemented → 400 naming it; defaults and
unknown keys ignored). The same behaviour against real processes: tests/integration/test_http_api.py."""

from __future__ import annotations

import pytest

import control_plane.http.completions as completions
from control_plane.http.schemas import UNSUPPORTED
from loraplane.v1 import common_pb2
from tests.helpers.http_fakes import EVENTS, FakeTokenizer, Front, call_app, finished, token


class VocabTokenizer(FakeTokenizer):
    """`FakeTokenizer` with a vocabulary size, BOS 2 and a decode."""

    n_vocab = 300

    def encode(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return ([2] if add_special else []) + super().encode(text, add_special=add_special, parse_special=parse_special)

    def decode(self, ids, skip_special: bool = True) -> str:
        return "".join("<bos>" if i == 2 else chr(i) for i in ids if not (skip_special and i == 2))


@pytest.fixture(autouse=True)
def fixed_ids(monkeypatch):
    monkeypatch.setattr(completions, "new_request_id", lambda prefix: f"{prefix}-1")
    monkeypatch.setattr(completions, "now_s", lambda: 1700000000)


def _error(reply) -> dict:
    assert reply.headers["content-type"] == "application/json"
    return reply.json()["error"]


def test_penalties_min_p_and_prompt_logprobs_reach_the_request():
    front = Front()
    body = {
        "model": "shout",
        "prompt": "hi",
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.3,
        "prompt_logprobs": 0,
        "top_k": -1,
    }
    assert front.post("/v1/completions", body, EVENTS).status == 200
    s = front.router.requests[0].sampling
    assert (s.min_p, s.presence_penalty, s.frequency_penalty, s.top_k, s.prompt_logprobs) == (
        pytest.approx(0.05),
        0.5,
        -0.25,
        0,
        True,
    )
    assert s.repetition_penalty == pytest.approx(1.3)
    # omitted: off (repetition 1, the others 0), prompt log-probs not asked for
    front.post("/v1/chat/completions", {"model": "shout", "messages": [{"role": "user", "content": "x"}]}, EVENTS)
    s = front.router.requests[1].sampling
    assert (s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.prompt_logprobs) == (
        0,
        0,
        0,
        1.0,
        False,
    )


@pytest.mark.parametrize(
    "field, value",
    [("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0)],
)
def test_out_of_range_sampling_fields_are_400_naming_them(field, value):
    r = Front().post("/v1/completions", {"prompt": "hi", field: value}, EVENTS)
    assert r.status == 400 and _error(r)["param"] == field


def test_model_may_be_omitted_and_means_the_base_model():
    front = Front()
    r = front.post("/v1/completions", {"prompt": "hi"}, EVENTS)
    assert r.status == 200 and r.json()["model"] == "base"
    req = front.router.requests[0]
    assert req.HasField("adapters") and len(req.adapters.entries) == 0  # no adapters, not the default set
    r = front.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, EVENTS)
    assert r.status == 200 and r.json()["model"] == "base"


def _started_with_prompt_logprobs() -> common_pb2.GenerateEvent:
    plp = [
        common_pb2.PromptLogprob(),
        common_pb2.PromptLogprob(has_logprob=True, token_id=6, logprob=-1.5, rank=3),
        common_pb2.PromptLogprob(has_logprob=True, token_id=7, logprob=float("-inf")),
    ]
    return common_pb2.GenerateEvent(started=common_pb2.Started(prompt_token_ids=[5, 6, 7], prompt_logprobs=plp))


def test_prompt_logprobs_in_vllms_shape():
    expected = [
        None,
        {"6": {"logprob": -1.5, "rank": 3, "decoded_token": "<6>"}},
        {"7": {"logprob": -9999.0, "rank": None, "decoded_token": "<7>"}},
    ]
    events = [_started_with_prompt_logprobs(), token(10, "Hi"), finished("Hi", "length")]
    front = Front()
    r = front.post("/v1/completions", {"prompt": [5, 6, 7], "prompt_logprobs": 0}, events)
    assert r.json()["choices"][0]["prompt_logprobs"] == expected  # vLLM: on the completion's choice
    chat = {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 0}
    assert front.post("/v1/chat/completions", chat, events).json()["prompt_logprobs"] == expected  # on the response
    r = front.post("/v1/completions", {"prompt": "hi", "prompt_logprobs": 0, "stream": True}, events)
    assert r.status == 400 and _error(r)["param"] == "prompt_logprobs"


def test_prompt_logprobs_n_lists_the_alternatives():
    """``prompt_logprobs: N`` asks the worker for N alternatives per prompt position and shows
    them beside the prompt token, ranked 1..N (the prompt token keeps its own rank)."""
    plp = [
        common_pb2.PromptLogprob(),
        common_pb2.PromptLogprob(
            has_logprob=True,
            token_id=6,
            logprob=-1.5,
            rank=3,
            top=[common_pb2.TokenLogprob(token_id=9, logprob=-0.5), common_pb2.TokenLogprob(token_id=8, logprob=-1.0)],
        ),
        common_pb2.PromptLogprob(
            has_logprob=True,
            token_id=7,
            logprob=-0.25,
            rank=1,
            top=[common_pb2.TokenLogprob(token_id=7, logprob=-0.25), common_pb2.TokenLogprob(token_id=3, logprob=-2.0)],
        ),
    ]
    started = common_pb2.GenerateEvent(started=common_pb2.Started(prompt_token_ids=[5, 6, 7], prompt_logprobs=plp))
    front = Front()
    r = front.post(
        "/v1/completions",
        {"prompt": [5, 6, 7], "prompt_logprobs": 2},
        [started, token(10, "Hi"), finished("Hi", "length")],
    )
    assert r.status == 200, r.body
    (req,) = front.router.requests
    assert req.sampling.prompt_logprobs and req.sampling.prompt_logprobs_top == 2
    assert r.json()["choices"][0]["prompt_logprobs"] == [
        None,
        {
            "6": {"logprob": -1.5, "rank": 3, "decoded_token": "<6>"},
            "9": {"logprob": -0.5, "rank": 1, "decoded_token": "<9>"},
            "8": {"logprob": -1.0, "rank": 2, "decoded_token": "<8>"},
        },
        {
            "7": {"logprob": -0.25, "rank": 1, "decoded_token": "<7>"},
            "3": {"logprob": -2.0, "rank": 2, "decoded_token": "<3>"},
        },
    ]


def _non_default(name: str):
    defaults = UNSUPPORTED[name][0]
    if defaults and isinstance(defaults[0], bool):
        return not defaults[0]
    if defaults and isinstance(defaults[0], int | float):
        return defaults[0] + 2
    return {"modalities": ["audio"]}.get(name, ["x"])


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_known_unimplemented_parameters_are_400_only_when_not_default(name):
    front = Front()
    r = front.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], name: _non_default(name)})
    assert r.status == 400, name
    err = _error(r)
    assert (err["param"], err["code"], err["type"]) == (name, "unsupported_parameter", "invalid_request_error")
    assert err["message"].startswith(f"'{name}' is not supported: ")
    defaults = UNSUPPORTED[name][0]
    for value in (None, *defaults):
        body = {"messages": [{"role": "user", "content": "x"}], name: value}
        assert front.post("/v1/chat/completions", body, EVENTS).status == 200, (name, value)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 2}, "n"),
        ({"best_of": 2}, "best_of"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        # OpenAI's legacy function calling was ignored: the model answered as if no function existed
        ({"functions": [{"name": "get_weather", "parameters": {"type": "object"}}]}, "functions"),
        ({"function_call": {"name": "get_weather"}}, "function_call"),
        ({"guided_whitespace_pattern": "[ ]*"}, "guided_whitespace_pattern"),
    ],
)
def test_openai_parameters_we_do_not_implement_are_400(extra, param):
    for path, base in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        r = Front().post(path, {**base, **extra}, EVENTS)
        assert r.status == 400 and _error(r)["param"] == param, (path, r.body)


def test_defaults_and_unknown_keys_are_ignored():
    front = Front()
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "n": 1,
        "best_of": 1,
        "logit_bias": {},
        "echo": False,
        "user": "u-1",
        "stream_options": None,
        "parallel_tool_calls": True,
        "service_tier": "auto",
        "store": False,
        "metadata": {"k": "v"},
        "some_future_key": {"nested": [1, 2]},
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1,
        "min_p": 0,
        "top_k": 0,
    }
    assert front.post("/v1/chat/completions", body, EVENTS).status == 200


def test_model_retrieve_by_every_name_and_404_in_openais_shape():
    front = Front()
    get = lambda model_id: call_app(front.app, "GET", f"/v1/models/{model_id}")  # noqa: E731
    base = get("base").json()
    assert (base["id"], base["object"], base["owned_by"], base["parent"]) == ("base", "model", "loraplane", None)
    sea = get("sea").json()
    assert (sea["id"], sea["parent"], sea["adapter_id"]) == ("sea", "base", 1)
    assert get("adapter:1").json() == sea and get("base:sea").json() == sea
    assert get("adapter:2").json()["id"] == "adapter:2"  # a shared name is listed by id
    for missing in ("nope", "org/nope", "adapter:99"):
        r = get(missing)
        assert r.status == 404, missing
        err = _error(r)
        assert (err["type"], err["param"], err["code"]) == ("not_found_error", "model", "model_not_found")
        assert f"'{missing}'" in err["message"]
    r = get("dup")
    assert r.status == 400 and _error(r)["code"] == "ambiguous_model"


def test_a_404_names_at_most_16_of_thousands_of_models():
    from tests.helpers.http_fakes import FakeRecord

    # every name was listed: 2 000 aliases of 256 bytes made each 404 half a megabyte, to anyone
    front = Front()
    front.registry.records = [FakeRecord(i, f"adapter-{i:05d}-" + "n" * 240) for i in range(2000)]
    for model, listed in (("nope", "served: ['base', 'adapter-00000-"), ("adapter:99999", "ids: [0, 1, 2,")):
        r = front.post("/v1/completions", {"model": model, "prompt": "x"})
        err = _error(r)
        assert r.status == 404 and err["code"] == "model_not_found"
        assert listed in err["message"] and len(r.body) < 6000, len(r.body)
    r = front.post("/v1/completions", {"model": "nope", "prompt": "x"})
    assert _error(r)["message"].endswith(", …]; GET /v1/models lists them all)")
    assert _error(r)["message"].count("adapter-") == 15
    r = front.post("/v1/completions", {"model": "adapter:99999", "prompt": "x"})
    assert _error(r)["message"].endswith("14, 15, … and 1984 more]; GET /v1/models lists them all)")


def test_openapi_json_is_served_without_a_docs_page():
    front = Front()
    r = call_app(front.app, "GET", "/openapi.json")
    assert r.status == 200
    paths = r.json()["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}", "/tokenize"):
        assert path in paths, path
    for page in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        r = call_app(front.app, "GET", page)
        assert r.status == 404 and b"cdn" not in r.body.lower(), page


def test_tokenize_and_detokenize_shapes():
    front = Front()
    deps = front.deps
    deps.tokenizer = VocabTokenizer()
    deps.n_ctx = 4096
    r = front.post("/tokenize", {"prompt": "ab"})
    assert r.json() == {"count": 3, "max_model_len": 4096, "tokens": [2, 97, 98]}
    r = front.post(
        "/tokenize", {"model": "sea", "prompt": "ab", "add_special_tokens": False, "return_token_strs": True}
    )
    assert r.json() == {"count": 2, "max_model_len": 4096, "tokens": [97, 98], "token_strs": ["<97>", "<98>"]}
    r = front.post("/tokenize", {"messages": [{"role": "user", "content": "x"}]})
    ids = r.json()["tokens"]
    assert "".join(map(chr, ids)).startswith("<bos><start_of_turn>user\nx<end_of_turn>\n<start_of_turn>model\n")
    assert front.post("/detokenize", {"tokens": [2, 104, 105]}).json() == {"prompt": "<bos>hi"}
    r = front.post("/detokenize", {"tokens": [104, 300]})
    assert r.status == 400 and (_error(r)["param"], _error(r)["code"]) == ("tokens", "invalid_token_id")
    r = front.post("/tokenize", {"model": "nope", "prompt": "x"})
    assert r.status == 404 and _error(r)["code"] == "model_not_found"
    r = front.post("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]})
    assert r.status == 400
