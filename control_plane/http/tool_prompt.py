"""Tools for chat templates that do not render them: the conversation rewritten in the hermes
format (Qwen 2.5's tool prompt), then rendered by the model's own template.

A template that renders tools itself (`tools.template_renders_tools`: Qwen 2.5, Qwen 3, Hermes)
gets the messages and tools as they are. Any other (Gemma's built-in, Llama 2's) gets
`hermes_messages`: what a tool-aware template would have said, as plain turns it can render —
llama.cpp's answer for such templates too (``common/chat.cpp``: a generic tool prompt in the
system message, tool results as user turns):

- the tools and the call format go into the system text (`HERMES_TOOL_PROMPT`, after its own);
- an assistant message's ``tool_calls`` become ``<tool_call>{"name", "arguments"}</tool_call>``
  blocks after its content — the format `tools.ToolCallParser` reads back;
- a ``tool`` message becomes a user turn holding ``<tool_response>…</tool_response>``;
  consecutive user turns (several results, or a result then a question) are joined into one,
  so templates that want user and assistant to alternate accept the loop;
- a ``developer`` message is a system message (OpenAI's newer name for it) when the template
  does not name that role itself.

To give the model other instructions, start with a ``--chat-template`` that renders tools: it
is used as it is.
"""

from __future__ import annotations

import json
from typing import Any

from control_plane.http.chat_template import ChatTemplate

HERMES_TOOL_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
"""The system text that tells a model about ``tools`` (Qwen 2.5's hermes tool prompt, word for
word), rendered by the same bounded sandbox as chat templates."""


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template: ChatTemplate
) -> list[dict[str, Any]]:
    """``messages`` (template-ready: `tools.template_message`) rewritten for a template that
    renders no tools (module docstring).

    Args:
        messages: the request's messages, ``content`` flattened to text.
        tools: the tools to describe (None: none; tool calls and results in the conversation are
            rewritten all the same).
        template: the model's template: the tool prompt is rendered in its sandbox, and a
            ``developer`` message stays one when the template names that role.

    Raises:
        ChatTemplateError: the tool prompt failed to render (`ChatTemplate.render`'s bounds).
    """
    keep_developer = "developer" in template.text
    out: list[dict[str, Any]] = []
    if tools:
        prompt = ChatTemplate("builtin:hermes-tools", HERMES_TOOL_PROMPT, "", "").render(
            [], add_generation_prompt=False, tools=tools
        )
        out.append({"role": "system", "content": prompt})
    for m in messages:
        role = m.get("role")
        raw = m.get("content")
        content = raw if isinstance(raw, str) else ""
        if role == "developer" and not keep_developer:
            role = "system"
        if role == "tool":
            _append(out, "user", f"<tool_response>\n{content}\n</tool_response>")
        elif role == "assistant" and isinstance(m.get("tool_calls"), list) and m["tool_calls"]:
            blocks = [_call_block(c) for c in m["tool_calls"]]
            text = "\n".join([content, *blocks] if content.strip() else blocks)
            out.append({**{k: v for k, v in m.items() if k != "tool_calls"}, "role": "assistant", "content": text})
        elif role == "system" and out and out[0]["role"] == "system" and len(out) == 1 and tools:
            out[0] = {**m, "role": "system", "content": f"{content}\n\n{out[0]['content']}"}
        elif role == "user":
            _append(out, "user", content, m)
        else:
            out.append({**m, "role": role})
    return out


def _append(out: list[dict[str, Any]], role: str, content: str, message: dict[str, Any] | None = None) -> None:
    """Add a ``role`` turn, joined to the previous turn when that is a ``role`` turn too."""
    if out and out[-1]["role"] == role:
        out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{content}"}
    else:
        out.append({**(message or {}), "role": role, "content": content})


def _call_block(call: Any) -> str:
    """One assistant tool call as the hermes block the model would have written."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        fn = {}
    args = fn.get("arguments", {})
    if isinstance(args, str):  # not JSON text of an object (`template_message` parsed those)
        args = {"raw": args}
    body = json.dumps({"name": fn.get("name", ""), "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def role_diagnosis(messages: list[dict[str, Any]]) -> str:
    """Which request message breaks user / assistant alternation, for a template's refusal that
    does not say (Gemma's: "Conversation roles must alternate …"): ``"messages[i] has role 'r'
    where 'e' was expected"``, or ``""`` when they alternate. Read as `hermes_messages` renders
    them: leading ``system`` / ``developer`` messages aside, ``tool`` results count as user
    turns, and a run of user turns is one."""
    expected = "user"
    previous = None
    for i, m in enumerate(messages):
        role = m.get("role")
        if previous is None and role in ("system", "developer"):
            continue
        turn = "user" if role == "tool" else role
        if turn == "user" and previous == "user":
            continue
        if turn != expected:
            return f"messages[{i}] has role {role!r} where {expected!r} was expected"
        previous = turn
        expected = "assistant" if expected == "user" else "user"
    return ""


__all__ = ["HERMES_TOOL_PROMPT", "hermes_messages", "role_diagnosis"]
