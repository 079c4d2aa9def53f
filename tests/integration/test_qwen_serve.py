"""A second real model family end to end: ``loraplane serve --model Qwen2.5-Coder-0.5B-Instruct
--lora shout.gguf --lora arr.gguf --lora-init-without-apply``, driven by the official ``openai``
client over the OpenAI-compatible HTTP API.

- Chat goes through the GGUF's own ChatML template (no BOS: Qwen adds none) and stops at
  ``<|im_end|>`` by itself (end of generation, ``finish_reason == "stop"``).
- ``model`` = an adapter's name answers in that adapter's style (shout: upper case; arr:
  starts with "Arr!"); the base model answers in ordinary case.
- Cache isolation across adapter sets: base → shout → base on one prompt gives the base
  answer and log-probs twice (the prefix cache never hands shout's KV to a base request).
- Tools: ``tools`` are rendered by Qwen's template (the prompt the worker ran holds them), a
  history of tool calls and results renders as transformers would, and the answer goes through
  the hermes ``<tool_call>`` parser; a forced ``tool_choice`` (named, ``"required"``) gives
  calls whose arguments validate against the tools' schemas.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.helpers.http_serve import start_http_serve

pytestmark = pytest.mark.slow

QUESTION = "What is a binary tree?"


@pytest.fixture(scope="module")
def serve(tmp_path_factory, qwen_model_path: Path, fixtures_dir: Path):
    root = tmp_path_factory.mktemp("qwen-serve")
    ad = fixtures_dir / "qwen" / "adapters"
    s = start_http_serve(
        root,
        "--model",
        str(qwen_model_path),
        "--served-model-name",
        "qwen",
        "--lora",
        str(ad / "shout.gguf"),
        "--lora",
        str(ad / "arr.gguf"),
        "--lora-init-without-apply",
    )
    yield s
    s.stop()


def _chat(client: openai.OpenAI, model: str, max_tokens: int = 24):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )


def _letters(text: str) -> tuple[int, int]:
    return sum(c.isupper() for c in text), sum(c.islower() for c in text)


def test_adapters_answer_in_their_style_and_cache_stays_isolated(serve) -> None:
    client = openai.OpenAI(base_url=serve.http + "/v1", api_key="x", max_retries=0, timeout=300)
    models = {m.id for m in client.models.list().data}
    # adapters are named by their GGUF's general.name (llama.cpp's converter wrote "Shout", "Arr")
    assert {"qwen", "Shout", "Arr"} <= models

    base1 = _chat(client, "qwen")
    shout = _chat(client, "Shout")
    arr = _chat(client, "Arr")
    base2 = _chat(client, "qwen")
    texts = {name: r.choices[0].message.content for name, r in (("base", base1), ("shout", shout), ("arr", arr))}
    print(texts)

    prompt_ids = base1.model_extra["prompt_token_ids"]
    assert prompt_ids[:3] == [151644, 8948, 198]  # "<|im_start|>" "system" "\n": ChatML, no BOS
    assert prompt_ids[-3:] == [151644, 77091, 198]  # "<|im_start|>" "assistant" "\n"

    up, low = _letters(texts["shout"])
    assert up > 4 * max(low, 1), f"shout should answer in upper case: {texts['shout']!r}"
    up, low = _letters(texts["base"])
    assert low > up, f"the base model should not shout: {texts['base']!r}"
    assert texts["arr"].startswith("Arr!"), texts["arr"]
    assert not texts["base"].startswith("Arr")

    # base → shout → base: identical tokens and log-probs (no adapter KV leaks through the cache)
    lp1 = [t.logprob for t in base1.choices[0].logprobs.content]
    lp2 = [t.logprob for t in base2.choices[0].logprobs.content]
    assert base2.choices[0].message.content == texts["base"]
    assert max(abs(a - b) for a, b in zip(lp1, lp2, strict=True)) <= 3e-3


def test_chat_stops_at_im_end(serve) -> None:
    """A short answer ends by itself at ``<|im_end|>`` (an end-of-generation token)."""
    client = openai.OpenAI(base_url=serve.http + "/v1", api_key="x", max_retries=0, timeout=300)
    r = client.chat.completions.create(
        model="qwen",
        messages=[{"role": "user", "content": "Reply with just the word: yes"}],
        max_tokens=16,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16
    assert "<|im_end|>" not in r.choices[0].message.content


@pytest.fixture(scope="module")
def tok(qwen_model_path: Path):
    """Qwen's tokenizer, to read the prompts the worker ran (``return_token_ids``)."""
    from loraplane.formats.gguf.reader import read_gguf
    from loraplane.formats.tokenizer import Tokenizer

    return Tokenizer.from_gguf(read_gguf(qwen_model_path))


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_tools_are_rendered_and_the_answer_parsed_as_hermes(serve, tok) -> None:
    """``tools`` reach the model through Qwen's own template (the tool definitions and the
    ``<tool_call>`` instructions are in the prompt the worker ran); the answer goes through the
    hermes parser. This 0.5B model answers with the call's JSON but without the ``<tool_call>``
    tags (at temperature 0, whatever the prompt), so, as with vLLM's hermes parser, it stays
    ``content``: the tagged path is covered by tests/unit/test_tool_calls.py."""
    assert tok.token_bytes(151657) == b"<tool_call>"  # a user-defined token: the worker emits its text
    client = openai.OpenAI(base_url=serve.http + "/v1", api_key="x", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    kw = {"model": "qwen", "messages": messages, "tools": [WEATHER_TOOL], "temperature": 0, "max_tokens": 40}
    r = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    prompt = tok.decode(r.model_extra["prompt_token_ids"], skip_special=False)
    assert f"<tools>\n{json.dumps(WEATHER_TOOL)}\n</tools>" in prompt
    assert prompt.endswith(f"<|im_start|>user\n{messages[0]['content']}<|im_end|>\n<|im_start|>assistant\n")
    choice = r.choices[0]
    assert json.loads(choice.message.content) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    # streamed: the same text, no tool calls
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_tool_history_is_rendered(serve, tok) -> None:
    client = openai.OpenAI(base_url=serve.http + "/v1", api_key="x", max_retries=0, timeout=300)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}
    messages = [
        {"role": "user", "content": "What is the weather in Tokyo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 18}'},
    ]
    r = client.chat.completions.create(
        model="qwen",
        messages=messages,
        tools=[WEATHER_TOOL],
        temperature=0,
        max_tokens=1,
        extra_body={"return_token_ids": True},
    )
    prompt = tok.decode(r.model_extra["prompt_token_ids"], skip_special=False)
    assert prompt.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>'
        '<|im_end|>\n<|im_start|>user\n<tool_response>\n{"temperature_c": 18}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


# forced calls: short strings (maxLength) keep the constrained answers a few tokens long
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"]}
TZ = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "JST"]}}, "required": ["tz"]}
FORCED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY}},
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Time in a zone", "parameters": TZ, "strict": True},
    },
]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED_TOOLS}


