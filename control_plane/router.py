"""Routing a Generate call to a worker and relaying its event stream.

`Router.generate`, one request top to bottom: assign a request id when the client sent none;
check its structured-output format (`check_response_format`); resolve its adapters (an
`AdapterScales`) against the default set as of now; resolve the tenant and admit it against its quotas
(`control_plane.quotas`); pick a live worker that is not full (warm prefix cache first, then the
one holding most of the request's adapters); announce the adapters it lacks; open its ``Decode``
stream, submit with the tenant, and relay every event until ``finished``. A worker that fails
before the first event is marked failed and the next is tried; errors about the request itself
(`REQUEST_ERROR_CODES`) keep their status code.

The worker choice, cancellation and the in-flight count, dead workers mid-relay:
docs/architecture.md, "Routing".
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections import OrderedDict
from collections.abc import Generator, Iterator, Sequence
from contextlib import closing
from typing import Any, Protocol

import grpc
import structlog

from control_plane.convert import request_map_or_none, set_resolved_adapters
from control_plane.errors import (
    ControlPlaneError,
    DatabaseUnavailableError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from control_plane.grammar_check import GrammarChecker, TenantChecker
from control_plane.membership import WorkerPool
from control_plane.quotas import Admission, QuotaBook
from control_plane.registry import AdapterRegistry
from control_plane.tenants import (
    ADAPTER_TENANT_PREFIX,
    ANONYMOUS_TENANT,
    MAX_NAME_CHARS,
    ResolvedTenant,
    TenantDirectory,
)
from control_plane.workers import WorkerHandle
from loraplane.adapter_scales import AdapterScales
from loraplane.grammar_limits import GrammarError
from loraplane.queue_shares import Share
from loraplane.response_format import ResponseFormat
from loraplane.v1 import common_pb2, worker_pb2

log = structlog.get_logger("loraplane.control_plane.router")

# Status codes by which a worker tells us the *request* is wrong: relayed as they are. Any
# other code means the worker itself failed.
REQUEST_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)
# Worth another worker when nothing has been relayed yet.
RETRY_ELSEWHERE_CODES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})
AFFINITY_ENTRIES = 4096


class WorkerRequestError(ControlPlaneError):
    """The worker refused the request itself; ``code`` is the worker's status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ClientContext(Protocol):
    """What the router needs of a gRPC servicer context."""

    def add_callback(self, callback) -> bool: ...
    def is_active(self) -> bool: ...
    def time_remaining(self) -> float | None: ...


def _client_deadline(context: ClientContext) -> float | None:
    """Seconds left of the client's deadline, to bound the worker call; None without one
    (gRPC reports "no deadline" as an enormous remaining time)."""
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < 365 * 24 * 3600 else None


