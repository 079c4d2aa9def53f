"""Forced tool calls (``tool_choice`` ``"required"`` / a named function): the JSON Schemas the
output is constrained to (checked with ``jsonschema`` against answers that must pass or fail),
the parsers that turn the constrained output into ``tool_calls`` (whole and split at every
point, truncated), and the chat route over the in-process fakes (`tests.helpers.http_fakes`): the
GenerateRequest's ``response_format``, the answer's shape and ``finish_reason``, streaming, and
the refusals."""

from __future__ import annotations

import json

import jsonschema
import pytest

import control_plane.http.completions as completions
from control_plane.grammar_check import InlineChecker
from control_plane.http.errors import OpenAIError
from control_plane.http.tools import (
    NamedCallParser,
    RequiredCallsParser,
    forced_call_of,
    required_calls_schema,
    split_tool_calls,
    tool_parameters,
)
from loraplane.v1 import common_pb2
from tests.helpers.http_fakes import Front, finished, started, token

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"tz": {"$ref": "#/$defs/zone"}},
            "$defs": {"zone": {"enum": ["UTC", "CET"]}},
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters
USER = [{"role": "user", "content": "Weather in Paris?"}]
HERMES = (
    "{% if tools %}<tools>{{ tools | length }}</tools>{% endif %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}<tool_call>"
)


def _calls(calls):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


# ---- schemas -------------------------------------------------------------------------------------