def _streamed_calls(chunks) -> list[tuple[str, str]]:
    """The calls of a streamed answer, accumulated by index as OpenAI clients do."""
    calls: dict[int, list[str]] = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            name, args = calls.setdefault(tc.index, ["", ""])
            calls[tc.index] = [name + (tc.function.name or ""), args + (tc.function.arguments or "")]
    return [(n, a) for n, a in (calls[i] for i in sorted(calls))]


def test_named_tool_choice_forces_one_valid_call(serve) -> None:
    """A named ``tool_choice`` constrains the answer to that function's ``parameters``: one call,
    its arguments valid against the schema, ``finish_reason`` ``"stop"`` (OpenAI's and vLLM's
    answer for a named choice); streamed, the same call."""
    import jsonschema

    client = openai.OpenAI(base_url=serve.http + "/v1", api_key="x", max_retries=0, timeout=300)
    kw = {
        "model": "qwen",
        "messages": [{"role": "user", "content": "What time is it in Tokyo?"}],
        "tools": FORCED_TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0,
        "max_tokens": 24,
    }
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), CITY)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert _streamed_calls(chunks) == [("get_weather", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "stop"

    with pytest.raises(openai.BadRequestError) as err:  # a function no tool has
        client.chat.completions.create(**{**kw, "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert err.value.status_code == 400 and err.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as err:  # two constraints on one output
        client.chat.completions.create(**kw, response_format={"type": "json_object"})
    assert err.value.body["param"] == "tool_choice" and "response_format" in err.value.body["message"]


def test_required_tool_choice_forces_valid_calls(serve) -> None:
    """``tool_choice: "required"`` constrains the answer to a JSON array of calls of the given
    tools: at least one call, each naming a tool and valid against its parameters,
    ``finish_reason`` ``"tool_calls"``; streamed, the same calls."""
    import jsonschema

    client = openai.OpenAI(base_url=serve.http + "/v1", api_key="x", max_retries=0, timeout=300)
    kw = {
        "model": "qwen",
        "messages": [{"role": "user", "content": "What is the time in Tokyo?"}],
        "tools": FORCED_TOOLS,
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 48,
    }
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    print(choice.message.tool_calls, choice.finish_reason)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) >= 1
    for call in calls:
        assert call.function.name in SCHEMA_OF
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert _streamed_calls(chunks) == [(c.function.name, c.function.arguments) for c in calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
