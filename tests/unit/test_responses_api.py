"""``POST /v1/responses`` in-process (`tests.helpers.http_fakes`: scripted router, fake registry,
Gemma's built-in template, a tokenizer of one id per character): the request → chat translation,
the GenerateRequest it makes (the same as ``/v1/chat/completions`` makes for the same
conversation), the response object and its events, and the refusals. No model, no processes."""

from __future__ import annotations

import json

import pytest

import control_plane.http.completions as completions
import control_plane.http.response_events as response_events
import control_plane.http.responses_api as responses_api
import control_plane.http.tools as tools_module
from control_plane.errors import UnavailableError
from control_plane.http.app import create_app
from control_plane.http.errors import OpenAIError
from control_plane.http.responses_api import chat_messages, chat_response_format, chat_tool_choice, chat_tools
from loraplane.v1 import common_pb2
from tests.helpers.grammar_bombs import defs_chain
from tests.helpers.http_fakes import EVENTS, Front, finished, started, token

CREATED = 1700000000


@pytest.fixture(autouse=True)
def fixed_ids(monkeypatch):
    monkeypatch.setattr(responses_api, "new_response_id", lambda: "resp_1")
    monkeypatch.setattr(responses_api, "now_s", lambda: CREATED)
    monkeypatch.setattr(response_events, "now_s", lambda: CREATED + 1)
    ids = iter(range(100))
    monkeypatch.setattr(response_events, "new_item_id", lambda prefix: f"{prefix}_{next(ids)}")
    calls = iter(range(100))
    monkeypatch.setattr(tools_module, "new_call_id", lambda: f"call_{next(calls)}")
    monkeypatch.setattr(completions, "new_request_id", lambda prefix: f"{prefix}-1")


def gemma_prompt(*turns: tuple[str, str]) -> list[int]:
    """The token ids (one per character, `FakeTokenizer`) of Gemma's built-in template over
    ``turns`` (role, text), generation prompt added."""
    text = "<bos>" + "".join(f"<start_of_turn>{r}\n{t}<end_of_turn>\n" for r, t in turns) + "<start_of_turn>model\n"
    return [ord(c) for c in text]


def events_of(body: bytes) -> list[tuple[str, dict]]:
    """``(event name, data)`` of each server-sent event; the name must equal the data's ``type``."""
    out = []
    for block in body.decode().split("\n\n"):
        if not block:
            continue
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: ")
        data = json.loads(data_line[len("data: ") :])
        assert data["type"] == name_line[len("event: ") :]
        out.append((data["type"], data))
    return out


HEAD = {
    "id": "resp_1",
    "object": "response",
    "created_at": CREATED,
    "background": False,
    "error": None,
    "incomplete_details": None,
    "instructions": None,
    "max_output_tokens": None,
    "metadata": {},
    "model": "sea",
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "reasoning": None,
    "store": False,
    "temperature": 1.0,
    "text": {"format": {"type": "text"}},
    "tool_choice": "auto",
    "tools": [],
    "top_p": 1.0,
    "truncation": "disabled",
    "user": None,
}


# ---- translation ----------------------------------------------------------------------------------


def test_instructions_and_leading_system_messages_join_and_developer_is_system():
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Hi "}, {"type": "input_text", "text": "you"}],
        },
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello", "annotations": []}], "id": "msg_9"},
        {"role": "user", "content": "Bye"},
    ]
    assert chat_messages(items, "You are loraplane.") == [
        {"role": "system", "content": "You are loraplane.\n\nBe brief."},
        {"role": "user", "content": "Hi you"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    assert chat_messages("Hello", None) == [{"role": "user", "content": "Hello"}]


def test_function_calls_join_the_assistant_turn_and_outputs_become_tool_messages():
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city":"Rome"}', "id": "fc_1"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
    ]
    call = lambda i, city: {  # noqa: E731
        "id": i,
        "type": "function",
        "function": {"name": "weather", "arguments": json.dumps({"city": city}, separators=(",", ":"))},
    }
    assert chat_messages(items, None) == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [call("c1", "Paris"), call("c2", "Rome")]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]


