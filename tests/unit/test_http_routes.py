"""The HTTP front's routes in-process (`tests.helpers.http_fakes`: scripted router, fake registry, an
ASGI call without sockets): request → GenerateRequest, response bytes and statuses, the admin
bearer check shared with gRPC. No model, no processes."""

from __future__ import annotations

import importlib.metadata
import json

import pytest

import control_plane.http.completions as completions
from control_plane.auth import BearerCheck, bearer_token, check_bearer
from control_plane.errors import UnavailableError
from control_plane.http.responses import token_text_of
from control_plane.http.streaming import CompletionStream
from tests.helpers.http_fakes import (
    ADMIN_TOKEN,
    EVENTS,
    FakeRecord,
    FakeTokenizer,
    Front,
    call_app,
    scripted,
)

MISSING = {
    "error": {
        "message": "admin endpoint: send 'Authorization: Bearer <token>' (admin token configured)",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
}
REJECTED = {
    "error": {
        "message": "admin endpoint: token rejected",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
}


@pytest.fixture(autouse=True)
def fixed_ids(monkeypatch):
    monkeypatch.setattr(completions, "new_request_id", lambda prefix: f"{prefix}-1")
    monkeypatch.setattr(completions, "now_s", lambda: 1700000000)


# ---- generation routes ---------------------------------------------------------------------------


def test_completion_request_takes_openai_defaults_and_the_adapter_model_names():
    front = Front()
    r = front.post("/v1/completions", {"model": "sea", "prompt": "hello"}, EVENTS)
    assert r.status == 200 and r.headers["content-type"] == "application/json"
    assert r.json()["choices"][0]["text"] == "Hi there."
    (req,) = front.router.requests
    assert req.request_id == "cmpl-1" and req.text == "hello"
    assert [(e.id, e.scale) for e in req.adapters.entries] == [(1, 1.0)]
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.logprobs, s.HasField("seed")) == (
        16,
        1.0,
        1.0,
        0,
        0,
        False,
    )
    assert front.router.cancelled == 1


def test_token_id_prompt_and_lora_list_win_over_model():
    front = Front()
    body = {"model": "base", "prompt": [1, 2], "lora": [{"id": 0, "scale": 0.5}], "seed": 7, "stop": "."}
    front.post("/v1/completions", body, EVENTS)
    (req,) = front.router.requests
    assert list(req.tokens.ids) == [1, 2] and [(e.id, e.scale) for e in req.adapters.entries] == [(0, 0.5)]
    assert (req.sampling.seed, list(req.sampling.stop)) == (7, ["."])


def test_streamed_response_is_the_streams_events_byte_for_byte():
    front = Front()
    body = {
        "model": "shout",
        "prompt": "hello",
        "stream": True,
        "logprobs": 1,
        "stream_options": {"include_usage": True},
    }
    r = front.post("/v1/completions", body, EVENTS)
    assert r.status == 200 and r.headers["content-type"] == "text/event-stream; charset=utf-8"
    expected = CompletionStream(
        scripted(*EVENTS),
        cancel=lambda: None,
        request_id="cmpl-1",
        created=1700000000,
        model="shout",
        chat=False,
        logprobs=1,
        token_text=token_text_of(FakeTokenizer()),
    ).sse_chunks(include_usage=True)
    assert r.body.decode() == "".join(expected)
    assert front.router.cancelled == 1


def test_stream_error_before_the_first_token_keeps_its_http_status():
    front = Front()
    r = front.post("/v1/completions", {"model": "sea", "prompt": "q", "stream": True}, [UnavailableError("no worker")])
    assert (r.status, r.json()) == (
        503,
        {"error": {"message": "no worker", "type": "service_unavailable", "param": None, "code": None}},
    )
    assert front.router.cancelled == 1


def test_chat_renders_the_template_and_flattens_text_parts():
    front = Front()
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    body = {"model": "base", "messages": messages, "logprobs": True, "top_logprobs": 1}
    r = front.post("/v1/chat/completions", body, EVENTS)
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "Hi there."}
    assert r.json()["choices"][0]["logprobs"]["content"][0] == {
        "token": "<10>",
        "logprob": -0.5,
        "bytes": [60, 49, 48, 62],
        "top_logprobs": [],  # the scripted tokens carry no alternatives
    }
    (req,) = front.router.requests
    prompt = "<bos><start_of_turn>user\nab<end_of_turn>\n<start_of_turn>model\n"
    assert list(req.tokens.ids) == [ord(c) for c in prompt]
    assert (req.sampling.logprobs, req.sampling.max_tokens, len(req.adapters.entries)) == (1, 2**31 - 1, 0)