class _WorkerFailed(Exception):
    def __init__(self, worker: WorkerHandle, message: str, *, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.worker = worker
        self.code = code


class _Once:
    """``fn`` run at most once, whichever caller comes first (thread-safe)."""

    def __init__(self, fn) -> None:
        self._fn = fn
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()


def check_response_format(rf: common_pb2.ResponseFormat, grammar: TenantChecker) -> None:
    """Compile a request's structured-output format before any worker sees it, in one of
    ``grammar``'s child processes (its limits first; no vocabulary needed).

    Raises:
        InvalidArgumentError: the schema / regex / grammar is over a limit, does not compile,
            or crashed the grammar engine in the child (names the fault).
    """
    try:
        fmt = ResponseFormat.from_proto(rf)
        if fmt is not None:
            grammar.check(fmt)
    except GrammarError as exc:
        raise InvalidArgumentError(f"response_format: {exc}") from exc


class Router:
    """Picks workers for Generate calls and relays their streams."""

    def __init__(
        self,
        registry: AdapterRegistry,
        pool: WorkerPool,
        *,
        tenants: TenantDirectory | None = None,
        quotas: QuotaBook | None = None,
        grammar: GrammarChecker | None = None,
    ) -> None:
        self.registry = registry
        # every structured-output format is compiled here first, in child processes
        self.grammar = grammar or GrammarChecker()
        self.pool = pool
        self.tenants = tenants or TenantDirectory()  # no rows: every tenant unlimited
        self.quotas = quotas  # None: no quotas, no per-tenant counts
        self._affinity: OrderedDict[AdapterScales, str] = OrderedDict()
        self._lock = threading.Lock()
        # ``track(adapters, events, context) -> events`` (control_plane.metrics); None: not counted.
        self.observer: Any = None

    def generate(
        self, request: common_pb2.GenerateRequest, context: ClientContext, *, principal: str | None = None
    ) -> Iterator[common_pb2.GenerateEvent]:
        """Resolve, admit, route and relay one request (see the module docstring).

        Args:
            principal: the tenant the caller's API key names (`TenantDirectory.principal`);
                None: no key, or an unknown one.

        Raises:
            NotFoundError / InvalidArgumentError: the adapter map is wrong.
            QuotaExceededError: the tenant is over a quota (RESOURCE_EXHAUSTED, retry-after).
            UnavailableError: no live worker, or the worker failed mid-stream.
            ResourceExhaustedError: every live worker is at slots + queue limit.
            WorkerRequestError: the worker refused the request (its code is kept).
        """
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        if request.sampling.HasField("response_format"):
            check_response_format(request.sampling.response_format, self.grammar.for_tenant(principal))
        asked = request_map_or_none(request, lambda name: self.registry.names.lookup(name))
        adapters = self.registry.resolve(asked)
        tenant = self.tenants.resolve(
            principal, None if principal or not asked else self._adapter_name(next(iter(asked)))
        )
        set_resolved_adapters(request, adapters)
        admission = None
        if self.quotas is not None:
            admission = self.quotas.admit(
                tenant,
                max_tokens=request.sampling.max_tokens,
                prompt_tokens=lambda: self.prompt_tokens(request),
                context_tokens=self.pool.max_n_ctx,
            )
        routed = self._route(request, context, adapters, tenant)
        if admission is not None:
            routed = settled(admission, routed, context)
        yield from (routed if self.observer is None else self.observer.track(adapters, routed, context))

    def _adapter_name(self, adapter_id: int) -> str:
        """An adapter's name for its tenant (``adapter:<name>``): its name, else its id (also
        when the store cannot say, or when the name would make a tenant name longer than
        `MAX_NAME_CHARS`: adapter names may hold 256 bytes, tenant names 128 characters)."""
        try:
            name = self.registry.get(adapter_id).name
        except ControlPlaneError:
            return str(adapter_id)
        if not name or len(ADAPTER_TENANT_PREFIX) + len(name) > MAX_NAME_CHARS:
            return str(adapter_id)
        return name

    def prompt_tokens(self, request: common_pb2.GenerateRequest) -> int:
        """The request's prompt length in tokens: token ids as sent; a text prompt tokenized
        with the base tokenizer as the worker does (BOS as the model says, special tokens
        parsed); without a tokenizer, its UTF-8 byte count (an upper bound the settling
        corrects)."""
        if request.WhichOneof("prompt") == "tokens":
            return len(request.tokens.ids)
        tok = self.registry.base.tokenizer()
        if tok is None:
            return len(request.text.encode("utf-8", "surrogatepass"))
        return len(tok.encode(request.text, add_special=True, parse_special=True))

    def _route(
        self,
        request: common_pb2.GenerateRequest,
        context: ClientContext,
        adapters: AdapterScales,
        tenant: ResolvedTenant,
    ) -> Iterator[common_pb2.GenerateEvent]:
        """Steps 3-5 of the module docstring for a resolved request."""
        ids = list(adapters.ids)
        tried: list[str] = []
        last_error = ""
        while True:
            worker = self._pick(adapters, exclude=tried, last_error=last_error, ids=ids, tenant=tenant)
            tried.append(worker.worker_id)
            try:
                self.pool.adapters.ensure_loaded(worker, ids)
            except DatabaseUnavailableError:
                raise  # not this worker's fault: trying the others would fail the same way
            except UnavailableError as exc:
                last_error = str(exc)
                log.warning("worker_skipped", worker_id=worker.worker_id, error=last_error)
                continue
            log.info("request_routed", worker_id=worker.worker_id, adapters=list(adapters))
            relayed = False
            relay = self._relay(worker, request, context, tenant)
            try:
                with closing(relay):  # a client that goes away closes us; close the relay now
                    for event in relay:
                        relayed = True
                        yield event
                return
            except _WorkerFailed as failure:
                last_error = str(failure)
                busy = failure.code in RETRY_ELSEWHERE_CODES
                if not busy:
                    self.pool.mark_failed(worker.worker_id, last_error)
                if relayed:
                    raise UnavailableError(last_error) from None
                if busy and not self._others(tried):
                    raise WorkerRequestError(failure.code, last_error) from None
                log.warning("worker_failed_retrying", worker_id=worker.worker_id, error=last_error)

    def _others(self, tried: list[str]) -> bool:
        return any(w.worker_id not in tried for w in self.pool.live())

    def _pick(
        self,
        key: AdapterScales,
        *,
        exclude: list[str],
        last_error: str,
        ids: Sequence[int] = (),
        tenant: ResolvedTenant | None = None,
    ) -> WorkerHandle:
        """The worker for the next attempt among live workers not yet tried that can still
        admit a request of ``tenant`` (in flight < slots + queue limit, or, full, another
        tenant there gives way to it: `WorkerPool.has_room`): not full (in flight < slots),
        then set affinity, then the most of ``ids`` resident in its slots, then on its host
        (as its heartbeats report), then least loaded.

        Raises:
            UnavailableError: no live worker (left to try).
            ResourceExhaustedError: live workers exist but every one is full.
        """
        candidates = [w for w in self.pool.live() if w.worker_id not in exclude]
        if not candidates:
            detail = f" (tried {exclude}; last error: {last_error})" if exclude else ""
            raise UnavailableError(f"no live worker to serve the request{detail}")
        share = _share(tenant or ResolvedTenant(ANONYMOUS_TENANT))
        live = [w for w in candidates if self.pool.has_room(w, share)]
        if not live:
            full = ", ".join(f"{w.worker_id} {w.in_flight}/{w.capacity}" for w in candidates)
            raise ResourceExhaustedError(f"every live worker is full (in flight/slots+queue: {full}); retry later")
        with self._lock:
            preferred = self._affinity.get(key)

        def cost(w: WorkerHandle) -> tuple:
            full = w.in_flight >= max(1, w.n_slots)
            if w.worker_id == preferred:
                return (full, 0, 0, 0, w.in_flight, w.worker_id)
            not_resident = sum(1 for i in ids if i not in w.resident_ids)
            not_on_host = sum(1 for i in ids if i not in w.resident_ids and i not in w.host_ids)
            return (full, 1, not_resident, not_on_host, w.in_flight, w.worker_id)

        chosen = min(live, key=cost)
        with self._lock:
            self._affinity[key] = chosen.worker_id
            self._affinity.move_to_end(key)
            while len(self._affinity) > AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)
        return chosen

    def _relay(
        self,
        worker: WorkerHandle,
        request: common_pb2.GenerateRequest,
        context: ClientContext,
        tenant: ResolvedTenant,
    ) -> Generator[common_pb2.GenerateEvent, None, None]:
        # The request side stays open until we are done: a worker may read a half-close as
        # "the caller is gone" and free the slot.
        outbox: queue.Queue[worker_pb2.DecodeRequest | None] = queue.Queue()
        who = worker_pb2.RequestTenant(name=tenant.name, weight=tenant.weight, priority=tenant.priority)
        outbox.put(worker_pb2.DecodeRequest(submit=request, tenant=who))
        client_deadline = _client_deadline(context)
        call = worker.stub.Decode(iter(outbox.get, None), timeout=client_deadline)
        declared_dead: list[str] = []  # why the pool declared the worker dead, set before the cancel
        token: int | None = None
        release = _Once(lambda: self.pool.end(worker, token))

        def worker_dead(reason: str) -> None:
            # The pool's watchdog (or whoever noticed) declared the worker dead: no heartbeat
            # (a stopped or hung process) or a failed call. The relay may be blocked reading a
            # stream that never ends: cut it and give the capacity back now; the read then
            # raises CANCELLED, answered below with the reason.
            declared_dead.append(reason)
            call.cancel()
            release()

        token = self.pool.begin(worker, worker_dead, tenant=_share(tenant))

        def client_gone() -> None:
            # Runs on the thread that noticed (gRPC's callback, the HTTP front's disconnect
            # watcher), possibly while this generator is suspended or blocked: the worker call
            # and the in-flight count are both released here, not when the generator is
            # next resumed or collected.
            call.cancel()
            release()

        if not context.add_callback(client_gone):
            client_gone()  # the client left before the call was made
        try:
            for event in call:
                yield event
                if event.HasField("finished"):
                    return
        except grpc.RpcError as exc:
            if not context.is_active():
                return  # the client cancelled; call.cancel already ran
            if declared_dead:
                raise _WorkerFailed(
                    worker,
                    f"worker {worker.worker_id} declared dead ({declared_dead[0]}) while relaying request "
                    f"{request.request_id}",
                    code=grpc.StatusCode.UNAVAILABLE,
                ) from None
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and client_deadline is not None:
                # The worker call carries the client's own deadline: its expiry is the client's
                # doing (the server context may not be inactive yet), never the worker's fault.
                # Marking the worker failed here let any client with a 1 ms deadline take every
                # worker out of routing until its next heartbeat.
                raise WorkerRequestError(code, f"deadline exceeded (the client's, {client_deadline:.3f} s)") from None
            message = f"worker {worker.worker_id} failed: {code.name}: {exc.details()}"
            if code in REQUEST_ERROR_CODES and code not in RETRY_ELSEWHERE_CODES:
                raise WorkerRequestError(code, f"worker {worker.worker_id}: {exc.details()}") from None
            raise _WorkerFailed(worker, message, code=code) from None
        finally:
            outbox.put(None)
            call.cancel()  # no-op once the worker closed the call; frees it otherwise
            release()
        if context.is_active():
            raise _WorkerFailed(
                worker,
                f"worker {worker.worker_id} failed: its stream ended before request {request.request_id} finished",
            )


