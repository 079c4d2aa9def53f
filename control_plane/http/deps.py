"""`HttpDeps`: the objects the HTTP routes work on, the same ones the gRPC servicer holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from control_plane.http.chat_template import ChatTemplate
from control_plane.registry import AdapterRegistry
from control_plane.router import Router
from control_plane.workers import WorkerPool


@dataclass
class HttpDeps:
    """What the routes use; the same objects the gRPC servicer holds.

    Attributes:
        registry: adapter records (``model`` resolution, load/unload).
        router: runs generation requests (``Router.generate``).
        pool: the workers (unloading an adapter everywhere).
        base_name: the served base-model name (``model`` = it → no adapters).
        base_root: shown as the base model's ``root`` in ``/v1/models`` (its file path).
        tokenizer: the base tokenizer (chat prompts, log-prob token texts); None when the
            base model has none.
        chat_template: None → chat requests get a 400.
        admin_token: None → admin routes are open.
        metrics_text: the control plane's ``/metrics`` exposition (bytes, content type);
            None → ``/metrics`` is a 404.
        write_timeout_s: seconds one response write may wait for a client that reads
            nothing before the client counts as gone (`streaming.RelayResponse`).
    """

    registry: AdapterRegistry
    router: Router
    pool: WorkerPool
    base_name: str
    base_root: str
    tokenizer: Any
    chat_template: ChatTemplate | None
    admin_token: str | None
    metrics_text: Callable[[], tuple[bytes, str]] | None = None
    write_timeout_s: float = 30.0
