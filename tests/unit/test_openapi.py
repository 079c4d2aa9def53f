"""``GET /openapi.json`` describes what the routes take and answer: real answers of the app (over
the in-process fakes) validate against the documented response schemas, real request bodies
against the request schemas, and a malformed body does not."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.helpers.http_fakes import EVENTS, Front, call_app

HERMES = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}<tool_call>[assistant]"
)
CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'


@pytest.fixture(scope="module")
def doc():
    return call_app(Front().app, "GET", "/openapi.json").json()


def _validate(doc, instance, name):
    jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", **doc}).validate(instance)


def _answer_schema(doc, path, method):
    return doc["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].split("/")[
        -1
    ]


def _request_schema(doc, path, method):
    return doc["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "logprobs": 1}),
        ("/v1/completions", {"prompt": [[5, 6], [7]], "return_token_ids": True}),
        ("/v1/completions", {"prompt": [5, 6], "echo": True, "logprobs": 0, "max_tokens": 0}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}),
        ("/v1/responses", {"input": "x"}),
        ("/tokenize", {"prompt": "ab"}),
    ],
)
def test_answers_validate_against_the_documented_schemas(doc, path, body):
    r = Front().post(path, body, EVENTS)
    assert r.status == 200, r.body
    _validate(doc, body, _request_schema(doc, path, "post"))
    _validate(doc, r.json(), _answer_schema(doc, path, "post"))


def test_tool_calls_models_version_and_errors_validate(doc):
    from tests.helpers.http_fakes import finished, started, token

    front = Front(template_text=HERMES)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    events = [started(1), token(10, CALL), finished(CALL, "stop")]
    r = front.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": tools}, events)
    assert r.json()["choices"][0]["message"]["tool_calls"]
    _validate(doc, r.json(), "ChatCompletionResponse")
    for path, name in (("/v1/models", "ModelList"), ("/v1/models/sea", "ModelCard"), ("/version", "Version")):
        _validate(doc, call_app(front.app, "GET", path).json(), name)
        assert _answer_schema(doc, path if path != "/v1/models/sea" else "/v1/models/{model}", "get") == name
    bad = front.post("/v1/completions", {"prompt": "x", "n": 3}, EVENTS)
    assert bad.status == 400
    _validate(doc, bad.json(), "ErrorResponse")
    assert doc["paths"]["/v1/completions"]["post"]["responses"]["default"]["content"]["application/json"]


def test_a_malformed_body_does_not_validate(doc):
    with pytest.raises(jsonschema.ValidationError):
        _validate(doc, {"prompt": 5}, "CompletionRequest")
    with pytest.raises(jsonschema.ValidationError):
        _validate(doc, {"messages": [{"content": "no role"}]}, "ChatCompletionRequest")
    assert "text/event-stream" in doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert json.dumps(doc).count("HTTPValidationError") == 0  # FastAPI's 422 is never sent here