@pytest.mark.parametrize(
    "front_kw, body, status, param",
    [
        ({}, {"model": "sea", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
        ({}, {"model": "sea", "messages": [{"role": "assistant", "content": "first"}]}, 400, "messages"),
        ({"chat": False}, {"model": "nope", "messages": [{"role": "user", "content": "q"}]}, 400, "messages"),
        ({}, {"model": "nope", "messages": [{"role": "user", "content": "q"}]}, 404, "model"),
        ({}, {"model": "dup", "messages": [{"role": "user", "content": "q"}]}, 400, "model"),
        ({}, {"model": "sea"}, 400, "messages"),
    ],
)
def test_chat_errors_name_the_offending_field(front_kw, body, status, param):
    r = Front(**front_kw).post("/v1/chat/completions", body)
    assert r.status == status and r.json()["error"]["param"] == param, r.body


def test_invalid_json_is_an_openai_400():
    r = Front().post("/v1/completions", b"{not json")
    assert r.status == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["param"] is None  # not pydantic's "0" (a character position)


@pytest.mark.parametrize(
    "template_text, code",
    [
        ("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", "chat_template_recursion"),
        ("{{ messages + 1 }}", "chat_template_error"),
        ("{{ 'ab' * 10**9 }}", "chat_template_too_large"),
        ("{{ raise_exception('no system role') }}", "chat_template_refused"),
    ],
)
def test_template_failures_are_400s(template_text, code):
    r = Front(template_text=template_text).post(
        "/v1/chat/completions", {"model": "base", "messages": [{"role": "user", "content": "q"}]}
    )
    assert r.status == 400 and r.json()["error"]["code"] == code, r.body
    assert r.json()["error"]["param"] == "messages"


def test_unexpected_exception_is_an_openai_500_without_its_details(monkeypatch):
    import control_plane.http.errors as errors

    logged: list[tuple[str, dict]] = []
    monkeypatch.setattr(
        errors, "log", type("Log", (), {"error": lambda self, event, **kw: logged.append((event, kw))})()
    )
    r = Front().post("/v1/completions", {"model": "sea", "prompt": "q"}, [RuntimeError("secret detail")])
    assert r.status == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["type"] == "internal_error" and "secret" not in r.body.decode()
    ((event, fields),) = logged
    assert event == "http_unhandled_error" and fields["error"] == "RuntimeError: secret detail"


def test_unload_by_a_non_ascii_or_huge_id_removes_nothing():
    front = Front(admin_token=None)
    for name in ("adapter:\u0663", "adapter:12345678901234567890", "adapter:+3", "adapter: 3"):
        r = front.post("/v1/unload_lora_adapter", {"lora_name": name})
        assert r.status == 404 and r.json()["error"]["param"] == "model", (name, r.body)
    assert [rec.id for rec in front.registry.records] == [0, 1, 2, 3] and front.announcer.unloaded == []
    r = front.post("/v1/completions", {"model": "adapter:\u0663", "prompt": "q"})
    assert r.status == 404 and front.router.requests == []


def test_models_never_lists_an_id_twice():
    front = Front()
    front.registry.records.append(FakeRecord(4, "base"))
    ids = [m["id"] for m in call_app(front.app, "GET", "/v1/models").json()["data"]]
    assert ids == ["base", "shout", "sea", "adapter:2", "adapter:3", "adapter:4"]
    r = front.post("/v1/completions", {"model": "base", "prompt": "q"}, EVENTS)
    assert r.status == 200 and front.router.requests[0].HasField("adapters")
    assert len(front.router.requests[0].adapters.entries) == 0  # the base model, not adapter 4


# ---- models, health, metrics -------------------------------------------------------------------


def test_models_health_and_metrics():
    front = Front()
    front.registry.records[1].path = "/adapters/sea.gguf"
    front.deps.n_ctx = 2048
    models = call_app(front.app, "GET", "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["base", "shout", "sea", "adapter:2", "adapter:3"]
    assert [m["root"] for m in models["data"][:3]] == ["/models/base.gguf", "adapter:0", "/adapters/sea.gguf"]
    assert {m["max_model_len"] for m in models["data"]} == {2048}
    assert call_app(front.app, "GET", "/health").json() == {}
    assert call_app(front.app, "GET", "/ping").json() == {} and call_app(front.app, "POST", "/ping").json() == {}
    assert call_app(front.app, "GET", "/version").json() == {"version": importlib.metadata.version("loraplane")}
    m = call_app(front.app, "GET", "/metrics")
    assert (m.status, m.body, m.headers["content-type"]) == (200, b"up 1\n", "text/plain; version=0.0.4; charset=utf-8")
    off = call_app(Front(metrics=False).app, "GET", "/metrics")
    assert off.status == 404 and off.json()["error"]["type"] == "not_found_error"


# ---- admin ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, token",
    [
        ("Bearer s3cret", "s3cret"),
        ("bearer   s3cret  ", "s3cret"),
        ("BEARER a b", "a b"),
        ("Bearer", None),
        ("Bearer    ", None),
        ("Basic s3cret", None),
        ("s3cret", None),
        ("", None),
    ],
)
def test_bearer_token(value, token):
    assert bearer_token(value) == token


def test_check_bearer():
    assert check_bearer("Bearer s3cret", ADMIN_TOKEN) is BearerCheck.ACCEPTED
    assert check_bearer("Bearer s3cret2", ADMIN_TOKEN) is BearerCheck.REJECTED
    assert check_bearer("Bearer ", ADMIN_TOKEN) is BearerCheck.MISSING
    assert check_bearer(None, ADMIN_TOKEN) is BearerCheck.MISSING


@pytest.mark.parametrize(
    "headers, expected",
    [
        (None, MISSING),
        ({"authorization": "Bearer"}, MISSING),
        ({"authorization": "Basic s3cret"}, MISSING),
        ({"authorization": "Bearer wrong"}, REJECTED),
    ],
)
def test_admin_routes_refuse_without_the_token(headers, expected):
    front = Front()
    for path, body in (
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/a.gguf"}),
        ("/v1/unload_lora_adapter", {"lora_name": "sea"}),
    ):
        r = front.post(path, body, headers=headers)
        assert (r.status, r.json()) == (401, expected)
    assert [r.id for r in front.registry.records] == [0, 1, 2, 3] and front.announcer.unloaded == []


def test_load_and_unload_with_the_token():
    front = Front()
    auth = {"authorization": "Bearer s3cret"}
    r = front.post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/a.gguf"}, headers=auth)
    assert (r.status, r.body) == (200, b"Success: LoRA adapter 'new' added successfully (id 4).")
    assert r.headers["content-type"] == "text/plain; charset=utf-8"
    r = front.post("/v1/unload_lora_adapter", {"lora_name": "sea"}, headers=auth)
    assert r.body == b"Success: LoRA adapter 'sea' removed successfully (id 1)."
    r = front.post("/v1/unload_lora_adapter", {"lora_name": "adapter:3"}, headers=auth)
    assert r.body == b"Success: LoRA adapter 'adapter:3' removed successfully (id 3)."
    assert front.announcer.unloaded == [1, 3]
    assert [rec.id for rec in front.registry.records] == [0, 2, 4]


@pytest.mark.parametrize(
    "name, status, code",
    [("base", 400, "base_model"), ("dup", 400, "ambiguous_model"), ("zzz", 404, "model_not_found")],
)
def test_unload_refusals(name, status, code):
    front = Front()
    r = front.post("/v1/unload_lora_adapter", {"lora_name": name}, headers={"authorization": "Bearer s3cret"})
    assert (r.status, r.json()["error"]["code"]) == (status, code)
    assert front.announcer.unloaded == []


def test_admin_routes_are_open_without_a_configured_token():
    front = Front(admin_token=None)
    r = front.post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/a.gguf"})
    assert r.status == 200
    r = front.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/missing/a.gguf"})
    assert r.status == 404 and json.loads(r.body)["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"model": "base", "prompt": [1] * ((1 << 20) + 1)}, "prompt"),
        (
            "/v1/chat/completions",
            {"model": "base", "messages": [{"role": "user", "content": "a"}] * 70_000},
            "messages",
        ),
        ("/v1/completions", {"model": "base", "prompt": "q", "lora": [{"id": 0}] * 5000}, "lora"),
    ],
)
def test_long_lists_are_refused_before_item_by_item_validation(path, body, param):
    """Old code validated such lists item by item on the event loop (16 M ids: over 20 s)."""
    front = Front()
    r = front.post(path, body)
    assert r.status == 400 and (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, "too_many_items")
    assert front.router.requests == []


@pytest.mark.parametrize("prompt", [[True], [1, "a"], [1.5], {"a": 1}, None])
def test_prompt_must_be_text_or_token_ids(prompt):
    r = Front().post("/v1/completions", {"model": "base", "prompt": prompt})
    assert r.status == 400 and r.json()["error"]["param"] == "prompt", r.body