@pytest.mark.parametrize(
    ("items", "param", "needle"),
    [
        ([{"role": "tool", "content": "x"}], "input[0].role", "must be one of user, system, developer, assistant"),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "u"}],
                }
            ],
            "input[0].content[1]",
            "of type 'input_image' is not supported: text only",
        ),
        (
            [{"role": "user", "content": "q"}, {"type": "function_call_output", "call_id": "c9", "output": "x"}],
            "input[1].call_id",
            "'c9' answers no function_call earlier in 'input'",
        ),
        ([{"type": "item_reference", "id": "msg_1"}], "input[0].type", "none are stored"),
        ([{"type": "reasoning", "summary": []}], "input[0].type", "items of type 'reasoning' are not supported"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id", "must be a non-empty string"),
        (["text"], "input[0]", "must be an object"),
        ([], "input", "'input' is empty"),
    ],
)
def test_bad_input_items_are_400_naming_the_item(items, param, needle):
    with pytest.raises(OpenAIError) as err:
        chat_messages(items, None)
    assert err.value.status == 400 and err.value.param == param
    assert needle in err.value.message


def test_function_tools_become_chat_tools_strict_unless_false():
    tools = [
        {"type": "function", "name": "a", "parameters": {"type": "object"}, "description": "A."},
        {"type": "function", "name": "b", "parameters": None, "strict": False},
        {"type": "function", "name": "c", "strict": None},
    ]
    assert chat_tools(tools) == [
        {
            "type": "function",
            "function": {"name": "a", "parameters": {"type": "object"}, "strict": True, "description": "A."},
        },
        {"type": "function", "function": {"name": "b", "parameters": None, "strict": False}},
        {"type": "function", "function": {"name": "c", "strict": True}},
    ]
    assert list(chat_tools(tools)[0]["function"]) == ["name", "parameters", "description", "strict"]
    with pytest.raises(OpenAIError) as err:
        chat_tools([tools[0], {"type": "web_search"}])
    assert (err.value.param, err.value.code) == ("tools[1].type", "unsupported_parameter")
    with pytest.raises(OpenAIError) as err:
        chat_tools([{"type": "function", "name": ""}])
    assert err.value.param == "tools[0].name"


def test_tool_choice_and_text_format_translate_to_chat_shapes():
    assert [chat_tool_choice(c) for c in (None, "auto", "required", "none")] == [None, "auto", "required", "none"]
    assert chat_tool_choice({"type": "function", "name": "f"}) == {"type": "function", "function": {"name": "f"}}
    with pytest.raises(OpenAIError) as err:
        chat_tool_choice({"type": "allowed_tools", "tools": []})
    assert err.value.param == "tool_choice"
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "p", "schema": schema, "strict": True}
    assert chat_response_format({"format": fmt}) == {
        "type": "json_schema",
        "json_schema": {"name": "p", "schema": schema, "strict": True},
    }
    assert chat_response_format({"format": {"type": "text"}}) is None
    assert chat_response_format({"verbosity": "low"}) is None
    assert chat_response_format({"format": {"type": "json_object"}}) == {"type": "json_object"}
    with pytest.raises(OpenAIError) as err:
        chat_response_format({"format": {"type": "grammar"}})
    assert err.value.param == "text.format.type"


# ---- the route --------------------------------------------------------------------------------------


