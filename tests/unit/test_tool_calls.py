"""Tool calls: the hermes ``<tool_call>`` parser on Qwen-like outputs (whole and split at every
point), the Qwen 2.5 template rendering tools, tool calls and tool results as transformers does,
and the chat route's ``tools`` / ``tool_choice`` handling over the in-process fakes
(`tests.helpers.http_fakes`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import control_plane.http.completions as completions
from control_plane.http.chat_template import ChatTemplate, load_chat_template
from control_plane.http.tools import (
    ToolCallParser,
    split_tool_calls,
    template_message,
    template_renders_tools,
)
from tests.helpers.http_fakes import FakeTokenizer, Front, finished, started, token

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
)
TEXT_AND_CALL = "I'll look that up.\n" + ONE
MALFORMED = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'
UNCLOSED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
TRUNCATED = '<tool_call>\n{"name": "get_weather", "argum'

# (output, expected content, expected [(name, arguments)])
CASES = [
    (ONE, None, [("get_weather", '{"city": "Paris"}')]),
    (TWO, None, [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Zürich"}')]),
    (TEXT_AND_CALL, "I'll look that up.", [("get_weather", '{"city": "Paris"}')]),
    (MALFORMED, MALFORMED, []),  # missing '}': the block stays content, tags and all
    (ONE + "\nDone.", "Done.", [("get_weather", '{"city": "Paris"}')]),
    (UNCLOSED, None, [("get_weather", '{"city": "Paris"}')]),  # open at the end: parsed to the end
    (TRUNCATED, TRUNCATED, []),
    ("No tools needed: 4.\n", "No tools needed: 4.\n", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('<tool_call>{"name": "now"}</tool_call>', None, [("now", "{}")]),  # no arguments: {}
    ("a <tool_call", "a <tool_call", []),  # a tag that never completed
]


def _calls(calls):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("output, content, calls", CASES)
def test_whole_output(output, content, calls):
    got_content, got_calls = split_tool_calls(output)
    assert (got_content, _calls(got_calls)) == (content, calls)
    for c in got_calls:
        assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) == 29
        json.loads(c["function"]["arguments"])


def _streamed(pieces):
    p = ToolCallParser()
    content, calls = "", []
    for piece in pieces:
        d = p.feed(piece)
        content, calls = content + d.content, calls + d.calls
    d = p.finish()
    return content + d.content, calls + d.calls


@pytest.mark.parametrize("output, content, calls", CASES)
def test_any_split_gives_the_same_answer(output, content, calls):
    """Every two-piece split (tags cut anywhere) and one character at a time."""
    splits = [[output[:i], output[i:]] for i in range(len(output) + 1)] + [list(output)]
    for pieces in splits:
        got_content, got_calls = _streamed(pieces)
        assert ((got_content if got_content.strip() else None), _calls(got_calls)) == (content, calls), pieces


def test_calls_are_released_when_their_tag_closes():
    p = ToolCallParser()
    assert (p.feed("Sure.\n<tool_").content, p.feed('call>\n{"name": "a", ').calls) == ("Sure.", [])
    d = p.feed('"arguments": {"x": 1}}\n</tool_call>')
    assert _calls(d.calls) == [("a", '{"x": 1}')] and d.content == ""
    assert (p.feed("\n").content, p.finish().content) == ("", "")  # whitespace after a call is dropped


# ---- the Qwen 2.5 template (llama.cpp's test copy) ------------------------------------------------


@pytest.fixture(scope="module")
def qwen_template(llama_cpp_vocab_dir: Path) -> ChatTemplate:
    text = (llama_cpp_vocab_dir / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8")
    return ChatTemplate("file:qwen", text, "", "<|im_end|>")


def test_qwen_template_renders_tools_calls_and_results(qwen_template: ChatTemplate):
    assert template_renders_tools(qwen_template)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    # OpenAI's shape: arguments as JSON text; the route turns them into an object first
    messages[1]["tool_calls"][0]["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [template_message(completions.flatten_message(m)) for m in messages]
    text = qwen_template.render(messages, tools=[WEATHER])
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\nYou are provided with function "
        "signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(WEATHER)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


def test_which_templates_render_tools(llama_cpp_vocab_dir: Path, qwen_template: ChatTemplate):
    gemma = load_chat_template(override_file=None, metadata={}, arch="gemma3", bos_token="", eos_token="")
    assert gemma is not None and not template_renders_tools(gemma)
    llama = (llama_cpp_vocab_dir / "templates" / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
    # Llama 3.1 reads `tools` but answers in its own JSON format, which this parser does not read
    assert not template_renders_tools(ChatTemplate("file:llama", llama, "", ""))


# ---- the route ------------------------------------------------------------------------------------

HERMES = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "Answer calls as <tool_call>{...}</tool_call>.{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endfor %}"
    "[assistant]"
)
PIECES = [
    "Let me check",
    ".\n<tool",
    '_call>\n{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}\n</tool_',
    "call>",
]
EVENTS = [started(1), *(token(10 + i, p) for i, p in enumerate(PIECES)), finished("".join(PIECES), "stop")]
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(autouse=True)
def fixed_ids(monkeypatch):
    monkeypatch.setattr(completions, "new_request_id", lambda prefix: f"{prefix}-1")
    monkeypatch.setattr(completions, "now_s", lambda: 1700000000)


def _prompt(front: Front) -> str:
    (req,) = front.router.requests
    return "".join(chr(i) for i in req.tokens.ids)  # FakeTokenizer: one id per character


def test_route_renders_tools_and_answers_tool_calls():
    front = Front(template_text=HERMES)
    r = front.post("/v1/chat/completions", {"model": "base", "messages": USER, "tools": [WEATHER]}, EVENTS)
    assert r.status == 200, r.body
    assert _prompt(front).startswith("<tools>" + json.dumps(WEATHER) + "</tools>")
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check."
    assert [(c["type"], c["function"]) for c in message["tool_calls"]] == [
        ("function", {"name": "get_weather", "arguments": '{"city": "Paris"}'})
    ]


def test_route_streams_tool_calls_whole():
    """As OpenAI streams calls: ``content`` null in the first chunk (a client joining the deltas
    ends with null when no text comes), the call in a chunk of its own, ``finish_reason`` alone
    in the last chunk."""
    front = Front(template_text=HERMES)
    body = {"model": "base", "messages": USER, "tools": [WEATHER], "stream": True}
    r = front.post("/v1/chat/completions", body, EVENTS)
    chunks = [json.loads(line[6:]) for line in r.body.decode().split("\n\n") if line.startswith("data: {")]
    deltas = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks]
    assert deltas[0] == ({"role": "assistant", "content": None}, None)
    assert deltas[-1] == ({}, "tool_calls")
    assert "".join(d.get("content") or "" for d, _ in deltas) == "Let me check."
    calls = [tc for d, _ in deltas for tc in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert deltas[-1][1] == "tool_calls" and all(reason is None for _, reason in deltas[:-1])
    assert r.body.decode().endswith("data: [DONE]\n\n")


def test_route_passes_history_with_tool_calls_and_results():
    front = Front(template_text=HERMES)
    call = {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "7C"}]
    body = {"model": "base", "messages": messages, "tools": [WEATHER]}
    assert front.post("/v1/chat/completions", body, EVENTS).status == 200
    assert _prompt(front).endswith(
        '[assistant]<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>[tool]7C[assistant]'
    )


def test_tool_choice_none_neither_renders_nor_parses():
    front = Front(template_text=HERMES)
    body = {"model": "base", "messages": USER, "tools": [WEATHER], "tool_choice": "none"}
    r = front.post("/v1/chat/completions", body, EVENTS)
    assert "<tools>" not in _prompt(front)
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "".join(PIECES)}
    assert r.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "template_text, extra, param, code",
    [
        (HERMES, {"tool_choice": "sometimes"}, "tool_choice", None),
        (HERMES, {"tools": [{"type": "function", "function": {}}]}, "tools", None),
        (HERMES, {"tools": [{"type": "retrieval"}]}, "tools", None),
    ],
)
def test_tool_refusals_name_the_field(template_text, extra, param, code):
    front = Front(template_text=template_text)
    r = front.post("/v1/chat/completions", {"model": "base", "messages": USER, "tools": [WEATHER], **extra}, EVENTS)
    err = r.json()["error"]
    assert r.status == 400 and err["param"] == param, r.body
    if code is not None:
        assert err["code"] == code
    assert front.router.requests == []


def test_arguments_nested_past_the_recursion_limit_stay_text():
    # history arguments were a 500 (RecursionError from the JSON decoder), model output too
    deep = "[" * 50_000 + "]" * 50_000
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": deep}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    assert template_message(message) == message
    output = '<tool_call>{"name": "get_weather", "arguments": ' + json.dumps(deep) + "}</tool_call>"
    content, calls = split_tool_calls(output)
    assert content == output and calls == []


def test_tokenizer_fake_is_one_id_per_character():
    assert FakeTokenizer().encode("ab", add_special=False, parse_special=True) == [97, 98]


# ---- templates that render no tools: the hermes tool prompt ---------------------------------------

GEMMA_CALL = ONE


def _gemma_events(text: str) -> list:
    return [started(1), token(10, text), finished(text, "stop")]


def test_auto_on_a_template_without_tools_tells_the_model_in_the_hermes_format():
    """Gemma's built-in template renders no tools: the tools go into the system text (which
    Gemma puts in the first user turn) in Qwen's hermes prompt, and the answer's
    ``<tool_call>`` blocks are read back as calls."""
    from control_plane.http.tool_prompt import HERMES_TOOL_PROMPT

    front = Front()  # Gemma's built-in template
    body = {"model": "base", "messages": [{"role": "system", "content": "Be brief."}, *USER], "tools": [WEATHER]}
    r = front.post("/v1/chat/completions", body, _gemma_events(GEMMA_CALL))
    assert r.status == 200, r.body
    prompt = _prompt(front)
    assert prompt.startswith("<bos><start_of_turn>user\nBe brief.\n\n# Tools\n\n")
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in prompt
    assert HERMES_TOOL_PROMPT.split("<tool_call>")[0].startswith("# Tools")
    assert prompt.endswith("Weather in Paris?<end_of_turn>\n<start_of_turn>model\n")
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert _calls(choice["message"]["tool_calls"]) == [("get_weather", '{"city": "Paris"}')]


def test_a_tool_loop_on_a_template_without_tools():
    """The follow-up turn: the assistant's call as the block it would have written, the tool's
    result as a user turn of ``<tool_response>`` (two results joined into one turn), a
    ``developer`` message as system text; Gemma's alternation holds."""
    front = Front()
    call = {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        {"role": "developer", "content": "Use tools."},
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call, call]},
        {"role": "tool", "tool_call_id": "call_9", "content": "7C"},
        {"role": "tool", "tool_call_id": "call_9", "content": "8C"},
    ]
    r = front.post("/v1/chat/completions", {"model": "base", "messages": messages, "tools": [WEATHER]}, EVENTS)
    assert r.status == 200, r.body
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert _prompt(front).endswith(
        "Weather in Paris?<end_of_turn>\n"
        f"<start_of_turn>model\n{block}\n{block}<end_of_turn>\n"
        "<start_of_turn>user\n<tool_response>\n7C\n</tool_response>\n<tool_response>\n8C\n</tool_response>"
        "<end_of_turn>\n<start_of_turn>model\n"
    )
    assert _prompt(front).startswith("<bos><start_of_turn>user\nUse tools.\n\n# Tools")


def test_a_template_refusal_names_the_message_and_role():
    front = Front()
    messages = [{"role": "assistant", "content": "Hi"}, *USER]
    r = front.post("/v1/chat/completions", {"model": "base", "messages": messages}, EVENTS)
    err = r.json()["error"]
    assert r.status == 400 and err["param"] == "messages" and err["code"] == "chat_template_refused"
    assert "Conversation roles must alternate" in err["message"]
    assert "messages[0] has role 'assistant' where 'user' was expected" in err["message"]


def test_role_diagnosis():
    from control_plane.http.tool_prompt import role_diagnosis

    u, a = {"role": "user"}, {"role": "assistant"}
    assert role_diagnosis([{"role": "system"}, u, a, {"role": "tool"}, u, a]) == ""
    assert role_diagnosis([u, a, a]) == "messages[2] has role 'assistant' where 'user' was expected"
    assert role_diagnosis([u, {"role": "robot"}]) == "messages[1] has role 'robot' where 'assistant' was expected"