def test_named_schema_is_the_tools_parameters_closed():
    closed_city = {**CITY, "additionalProperties": False}
    assert "additionalProperties" not in CITY
    assert tool_parameters(WEATHER) == closed_city  # not strict: the listed properties only all the same
    assert tool_parameters(NOW) == {"type": "object", "properties": {}, "additionalProperties": False}
    strict = tool_parameters(TIME)
    assert strict["additionalProperties"] is False
    forced = forced_call_of([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, InlineChecker())
    assert forced is not None and forced.name == "get_weather" and forced.schema == closed_city
    rf = forced.response_format()
    assert rf.type == common_pb2.ResponseFormat.TYPE_JSON_SCHEMA and json.loads(rf.schema) == closed_city


def test_required_schema_accepts_calls_of_the_tools_only():
    schema = required_calls_schema([WEATHER, TIME, NOW])
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema["$defs"] == {"zone": {"enum": ["UTC", "CET"]}}  # moved to the root: the $ref resolves
    good = [
        {"name": "get_weather", "parameters": {"city": "Paris"}},
        {"name": "get_time", "parameters": {"tz": "CET"}},
        {"name": "now", "parameters": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],  # at least one call
        [{"name": "get_stock", "parameters": {}}],  # not a tool
        [{"name": "get_weather", "parameters": {"town": "Paris"}}],  # not its parameters
        [{"name": "get_time", "parameters": {"tz": "PST"}}],  # $ref through the hoisted $defs
        [{"name": "get_time", "parameters": {"tz": "UTC", "x": 1}}],  # strict tool: closed
        [{"name": "get_weather", "parameters": {"city": "Paris", "x": 1}}],  # listed properties: closed too
        [{"name": "now"}],  # parameters required
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_required_schema_refuses_clashing_defs():
    other = json.loads(json.dumps(TIME))
    other["function"]["name"] = "get_date"
    other["function"]["parameters"]["$defs"]["zone"] = {"type": "string"}
    with pytest.raises(OpenAIError) as err:
        required_calls_schema([TIME, other])
    assert err.value.status == 400 and err.value.param == "tools" and "'zone'" in err.value.message


@pytest.mark.parametrize(
    "tools, choice, extra, param, words",
    [
        ([WEATHER], {"type": "function", "function": {"name": "get_stock"}}, {}, "tool_choice", "'get_stock'"),
        ([WEATHER], {"type": "function"}, {}, "tool_choice", "{'type': 'function'"),
        ([WEATHER], {"type": "tool", "function": {"name": "get_weather"}}, {}, "tool_choice", "{'type': 'function'"),
        (None, "required", {}, "tool_choice", "needs 'tools'"),
        ([WEATHER], "required", {"response_format": True}, "tool_choice", "'response_format'"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            {"type": "function", "function": {"name": "f"}},
            {},
            "tools",
            "tools[0].function.parameters",
        ),
    ],
)
def test_forced_call_refusals_name_the_field(tools, choice, extra, param, words):
    with pytest.raises(OpenAIError) as err:
        forced_call_of(tools, choice, InlineChecker(), **extra)
    assert err.value.status == 400 and err.value.param == param and words in err.value.message


# ---- parsers -------------------------------------------------------------------------------------

ARRAY = '[{"name":"get_weather","parameters":{"city":"Zürich"}},{"name":"now","parameters":{}}]'
REQUIRED_CASES = [
    # (output, engine finish, content, calls, finish_reason)
    (ARRAY, "stop", None, [("get_weather", '{"city": "Zürich"}'), ("now", "{}")], "tool_calls"),
    (ARRAY[:60], "length", ARRAY[54:60], [("get_weather", '{"city": "Zürich"}')], "length"),
    (ARRAY[:20], "length", ARRAY[:20], [], "length"),  # nothing completed: the text is content
    ('[{"name":"now","parameters":{}}] ', "stop", None, [("now", "{}")], "tool_calls"),
]


@pytest.mark.parametrize("output, engine, content, calls, reason", REQUIRED_CASES)
def test_required_parser_whole_and_split(output, engine, content, calls, reason):
    for cut in range(len(output) + 1):
        parser = RequiredCallsParser()
        got_calls = []
        text = ""
        for piece in (output[:cut], output[cut:]):
            step = parser.feed(piece)
            text += step.content
            got_calls += step.calls
        last = parser.finish()
        text += last.content
        got_calls += last.calls
        assert ((text or None), _calls(got_calls)) == (content, calls), cut
        assert parser.finish_reason(engine) == reason


def test_required_parser_releases_each_call_when_its_item_closes():
    parser = RequiredCallsParser()
    assert parser.feed('[{"name":"now","parameters":{}').calls == []
    assert _calls(parser.feed("},").calls) == [("now", "{}")]
    assert parser.feed('{"name":"now","parameters":{"a":[1,2]').calls == []
    assert _calls(parser.feed("}}]").calls) == [("now", '{"a": [1, 2]}')]


def test_named_parser_makes_one_call_of_the_whole_output():
    content, calls = split_tool_calls('{"city":"Paris"}', NamedCallParser("get_weather"))
    assert (content, _calls(calls)) == (None, [("get_weather", '{"city":"Paris"}')])
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert NamedCallParser("f").finish_reason("stop") == "stop"  # OpenAI / vLLM: named calls keep "stop"
    assert NamedCallParser("f").finish_reason("length") == "length"


# ---- the route -----------------------------------------------------------------------------------

NAMED_EVENTS = [started(1), token(10, '{"city":'), token(11, '"Paris"}'), finished('{"city":"Paris"}', "stop")]
REQ_TEXT = '[{"name":"get_weather","parameters":{"city":"Paris"}}]'
REQUIRED_EVENTS = [started(1), token(10, REQ_TEXT[:30]), token(11, REQ_TEXT[30:]), finished(REQ_TEXT, "stop")]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(autouse=True)
def fixed_ids(monkeypatch):
    monkeypatch.setattr(completions, "new_request_id", lambda prefix: f"{prefix}-1")
    monkeypatch.setattr(completions, "now_s", lambda: 1700000000)


def _sse(r):
    chunks = [json.loads(line[6:]) for line in r.body.decode().split("\n\n") if line.startswith("data: {")]
    return [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks if c["choices"]]


@pytest.mark.parametrize("template_text", [HERMES, ""])  # "": Gemma's built-in template, which renders no tools
def test_route_named_choice_constrains_and_answers_one_call(template_text):
    front = Front(template_text=template_text)
    body = {"model": "base", "messages": USER, "tools": [WEATHER, NOW], "tool_choice": NAMED}
    r = front.post("/v1/chat/completions", body, NAMED_EVENTS)
    assert r.status == 200, r.body
    (req,) = front.router.requests
    rf = req.sampling.response_format
    assert rf.type == common_pb2.ResponseFormat.TYPE_JSON_SCHEMA and json.loads(rf.schema) == {
        **CITY,
        "additionalProperties": False,
    }
    prompt = "".join(chr(i) for i in req.tokens.ids)
    assert ("<tools>2</tools>" in prompt) == bool(template_text)  # rendered where the template can
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] is None
    assert _calls(choice["message"]["tool_calls"]) == [("get_weather", '{"city":"Paris"}')]

    r = front.post("/v1/chat/completions", {**body, "stream": True}, NAMED_EVENTS)
    deltas = _sse(r)
    calls = [tc for d, _ in deltas for tc in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]) for c in calls] == [
        (0, {"name": "get_weather", "arguments": '{"city":"Paris"}'})
    ]
    assert deltas[-1][1] == "stop" and not any(d.get("content") for d, _ in deltas)


def test_route_required_choice_constrains_and_answers_calls():
    front = Front(template_text=HERMES)
    body = {"model": "base", "messages": USER, "tools": [WEATHER, NOW], "tool_choice": "required"}
    r = front.post("/v1/chat/completions", body, REQUIRED_EVENTS)
    assert r.status == 200, r.body
    (req,) = front.router.requests
    assert json.loads(req.sampling.response_format.schema) == required_calls_schema([WEATHER, NOW])
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert _calls(choice["message"]["tool_calls"]) == [("get_weather", '{"city": "Paris"}')]

    r = front.post("/v1/chat/completions", {**body, "stream": True}, REQUIRED_EVENTS)
    deltas = _sse(r)
    # the call goes out with the token that closed its item, before the finish
    assert [d for d, _ in deltas[1:]][0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert deltas[-1] == ({}, "tool_calls")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tool_choice": NAMED, "guided_regex": "a+"}, "tool_choice"),
        ({"tool_choice": "required", "tools": []}, "tool_choice"),
    ],
)
def test_route_forced_call_refusals(extra, param):
    front = Front(template_text=HERMES)
    r = front.post("/v1/chat/completions", {"model": "base", "messages": USER, "tools": [WEATHER], **extra})
    assert r.status == 400 and r.json()["error"]["param"] == param, r.body
    assert front.router.requests == []