def test_create_runs_as_the_same_chat_request_and_answers_a_response_object():
    front = Front()
    body = {
        "model": "sea",
        "input": [{"role": "user", "content": "hello"}],
        "instructions": "Be kind.",
        "max_output_tokens": 20,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 7,
        "store": True,
        "metadata": {"k": "v"},
        "service_tier": "auto",
    }
    r = front.post("/v1/responses", body, EVENTS)
    assert r.status == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == {
        **HEAD,
        "instructions": "Be kind.",
        "max_output_tokens": 20,
        "metadata": {"k": "v"},
        "temperature": 0.5,
        "top_p": 0.9,
        "status": "completed",
        "output": [
            {
                "id": "msg_0",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Hi there.", "annotations": [], "logprobs": []}],
            }
        ],
        "usage": {
            "input_tokens": 2,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 2,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 4,
        },
        "completed_at": CREATED + 1,
    }
    chat = {
        "model": "sea",
        "messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hello"}],
        "max_completion_tokens": 20,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 7,
    }
    assert front.post("/v1/chat/completions", chat, EVENTS).status == 200
    resp_req, chat_req = front.router.requests
    assert list(resp_req.tokens.ids) == gemma_prompt(("user", "Be kind.\n\nhello"))
    assert resp_req.request_id == "resp_1"
    chat_req.request_id = "resp_1"
    assert resp_req == chat_req  # tokens, adapters (sea = 1), sampling: field for field
    assert [(e.id, e.scale) for e in resp_req.adapters.entries] == [(1, 1.0)]
    assert (resp_req.sampling.max_tokens, resp_req.sampling.seed) == (20, 7)
    assert front.router.cancelled == 2