def _share(tenant: ResolvedTenant) -> Share:
    """A request's tenant as the workers' queue shares count it (one request, its weight and
    priority)."""
    return Share(1, tenant.weight, tenant.priority, tenant.name)


def settled(
    admission: Admission, events: Iterator[common_pb2.GenerateEvent], context: ClientContext
) -> Iterator[common_pb2.GenerateEvent]:
    """Relay ``events`` unchanged and settle ``admission`` once with the tokens they carried
    (prompt: the worker's ``started`` / finished telemetry; output: one per ``token`` event),
    when they end or the client goes away, whichever comes first. The end of the events
    settles on the relaying thread, before the call ends (so the tenant's next request finds
    its claim released); the client going away settles without blocking the thread that
    noticed (gRPC's callback, the HTTP front's event loop): the store write goes to the
    quota sync thread."""
    counts = [0, 0]  # prompt, output

    def settle(wait: bool = True) -> None:
        admission.settle(counts[0], counts[1], wait=wait)

    if not context.add_callback(lambda: settle(wait=False)):
        settle()
    try:
        for ev in events:
            kind = ev.WhichOneof("event")
            if kind == "started":
                counts[0] = len(ev.started.prompt_token_ids)
            elif kind == "token":
                counts[1] += 1
            elif kind == "finished":
                counts[0] = ev.finished.telemetry.prompt_tokens or counts[0]
            yield ev
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()
        settle()
