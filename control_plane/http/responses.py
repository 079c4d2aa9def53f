"""Response bodies and server-sent-event chunks in OpenAI's shapes (completions and chat).

Objects: ``text_completion`` / ``chat.completion`` bodies, ``text_completion`` /
``chat.completion.chunk`` chunks for streaming, each framed as ``data: <json>\\n\\n``, and a
final ``data: [DONE]\\n\\n``. Legacy completions log-probs are ``{tokens, token_logprobs,
top_logprobs, text_offset}``; chat log-probs are ``{content: [{token, logprob, bytes,
top_logprobs}]}``. The order of chunks in a stream is `streaming.CompletionStream`'s.

Log-probs are always finite JSON numbers (`json_logprob`): a worker reports NaN / -inf when
the logits were NaN or a token had probability 0 (e.g. an adapter at scale 1e30), and JSON has
no such numbers (Python's ``json`` would write bare ``NaN`` / ``-Infinity``, and starlette's
``JSONResponse`` refuses them with a 500). As vLLM's OpenAI server
(``max(logprob, -9999.0)`` in ``serving_completion`` / ``serving_chat``), -inf and anything
below become ``-9999.0``; NaN also becomes ``-9999.0`` (vLLM's ``max`` lets NaN through);
+inf becomes ``0.0`` (a log-prob is at most 0). The gRPC API keeps the worker's raw floats.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from control_plane.http.generation import Outcome, TokenOut

TokenText = Callable[[int], str]


LOGPROB_FLOOR = -9999.0
"""The smallest log-prob an HTTP response carries (vLLM's OpenAI server: ``max(logprob, -9999.0)``)."""


def json_logprob(logprob: float) -> float:
    """``logprob`` as a finite JSON number: NaN and anything below `LOGPROB_FLOOR` (-inf
    included) → ``-9999.0``, +inf → ``0.0``; finite values at or above the floor unchanged."""
    if math.isnan(logprob):
        return LOGPROB_FLOOR
    if math.isinf(logprob) and logprob > 0:
        return 0.0
    return max(logprob, LOGPROB_FLOOR)


def token_text_of(tokenizer: Any) -> TokenText:
    """Token id → the text log-probs show for it: its bytes decoded as UTF-8 (invalid bytes
    replaced), else its piece; always ``""`` when ``tokenizer`` is None."""

    def token_text(token_id: int) -> str:
        if tokenizer is None:
            return ""
        raw = tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace") if raw else tokenizer.token_to_piece(token_id)

    return token_text


def sse(obj: Any) -> str:
    """One server-sent event: ``data: <obj as JSON, non-ASCII kept>\\n\\n``.

    Raises:
        ValueError: ``obj`` holds NaN or ±inf (never valid JSON; log-probs are made finite
            before, `json_logprob`).
    """
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def completion_logprobs(tokens: list[TokenOut], token_text: TokenText, n_top: int, offset: int = 0) -> dict[str, Any]:
    """Legacy completions ``logprobs`` for ``tokens``: ``top_logprobs`` holds the ``n_top`` most
    likely alternatives (``n_top`` 0: the chosen token alone); ``text_offset`` counts
    characters from ``offset`` (text before the first of ``tokens``). Log-probs pass through
    `json_logprob`."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        text = token_text(t.token_id)
        out["tokens"].append(text)
        logprob = json_logprob(t.logprob)
        out["token_logprobs"].append(logprob)
        top = {token_text(i): json_logprob(lp) for i, lp in t.top[:n_top]} if n_top else {text: logprob}
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(t.text)
    return out


def chat_logprobs(tokens: list[TokenOut], token_text: TokenText, n_top: int) -> dict[str, Any]:
    """Chat ``logprobs`` for ``tokens``: one ``content`` entry per token (text, log-prob,
    UTF-8 bytes) with its ``n_top`` most likely alternatives. Log-probs pass through
    `json_logprob`."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": json_logprob(logprob), "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top[:n_top]]} for t in tokens
        ]
    }


def completion_body(rid: str, created: int, model: str, out: Outcome, logprobs: dict[str, Any] | None) -> dict:
    """A whole ``text_completion`` (one choice, with ``usage``); ``created`` in Unix seconds."""
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
    """One streamed ``text_completion`` chunk: ``text`` and, on the last, ``finish_reason``."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def chat_body(rid: str, created: int, model: str, out: Outcome, logprobs: dict[str, Any] | None) -> dict:
    """A whole ``chat.completion`` (one assistant message, with ``usage``)."""
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
    """One ``chat.completion.chunk``: ``delta`` (role and/or content, or ``{}``) and, on the
    last, ``finish_reason``."""
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def usage_chunk(rid: str, created: int, model: str, obj: str, out: Outcome) -> dict:
    """The ``stream_options.include_usage`` chunk: ``object`` = ``obj``, no choices, ``usage``."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": out.usage()}


def prompt_logprobs(
    entries: list[tuple[int, float, int | None] | None],
    token_text: TokenText,
    top: list[list[tuple[int, float]] | None] | None = None,
) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: one entry per prompt token, None for the first (it has no
    prefix), else ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` holding the prompt
    token and, with ``top`` (``prompt_logprobs: N``), the N most likely tokens at its position
    (ranked 1..N; the prompt token keeps its own rank when it is among them). ``rank`` is 1 + the
    number of tokens more likely (None from a worker that does not rank). Log-probs pass through
    `json_logprob`."""
    out: list[dict[str, Any] | None] = []
    for i, e in enumerate(entries):
        if e is None:
            out.append(None)
            continue
        entry = {str(e[0]): {"logprob": json_logprob(e[1]), "rank": e[2], "decoded_token": token_text(e[0])}}
        for rank, (tid, lp) in enumerate((top[i] or []) if top is not None else [], start=1):
            entry.setdefault(str(tid), {"logprob": json_logprob(lp), "rank": rank, "decoded_token": token_text(tid)})
        out.append(entry)
    return out


def echo_logprobs(out: Outcome, token_text: TokenText, n_top: int) -> dict[str, Any]:
    """Legacy completions ``logprobs`` of the prompt tokens for ``echo`` (OpenAI's shape, as
    vLLM answers it): each prompt token's text, its log-prob given its prefix (None for the
    first, which has none) and its position's ``n_top`` most likely tokens (``n_top`` 0: the
    prompt token alone; None for the first); ``text_offset`` counts characters from 0.

    Args:
        out: the request's outcome, with ``prompt_logprobs`` (and ``prompt_top`` when
            ``n_top`` > 0).
        token_text: token id → its text.
        n_top: alternatives per position.
    """
    lp: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    for i, tid in enumerate(out.prompt_token_ids):
        text = token_text(tid)
        e = entries[i] if i < len(entries) else None
        lp["tokens"].append(text)
        lp["text_offset"].append(offset)
        offset += len(text)
        if e is None:
            lp["token_logprobs"].append(None)
            lp["top_logprobs"].append(None)
            continue
        value = json_logprob(e[1])
        lp["token_logprobs"].append(value)
        alts = (out.prompt_top[i] or []) if out.prompt_top is not None and i < len(out.prompt_top) else []
        top = {token_text(t): json_logprob(v) for t, v in alts[:n_top]} if n_top else {text: value}
        lp["top_logprobs"].append(top)
    return lp