def test_streamed_events_in_order_with_sequence_numbers_and_the_held_text():
    front = Front()
    r = front.post("/v1/responses", {"model": "sea", "input": "hello", "stream": True}, EVENTS)
    assert r.status == 200 and r.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = events_of(r.body)
    assert [e for e, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [d["sequence_number"] for _, d in events] == list(range(11))
    assert events[0][1]["response"] == {**HEAD, "status": "in_progress", "output": []}
    assert events[2][1]["item"] == {
        "id": "msg_0",
        "type": "message",
        "role": "assistant",
        "status": "in_progress",
        "content": [],
    }
    deltas = [d["delta"] for e, d in events if e == "response.output_text.delta"]
    assert deltas == ["Hi", " there", "."]  # "." was held back by the worker until the finish
    assert all(d["item_id"] == "msg_0" and d["output_index"] == 0 for _, d in events[3:9])
    assert events[7][1]["text"] == "Hi there."
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["output"] == [events[9][1]["item"]]
    assert final["output"][0]["content"][0]["text"] == "Hi there." and final["usage"]["output_tokens"] == 2


def test_token_limit_is_an_incomplete_response():
    front = Front()
    script = [started(5), token(10, "Hi"), finished("Hi", "length")]
    whole = front.post("/v1/responses", {"input": "hello", "max_output_tokens": 1}, script).json()
    assert (whole["status"], whole["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert whole["output"][0]["status"] == "incomplete" and whole["model"] == "base"
    streamed = events_of(front.post("/v1/responses", {"input": "hello", "stream": True}, script).body)
    assert streamed[-1][0] == "response.incomplete"
    assert streamed[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_required_tool_choice_answers_function_call_items():
    front = Front()
    tool = {
        "type": "function",
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    }
    body = {"model": "sea", "input": "Add.", "tools": [tool], "tool_choice": "required"}
    text = '[{"name":"add","parameters":{"a":1}},{"name":"add","parameters":{"a":2}}]'
    script = [started(5), token(10, text[:30]), token(11, text[30:]), finished(text, "stop")]
    whole = front.post("/v1/responses", body, script).json()
    assert whole["status"] == "completed" and whole["tool_choice"] == "required" and whole["tools"] == [tool]
    assert whole["output"] == [
        {
            "id": "fc_0",
            "type": "function_call",
            "status": "completed",
            "call_id": "call_0",
            "name": "add",
            "arguments": '{"a": 1}',
        },
        {
            "id": "fc_1",
            "type": "function_call",
            "status": "completed",
            "call_id": "call_1",
            "name": "add",
            "arguments": '{"a": 2}',
        },
    ]
    (req,) = front.router.requests
    fmt = req.sampling.response_format
    assert fmt.type == common_pb2.ResponseFormat.TYPE_JSON_SCHEMA
    schema = json.loads(fmt.schema)
    params = schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert params["additionalProperties"] is False  # strict by default (Responses function tools)
    events = events_of(front.post("/v1/responses", {**body, "stream": True}, script).body)
    assert [e for e, _ in events] == [
        "response.created",
        "response.in_progress",
        *["response.output_item.added", "response.function_call_arguments.delta"],
        *["response.function_call_arguments.done", "response.output_item.done"],
        *["response.output_item.added", "response.function_call_arguments.delta"],
        *["response.function_call_arguments.done", "response.output_item.done"],
        "response.completed",
    ]
    assert [d["delta"] for e, d in events if e.endswith("arguments.delta")] == ['{"a": 1}', '{"a": 2}']
    assert [d["item"]["call_id"] for e, d in events if e == "response.output_item.done"] == ["call_2", "call_3"]
    assert [i["output_index"] for i in (d for e, d in events if e == "response.output_item.added")] == [0, 1]


def test_text_format_json_schema_goes_to_structured_output_and_a_bad_schema_names_text_format():
    front = Front()
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    fmt = {"type": "json_schema", "name": "p", "schema": schema, "strict": True}
    r = front.post("/v1/responses", {"input": "x", "text": {"format": fmt}}, EVENTS)
    assert r.status == 200 and r.json()["text"] == {"format": fmt}
    (req,) = front.router.requests
    rf = req.sampling.response_format
    assert (rf.type, json.loads(rf.schema), rf.strict) == (common_pb2.ResponseFormat.TYPE_JSON_SCHEMA, schema, True)
    bad = front.post("/v1/responses", {"input": "x", "text": {"format": {**fmt, "schema": {"type": "foo"}}}})
    assert bad.status == 400
    error = bad.json()["error"]
    assert (error["param"], error["code"]) == ("text.format.schema", "invalid_response_format")
    assert error["message"].startswith("invalid 'text.format.schema': ")


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        (
            {"previous_response_id": "resp_0"},
            "previous_response_id",
            "'previous_response_id' is not supported: this server does not store responses; send the whole "
            "conversation in 'input' (earlier output items included: messages, and function_call items before "
            "their function_call_output)",
        ),
        ({"background": True}, "background", None),
        ({"truncation": "auto"}, "truncation", None),
        ({"reasoning": {"effort": "high"}}, "reasoning", None),
        ({"include": ["message.output_text.logprobs"]}, "include", None),
        ({"use_beam_search": True}, "use_beam_search", None),
        ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type", None),
    ],
)
def test_refused_parameters_are_400_naming_them(extra, param, message):
    front = Front()
    r = front.post("/v1/responses", {"model": "sea", "input": "x", **extra}, EVENTS)
    assert r.status == 400
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, "unsupported_parameter")
    if message is not None:
        assert error["message"] == message
    assert front.router.requests == []


def test_defaults_and_unknown_keys_pass():
    front = Front()
    body = {
        "input": "x",
        "truncation": "disabled",
        "reasoning": {"effort": None, "summary": None},
        "include": ["reasoning.encrypted_content"],
        "background": False,
        "prompt_cache_key": "k",
        "max_tool_calls": 3,
        "stream_options": {"include_obfuscation": False},
    }
    assert front.post("/v1/responses", body, EVENTS).status == 200


def test_chat_errors_name_the_responses_parameter():
    front = Front()
    front.deps.n_ctx = 20
    r = front.post("/v1/responses", {"input": "a long enough question"}, EVENTS)
    assert r.status == 400
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("input", "context_length_exceeded")
    n_tokens = len(gemma_prompt(("user", "a long enough question")))
    assert error["message"] == f"'input' has {n_tokens} tokens; this model's context is 20 tokens"
    r = front.post("/v1/responses", {"model": "nope", "input": "x"}, EVENTS)
    assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"
    r = front.post("/v1/responses", {"input": "x", "max_output_tokens": 0}, EVENTS)
    assert r.status == 400 and r.json()["error"]["param"] == "max_output_tokens"
    r = front.post("/v1/responses", {"input": [{"role": "user", "content": "x"}] * 70000})
    assert r.status == 400 and r.json()["error"]["param"] == "input"
    assert r.json()["error"]["code"] == "too_many_items"  # as chat's 'messages'
    assert "has 70000 items; at most 65536 are accepted" in r.json()["error"]["message"]


def test_auto_tools_on_a_template_without_tools_go_through_the_hermes_prompt():
    """As on chat: Gemma's built-in template renders no tools, so they reach the model in the
    hermes tool prompt (`tool_prompt`)."""
    front = Front()
    tool = {"type": "function", "name": "f"}
    r = front.post("/v1/responses", {"input": "x", "tools": [tool]}, EVENTS)
    assert r.status == 200, r.body
    (req,) = front.router.requests
    prompt = "".join(chr(i) for i in req.tokens.ids)  # FakeTokenizer: one id per character
    assert "# Tools" in prompt and '"name": "f"' in prompt


def test_errors_before_and_after_the_first_token():
    front = Front()
    r = front.post("/v1/responses", {"input": "x", "stream": True}, [UnavailableError("no worker")])
    assert r.status == 503 and r.json()["error"]["message"] == "no worker"
    script = [started(5), token(10, "Hi"), UnavailableError("worker went away")]
    events = events_of(front.post("/v1/responses", {"input": "x", "stream": True}, script).body)
    assert [e for e, _ in events][-3:] == ["response.output_text.delta", "error", "response.failed"]
    n = len(events)
    assert events[-2][1] == {
        "type": "error",
        "sequence_number": n - 2,
        "code": None,
        "message": "worker went away",
        "param": None,
    }
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "worker went away"}
    whole = front.post("/v1/responses", {"input": "x"}, script)
    assert whole.status == 503 and whole.json()["error"]["message"] == "worker went away"


