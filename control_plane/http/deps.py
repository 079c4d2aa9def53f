"""`HttpDeps`: the objects the HTTP routes work on, the same ones the gRPC servicer holds, and
the HTTP front's input limits (`prompt_byte_limit`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from control_plane.announcer import AdapterAnnouncer
from control_plane.http.chat_template import ChatTemplate
from control_plane.registry import AdapterRegistry
from control_plane.router import Router
from control_plane.tenant_admin import TenantAdmin
from control_plane.tenants import TenantDirectory
from loraplane.limits import HTTP_MAX_BODY_BYTES

DEFAULT_MAX_BODY_BYTES = HTTP_MAX_BODY_BYTES
DEFAULT_N_CTX_TRAIN = 32768
"""Context assumed when the GGUF has no ``<arch>.context_length`` key."""


def max_piece_bytes(tokenizer: Any) -> int:
    """An upper bound on the input bytes one token can cover: the longest vocab piece's text in
    UTF-8 bytes (the worker's ``worker.serving.engine.max_piece_bytes`` measures the rendered
    piece, which is never longer; Gemma 3: 48 both ways). Reads the vocab's texts when the
    tokenizer exposes them (20 ms for 262k pieces), else renders every piece."""
    pieces = getattr(tokenizer, "_pieces", None)
    if isinstance(pieces, list) and pieces:
        return max(1, max(len(str(p).encode("utf-8", "surrogatepass")) for p in pieces))
    n_vocab = int(getattr(tokenizer, "n_vocab", 0))
    sizes = (len(tokenizer.token_to_piece(i).encode("utf-8", "surrogatepass")) for i in range(n_vocab))
    return max(1, max(sizes, default=1))


def prompt_byte_limit(tokenizer: Any, n_ctx: int) -> int:
    """The gRPC path's rule (``worker.serving.engine.prompt_byte_limit``) for a context of
    ``n_ctx`` tokens: a text longer than ``(n_ctx - 1) × max_piece_bytes`` UTF-8 bytes needs at
    least ``n_ctx`` tokens, which no worker with that context accepts, so refusing it before
    tokenizing changes no answer, only the cost. The HTTP front uses the model's training
    context (``<arch>.context_length``): workers started with a longer ``--n-ctx`` than the
    model was trained for are the only ones it could refuse early."""
    return max(1, (int(n_ctx) - 1) * max_piece_bytes(tokenizer))


def n_ctx_train(metadata: dict[str, Any], arch: str) -> int:
    """The model's training context from the GGUF (``<arch>.context_length``), else
    `DEFAULT_N_CTX_TRAIN`."""
    value = metadata.get(f"{arch}.context_length")
    return int(value) if isinstance(value, int) and value > 0 else DEFAULT_N_CTX_TRAIN


@dataclass
class HttpDeps:
    """What the routes use; the same objects the gRPC servicer holds.

    Attributes:
        registry: adapter records (``model`` resolution, load/unload).
        router: runs generation requests (``Router.generate``).
        announcer: the workers' adapters (unloading an adapter everywhere).
        base_name: the served base-model name (``model`` = it → no adapters).
        base_root: shown as the base model's ``root`` in ``/v1/models`` (its file path).
        tokenizer: the base tokenizer (chat prompts, log-prob token texts); None when the
            base model has none.
        chat_template: None → chat requests get a 400.
        admin_token: None → admin routes are open.
        api_key: the inference API key every route but ``/health`` and ``/metrics`` needs (the
            admin token passes too; `api_key.ApiKeyAuth`); None → open.
        metrics_text: the control plane's ``/metrics`` exposition (bytes, content type);
            None → ``/metrics`` is a 404.
        write_timeout_s: seconds one response write may wait for a client that reads
            nothing before the client counts as gone (`streaming.RelayResponse`).
        max_body_bytes: larger request bodies get 413 before they are read
            (``--http-max-body-bytes``).
        max_prompt_bytes: a completions text prompt, or a chat conversation's content, longer
            than this many UTF-8 bytes gets 400 before any template or tokenizer runs
            (`prompt_byte_limit`, or ``--http-max-prompt-bytes``); None: only the body limit.
        tenants: keys → tenants (`control_plane.tenants.TenantDirectory`): the
            tenant of each request, and tenant keys accepted by the API-key check; None: none.
        tenant_admin: serves ``/v1/tenants`` (None: those routes answer 503).
        n_ctx: prompts of this many tokens or more get 400 before routing (the model's
            training context, `n_ctx_train`); None: the worker decides. Used until a live
            worker reports its own (`prompt_n_ctx`).
        live_n_ctx: the largest ``n_ctx`` live workers report (``WorkerPool.max_n_ctx``);
            None: not followed.
        max_piece: the longest vocab piece in bytes (`max_piece_bytes`): set, the prompt byte
            limit follows `prompt_n_ctx`; None: ``max_prompt_bytes`` is fixed (the operator's
            ``--http-max-prompt-bytes``, or no tokenizer).
    """

    registry: AdapterRegistry
    router: Router
    announcer: AdapterAnnouncer
    base_name: str
    base_root: str
    tokenizer: Any
    chat_template: ChatTemplate | None
    admin_token: str | None
    metrics_text: Callable[[], tuple[bytes, str]] | None = None
    write_timeout_s: float = 30.0
    live_n_ctx: Callable[[], int | None] | None = None
    max_piece: int | None = None

    def prompt_n_ctx(self) -> int | None:
        """The context prompts are sized for now: the largest live worker's ``n_ctx`` (workers
        report theirs in every hello), else the start-up value `n_ctx`."""
        live = self.live_n_ctx() if self.live_n_ctx is not None else None
        return live or self.n_ctx

    def prompt_max_bytes(self) -> int | None:
        """The prompt byte limit now: `prompt_byte_limit`'s rule for `prompt_n_ctx` when the
        limit follows the workers (``max_piece`` set), else the fixed `max_prompt_bytes`."""
        n_ctx = self.prompt_n_ctx()
        if self.max_piece is None or n_ctx is None:
            return self.max_prompt_bytes
        return max(1, (int(n_ctx) - 1) * self.max_piece)

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: str | None = None
    max_prompt_bytes: int | None = None
    n_ctx: int | None = None
    tenants: TenantDirectory | None = None
    tenant_admin: TenantAdmin | None = None

    def principal(self, authorization: str | None) -> str | None:
        """The tenant a request's ``Authorization`` names (`TenantDirectory.principal`); None
        without a directory, a key, or with an unknown key."""
        return self.tenants.principal(authorization) if self.tenants is not None else None
