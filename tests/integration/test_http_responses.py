"""``/v1/responses`` against a real ``loraplane serve`` (control plane + worker, embedded Gemma 3
270M, fixture adapters shout = id 0 and sea = id 1), driven by the official ``openai`` package's
``responses.create``, ``responses.stream`` and ``responses.parse``.

The server runs with a tool-rendering chat template (`TOOL_TEMPLATE`, Gemma's turns plus hermes
``<tool_call>`` / ``<tool_response>`` blocks), so a whole tool loop runs: a forced call, then the
follow-up turn carrying the ``function_call`` and its ``function_call_output``. Each Responses
answer is checked against the chat completions answer to the same conversation (greedy: the
same text, the same token counts), which is what the translation promises."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pydantic
import pytest

from tests.helpers.http_serve import start_http_serve

pytestmark = pytest.mark.slow

TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools is defined and tools %}<start_of_turn>system\nTools:\n"
    "{% for t in tools %}{{ t['function'] | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><end_of_turn>\n{% endif %}'
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<start_of_turn>user\n<tool_response>{{ m['content'] }}</tool_response>"
    "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}"
    "<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}{% endif %}"
    "{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def serve(tmp_path_factory, fixtures_dir: Path):
    root = tmp_path_factory.mktemp("responses-serve")
    template = root / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    ad = fixtures_dir / "adapters"
    s = start_http_serve(
        root,
        "--lora",
        str(ad / "shout.gguf"),
        "--lora",
        str(ad / "sea.gguf"),
        "--lora-init-without-apply",
        "--chat-template",
        str(template),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve.http + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_create_equals_chat_completions_with_the_adapter_model_names(client):
    r = client.responses.create(
        model="shout", instructions="Answer briefly.", input="Hello there", max_output_tokens=8, temperature=0
    )
    chat = client.chat.completions.create(
        model="shout",
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello there"}],
        max_tokens=8,
        temperature=0,
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "shout" and r.store is False
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert r.output_text == chat.choices[0].message.content
    assert r.output_text == r.output_text.upper() and any(c.isalpha() for c in r.output_text)  # shout
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 8
    assert r.usage.total_tokens == chat.usage.prompt_tokens + 8
    # a list of messages with a developer message is the same conversation
    listed = client.responses.create(
        model="shout",
        input=[
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]},
        ],
        max_output_tokens=8,
        temperature=0,
        store=True,
    )
    assert listed.output_text == r.output_text and listed.usage.input_tokens == r.usage.input_tokens


def test_stream_deltas_concatenate_to_the_final_text_and_usage(client):
    args = dict(model="sea", input="Tell me about the sea.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**args)
    events = list(client.responses.create(**args, stream=True))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens == 12
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_stream_helper_and_parse_with_a_pydantic_model(client):
    with client.responses.stream(
        model="sea", input="A person as JSON.", text_format=Person, max_output_tokens=60, temperature=0
    ) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and deltas == final.output_text
    assert isinstance(final.output_parsed, Person)
    jsonschema.validate(json.loads(deltas), PERSON)
    parsed = client.responses.parse(
        model="sea", input="A person as JSON.", text_format=Person, max_output_tokens=60, temperature=0
    )
    assert parsed.output_parsed == final.output_parsed
    assert parsed.usage.output_tokens == final.usage.output_tokens
    # the plain json_schema format, as a dict
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client.responses.create(model="shout", input="A person.", text={"format": fmt}, max_output_tokens=60)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)


def test_forced_function_call_then_the_follow_up_turn_with_its_output(client):
    tool = {
        "type": "function",
        "name": "add_person",
        "description": "Add a person to the address book.",
        "parameters": PERSON,
        "strict": True,
    }
    required = dict(model="sea", input="Add a person.", tools=[tool], tool_choice="required", max_output_tokens=60)
    first = client.responses.create(**required, temperature=0)
    # the 270M model repeats array items until the limit: the completed ones are calls
    assert first.status == ("incomplete" if first.usage.output_tokens == 60 else "completed")
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(c.name == "add_person" and c.call_id.startswith("call_") for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), PERSON)
    # streamed: the same calls, each one's arguments in one delta
    events = list(client.responses.create(**required, temperature=0, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(d.name, d.arguments) for d in done] == [(c.name, c.arguments) for c in calls]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas == [c.arguments for c in calls]
    assert events[-1].type == f"response.{first.status}"
    # a named function: exactly one call, the whole answer its arguments
    named = client.responses.create(
        **{**required, "tool_choice": {"type": "function", "name": "add_person"}}, temperature=0
    )
    assert named.status == "completed"
    (only,) = named.output
    assert only.type == "function_call" and only.name == "add_person"
    jsonschema.validate(json.loads(only.arguments), PERSON)
    # the follow-up turn: the call and its output go back in 'input' (nothing is stored)
    call = calls[0]
    follow = [
        {"role": "user", "content": "Add a person."},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "added, id 7"},
    ]
    second = client.responses.create(model="sea", input=follow, tools=[tool], max_output_tokens=10, temperature=0)
    chat = client.chat.completions.create(
        model="sea",
        messages=[
            {"role": "user", "content": "Add a person."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "added, id 7"},
        ],
        tools=[{"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")}}],
        max_tokens=10,
        temperature=0,
    )
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.usage.output_tokens == chat.usage.completion_tokens
    answer = chat.choices[0].message
    assert second.output_text == (answer.content or "")
    made = [(i.name, i.arguments) for i in second.output if i.type == "function_call"]
    assert made == [(c.function.name, c.function.arguments) for c in answer.tool_calls or []]


def test_previous_response_id_is_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="sea", input="x", previous_response_id="resp_123")
    assert err.value.status_code == 400
    assert err.value.body["param"] == "previous_response_id"
    assert err.value.body["code"] == "unsupported_parameter"
    assert "send the whole conversation in 'input'" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="nope", input="x")
    assert err.value.body["code"] == "model_not_found"
