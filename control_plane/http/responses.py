"""Response bodies and server-sent-event chunks in OpenAI's shapes (completions and chat).

Shapes follow the OpenAI API reference (and vLLM's ``protocol.py``): ``text_completion`` /
``chat.completion`` objects, ``…chunk`` objects for streaming, each ``data: <json>\\n\\n`` and
a final ``data: [DONE]\\n\\n``. Legacy completions log-probs are ``{tokens, token_logprobs,
top_logprobs, text_offset}``; chat log-probs are ``{content: [{token, logprob, bytes,
top_logprobs}]}``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from control_plane.http.generation import Outcome, TokenOut

TokenText = Callable[[int], str]


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def completion_logprobs(tokens: list[TokenOut], token_text: TokenText, n_top: int, offset: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        text = token_text(t.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(t.logprob)
        top = {token_text(i): lp for i, lp in t.top[:n_top]} if n_top else {text: t.logprob}
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(t.text)
    return out


def chat_logprobs(tokens: list[TokenOut], token_text: TokenText, n_top: int) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top[:n_top]]} for t in tokens
        ]
    }


def completion_body(rid: str, created: int, model: str, out: Outcome, logprobs: dict[str, Any] | None) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason}],
        "usage": out.usage(),
    }


def completion_chunk(
    rid: str, created: int, model: str, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def chat_body(rid: str, created: int, model: str, out: Outcome, logprobs: dict[str, Any] | None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": logprobs,
                "finish_reason": out.finish_reason,
            }
        ],
        "usage": out.usage(),
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def usage_chunk(rid: str, created: int, model: str, obj: str, out: Outcome) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": out.usage()}
