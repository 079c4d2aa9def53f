"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes), on the control plane's base
tokenizer.

The control plane already holds the base model's tokenizer (``HttpDeps.tokenizer``: the same
``loraplane.formats.tokenizer.Tokenizer`` built from the same GGUF as every worker's; chat prompts
are tokenized with it today), and all workers of one base model share its vocabulary, adapters
included. So these routes answer locally: no worker RPC, no worker needed, and the ids are
the ones a worker computes (tests compare them with a worker's ``prompt_token_ids``).

  * ``/tokenize`` ``{model?, prompt, add_special_tokens = true}`` or ``{model?, messages,
    add_generation_prompt = true, add_special_tokens = false}`` (the chat template is applied
    as ``/v1/chat/completions`` applies it) → ``{count, max_model_len, tokens}`` (plus
    ``token_strs`` when ``return_token_strs``). ``add_special_tokens`` adds BOS as the model
    says (what a worker does to a completions text prompt).
  * ``/detokenize`` ``{model?, tokens}`` → ``{prompt}``: special tokens spelled out (vLLM
    decodes with ``skip_special_tokens=False``), so tokenizing the text again with
    ``add_special_tokens: false`` gives the same ids.

``model``, when given, must name a served model (404 otherwise, as the generation routes).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from control_plane.http.completions import (
    chat_prompt_ids,
    chat_template_of,
    check_prompt_bytes,
    text_bytes,
    tokenizer_of,
)
from control_plane.http.deps import HttpDeps
from control_plane.http.errors import OpenAIError
from control_plane.http.models import resolve_model
from control_plane.http.schemas import MAX_PROMPT_ITEMS, ChatMessage, HttpBody, parse_body


class TokenizeRequest(HttpBody):
    """vLLM's ``TokenizeCompletionRequest`` / ``TokenizeChatRequest``: ``prompt`` or
    ``messages`` (exactly one)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(HttpBody):
    """vLLM's ``DetokenizeRequest``."""

    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_PROMPT_ITEMS)


def _check_model(deps: HttpDeps, model: str | None) -> None:
    """A given ``model`` must name a served model (`models.resolve_model`'s 404 / 400)."""
    if model is not None:
        resolve_model(model, base_name=deps.base_name, registry=deps.registry)


def tokenize(deps: HttpDeps, body: TokenizeRequest) -> dict[str, Any]:
    """The ``/tokenize`` answer (module docstring).

    Raises:
        OpenAIError: 400 neither or both of ``prompt`` / ``messages``, a prompt over the byte
            limit, no tokenizer or chat template; 404 unknown ``model``.
    """
    _check_model(deps, body.model)
    tok = tokenizer_of(deps)
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
    if body.messages is not None:
        chat = _ChatView(body.messages, body.add_generation_prompt, bool(body.add_special_tokens))
        ids = chat_prompt_ids(chat, chat_template_of(deps), tok, max_prompt_bytes=deps.prompt_max_bytes())  # type: ignore[arg-type]  # duck-typed chat body
    else:
        limit = deps.prompt_max_bytes()
        text = body.prompt or ""
        check_prompt_bytes(text_bytes(text, limit), limit=limit, param="prompt", what="'prompt'")
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = tok.encode(text, add_special=add, parse_special=True)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": deps.prompt_n_ctx(), "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [tok.token_to_piece(i) for i in ids]
    return out


class _ChatView:
    """What `completions.chat_prompt_ids` reads of a chat body."""

    def __init__(self, messages: list[ChatMessage], add_generation_prompt: bool, add_special_tokens: bool):
        self.messages = messages
        self.add_generation_prompt = add_generation_prompt
        self.add_special_tokens = add_special_tokens


def detokenize(deps: HttpDeps, body: DetokenizeRequest) -> dict[str, Any]:
    """The ``/detokenize`` answer: ``{"prompt": text}`` (module docstring).

    Raises:
        OpenAIError: 400 a token id outside ``[0, n_vocab)`` (``param="tokens"``), no
            tokenizer; 404 unknown ``model``.
    """
    _check_model(deps, body.model)
    tok = tokenizer_of(deps)
    n_vocab = int(tok.n_vocab)
    for i, t in enumerate(body.tokens):
        if not 0 <= t < n_vocab:
            raise OpenAIError(
                400,
                f"tokens[{i}]: token id {t} is out of range [0, {n_vocab})",
                param="tokens",
                code="invalid_token_id",
            )
    return {"prompt": tok.decode(body.tokens, skip_special=False)}


def tokenize_router(deps: HttpDeps) -> APIRouter:
    """``POST /tokenize`` and ``POST /detokenize``; bodies parsed on a worker thread, as the
    generation routes do (`schemas.parse_body`)."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize_route(request: Request) -> dict[str, Any]:
        raw = await request.body()
        return await run_in_threadpool(lambda: tokenize(deps, parse_body(raw, TokenizeRequest)))

    @router.post("/detokenize")
    async def detokenize_route(request: Request) -> dict[str, Any]:
        raw = await request.body()
        return await run_in_threadpool(lambda: detokenize(deps, parse_body(raw, DetokenizeRequest)))

    return router
