"""In-process stand-ins for the HTTP front's dependencies, and a tiny ASGI driver.

No model, no worker, no sockets: `FakeRouter` replays scripted ``GenerateEvent`` lists (or
raises), `FakeRegistry` holds a few adapter records, `FakeAnnouncer` notes the ids it is asked
to unload, `FakeTokenizer` maps token id ``i`` to the text ``<i>``, and `call_app` sends one
request through a FastAPI app and collects its status, headers and body bytes exactly as a
client would receive them. `Front` is the HTTP app over those fakes; `endless_stream` a
`CompletionStream` of a generation that never ends by itself.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from control_plane.errors import ControlPlaneError, NotFoundError
from control_plane.grammar_check import InlineChecker
from control_plane.http.app import HttpDeps, create_app
from control_plane.http.chat_template import load_chat_template
from control_plane.http.responses import token_text_of
from control_plane.http.streaming import CompletionStream
from loraplane.v1 import common_pb2

# ---- GenerateEvent builders -------------------------------------------------------------------


def started(*prompt_ids: int) -> common_pb2.GenerateEvent:
    return common_pb2.GenerateEvent(started=common_pb2.Started(prompt_token_ids=list(prompt_ids)))


def token(token_id: int, text: str, logprob: float = -0.5, top: Iterable[tuple[int, float]] = ()):
    return common_pb2.GenerateEvent(
        token=common_pb2.GeneratedToken(
            token_id=token_id,
            text=text,
            logprob=logprob,
            top=[common_pb2.TokenLogprob(token_id=i, logprob=lp) for i, lp in top],
        )
    )


def finished(text: str, reason: str = "length", cached: int = 0) -> common_pb2.GenerateEvent:
    return common_pb2.GenerateEvent(
        finished=common_pb2.Finished(
            finish_reason=reason, text=text, telemetry=common_pb2.RequestTelemetry(cached_prompt_tokens=cached)
        )
    )


def scripted(*items: common_pb2.GenerateEvent | BaseException) -> Iterator[common_pb2.GenerateEvent]:
    """Yields the events in order; an exception in the list is raised at that point."""
    for item in items:
        if isinstance(item, BaseException):
            raise item
        yield item


# ---- dependencies -------------------------------------------------------------------------------


class FakeTokenizer:
    """Token id ``i`` reads ``<i>``; ``encode`` gives one id per character."""

    def token_bytes(self, token_id: int) -> bytes:
        return f"<{token_id}>".encode()

    def token_to_piece(self, token_id: int) -> str:
        return f"<{token_id}>"

    def encode(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


@dataclass
class FakeRecord:
    id: int
    name: str
    created_at: float = 1700000000.0
    source_format: str = "gguf"
    aliases: tuple[str, ...] = ()
    path: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        return ((self.name,) if self.name else ()) + self.aliases


@dataclass
class FakeRegistration:
    record: FakeRecord
    aliased: bool = False
    named: bool = False  # this call attached the requested name (registry.Registration)


@dataclass
class FakeNameRemoval:
    record: FakeRecord
    unregistered: bool


@dataclass
class FakeRegistry:
    records: list[FakeRecord] = field(default_factory=list)

    def list(self) -> list[FakeRecord]:
        return list(self.records)

    def register_server_path(self, path: str, *, name: str) -> FakeRegistration:
        if path.startswith("/missing"):
            raise NotFoundError(f"no adapter at {path}")
        rec = FakeRecord(id=max((r.id for r in self.records), default=-1) + 1, name=name)
        self.records.append(rec)
        return FakeRegistration(rec, named=bool(name))

    def unregister(self, adapter_id: int) -> FakeRecord:
        found = [r for r in self.records if r.id == adapter_id]
        if not found:
            raise NotFoundError(f"adapter {adapter_id} is not registered")
        self.records = [r for r in self.records if r.id != adapter_id]
        return found[0]

    @property
    def names(self) -> FakeNames:
        return FakeNames(self.records)

    def unload_name(self, token: str) -> FakeNameRemoval:
        """The whole adapter goes (the real registry's alias rules are tested live)."""
        return FakeNameRemoval(self.unregister(self.names.lookup(token)), unregistered=True)


@dataclass
class FakeNames:
    """`FakeRegistry`'s ``names``: lookups over its records (``control_plane.names.AdapterNames``)."""

    records: list[FakeRecord]

    def lookup(self, token: str) -> int:
        from control_plane.resolution import find_adapter

        return find_adapter(token, self.records)  # type: ignore[arg-type]

    def owners(self, name: str) -> list[int]:
        return [r.id for r in self.records if name in r.names]


@dataclass
class FakeAnnouncer:
    unloaded: list[int] = field(default_factory=list)

    def unload_adapter(self, adapter_id: int) -> None:
        self.unloaded.append(adapter_id)


class FakeRouter:
    """``generate`` replays ``script`` (events, or an exception raised where it stands) and
    records each request, the tenant its key named (``principals``) and whether the HTTP side
    cancelled the call."""

    def __init__(self) -> None:
        self.script: list[common_pb2.GenerateEvent | BaseException] = []
        self.requests: list[common_pb2.GenerateRequest] = []
        self.principals: list[str | None] = []
        self.cancelled = 0
        self.grammar = InlineChecker()  # formats compiled in the test process (the router's is a pool)

    def generate(
        self, request: common_pb2.GenerateRequest, context: Any, *, principal: str | None = None
    ) -> Iterator[common_pb2.GenerateEvent]:
        self.requests.append(request)
        self.principals.append(principal)
        context.add_callback(self._cancel)
        yield from scripted(*self.script)

    def _cancel(self) -> None:
        self.cancelled += 1


def worker_error(message: str = "worker went away") -> ControlPlaneError:
    from control_plane.errors import UnavailableError

    return UnavailableError(message)


# ---- in-process HTTP client ----------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def call_app(app: Any, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Reply:
    """One HTTP request through ``app`` in-process (FastAPI's ``TestClient``, httpx underneath):
    the reply as sent, a streamed body read to its end."""
    from fastapi.testclient import TestClient

    raw = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.request(method, path, content=raw, headers={"content-type": "application/json", **(headers or {})})
    return Reply(status=r.status_code, headers=dict(r.headers), body=r.content)


# ---- the HTTP app over the fakes -----------------------------------------------------------------

ADMIN_TOKEN = "s3cret"
"""The admin bearer token a `Front` is configured with by default."""
EVENTS = [started(5, 6), token(10, "Hi", -0.5), token(11, " there", -0.25), finished("Hi there.", "stop")]
"""A short generation: two prompt tokens, "Hi" and " there" streamed, finished "Hi there." (stop)."""


class Front:
    """An app over fakes, with the fakes at hand."""

    def __init__(
        self, *, admin_token: str | None = ADMIN_TOKEN, chat: bool = True, metrics: bool = True, template_text: str = ""
    ) -> None:
        records = [FakeRecord(0, "shout"), FakeRecord(1, "sea"), FakeRecord(2, "dup"), FakeRecord(3, "dup")]
        self.registry = FakeRegistry(records)
        self.router = FakeRouter()
        self.announcer = FakeAnnouncer()
        template = (
            load_chat_template(
                override_file=None,
                metadata={"tokenizer.chat_template": template_text} if template_text else {},
                arch="gemma3",
                bos_token="<bos>",
                eos_token="<eos>",
            )
            if chat
            else None
        )
        self.deps = HttpDeps(
            registry=self.registry,
            router=self.router,
            announcer=self.announcer,
            base_name="base",
            base_root="/models/base.gguf",
            tokenizer=FakeTokenizer() if chat else None,
            chat_template=template,
            admin_token=admin_token,
            metrics_text=(lambda: (b"up 1\n", "text/plain; version=0.0.4")) if metrics else None,
        )
        self.app = create_app(self.deps)

    def post(self, path: str, body, events=(), headers=None) -> Reply:
        """``call_app`` of ``POST path`` with ``body``; the router answers with ``events``."""
        self.router.script = list(events)
        return call_app(self.app, "POST", path, body, headers)


# ---- a generation that never ends ------------------------------------------------------------------

CREATED = 1700000000
"""The ``created`` time (Unix seconds) of the streams built here."""


def endless(
    consumed: list[int], released: threading.Event, *, first_token_after: threading.Event | None = None
) -> Iterator[common_pb2.GenerateEvent]:
    """Events of a generation that never ends by itself: it stops when ``released`` is set
    (what cancelling the worker call does to the router's relay). Appends each token's index to
    ``consumed`` as it is yielded (one per ms); with ``first_token_after``, waits for it first."""
    yield started(1)
    if first_token_after is not None:
        while not (first_token_after.is_set() or released.is_set()):
            time.sleep(0.005)
    for i in range(10_000):
        if released.is_set():
            return
        consumed.append(i)
        time.sleep(0.001)
        yield token(i, "x")


def endless_stream(consumed: list[int], released: threading.Event, **kw) -> CompletionStream:
    """A completion (not chat) `CompletionStream` over ``endless(consumed, released, **kw)``, whose
    cancel sets ``released``."""
    return CompletionStream(
        endless(consumed, released, **kw),
        cancel=released.set,
        request_id="cmpl-1",
        created=CREATED,
        model="m",
        chat=False,
        logprobs=None,
        token_text=token_text_of(None),
    )