def test_formats_and_tool_schemas_meet_the_grammar_limits_first():
    """The crash shapes of "Reliability round 4" are refused by the grammar limits (default
    `GrammarLimits`) before any engine runs, named in Responses terms."""
    front = Front()
    fmt = {"type": "json_schema", "name": "x", "schema": defs_chain(1000)}
    r = front.post("/v1/responses", {"input": "x", "text": {"format": fmt}}, EVENTS)
    assert r.status == 400 and r.json()["error"]["param"] == "text.format.schema"
    assert "limit" in r.json()["error"]["message"]
    tool = {"type": "function", "name": "f", "parameters": defs_chain(1000)}
    r = front.post("/v1/responses", {"input": "x", "tools": [tool], "tool_choice": "required"}, EVENTS)
    assert r.status == 400 and r.json()["error"]["param"] == "tools"
    assert front.router.requests == []


def test_the_api_key_guards_the_route():
    front = Front()
    front.deps.api_key = "k1"
    front.app = create_app(front.deps)
    r = front.post("/v1/responses", {"input": "x"}, EVENTS)
    assert r.status == 401 and r.json()["error"]["code"] == "invalid_api_key"
    ok = front.post("/v1/responses", {"input": "x"}, EVENTS, headers={"authorization": "Bearer k1"})
    assert ok.status == 200 and ok.json()["output"][0]["content"][0]["text"] == "Hi there."


def test_extension_keys_reach_the_request_and_other_keys_do_not():
    """vLLM's sampling extensions and ``lora`` pass to the chat request; chat-only keys such as
    ``max_tokens`` or ``response_format`` mean nothing on /v1/responses and are ignored."""
    front = Front()
    body = {
        "model": "base",
        "input": "x",
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "stop": ["."],
        "lora": [{"id": 0, "scale": 0.5}],
        "max_tokens": 3,
        "response_format": {"type": "json_object"},
    }
    assert front.post("/v1/responses", body, EVENTS).status == 200
    (req,) = front.router.requests
    s = req.sampling
    assert (s.top_k, round(s.min_p, 6), round(s.repetition_penalty, 6), list(s.stop)) == (5, 0.1, 1.2, ["."])
    assert [(e.id, e.scale) for e in req.adapters.entries] == [(0, 0.5)]
    assert s.max_tokens == 2**31 - 1 and not s.HasField("response_format")
