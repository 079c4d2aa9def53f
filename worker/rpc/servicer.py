"""gRPC layer of the worker: protos → engine calls → protos; exceptions → status codes once.

``Decode`` is a bidirectional stream: each ``submit`` is admitted as it arrives and the events
of every request on the stream come back interleaved, tagged with ``request_id``. A refused
request or a failed decode ends the stream with its status code (the control plane opens one
stream per request). Closing or cancelling the call cancels every request it submitted, so
their KV sequences are freed at the next step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import queue
import threading
import time

import grpc
import structlog

from loraplane.adapter_scales import AdapterScales, AdapterScalesError
from loraplane.grammar_limits import GrammarError
from loraplane.interceptors import UndecodableRequest
from loraplane.paths import MalformedPath, OutsideAdapterDirs, confine, resolve_dirs
from loraplane.response_format import ResponseFormat
from loraplane.v1 import common_pb2 as pb
from loraplane.v1 import worker_pb2, worker_pb2_grpc
from worker.errors import InvalidRequestError, PermissionDeniedError, WorkerError
from worker.lora.host_cache import KnownAdapter
from worker.rpc.status import status_of
from worker.runtime.sampling import SamplingParams
from worker.serving.engine import WorkerEngine, WorkerStatsRecord
from worker.serving.request import (
    ErrorEvent,
    Event,
    FinishedEvent,
    GenRequest,
    RequestTelemetry,
    RequestTenant,
    StartedEvent,
    StepInfo,
    TokenEvent,
)

log = structlog.get_logger("loraplane.worker.rpc.servicer")

_END_OF_INPUT = object()
_CALL_DONE = object()
_OPENED = object()  # (_OPENED, rid): rid submitted; its events are awaited
_CLOSED = object()  # (_CLOSED, rid): rid cancelled by cancel_request_id; no more events awaited


def sampling_from_proto(s: pb.SamplingParams) -> SamplingParams:
    """The worker's `SamplingParams` of the wire message (proto3 zeros mean the defaults:
    ``max_tokens`` 16, ``top_p`` 1, ``repetition_penalty`` 1); range checks are
    ``SamplingParams.validate``'s.

    Raises:
        InvalidRequestError: a ``response_format`` type this worker does not know.
    """
    try:
        fmt = ResponseFormat.from_proto(s.response_format) if s.HasField("response_format") else None
    except GrammarError as exc:
        raise InvalidRequestError(str(exc)) from exc
    return SamplingParams(
        max_tokens=s.max_tokens or 16,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p if 0.0 < s.top_p <= 1.0 else (1.0 if s.top_p == 0.0 else s.top_p),
        seed=s.seed if s.HasField("seed") else None,
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs,
        prompt_logprobs_top=s.prompt_logprobs_top,
        ignore_eos=s.ignore_eos,
        stop=tuple(s.stop),
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty or 1.0,
        response_format=fmt,
    )


MAX_TENANT_NAME = 256  # characters of a tenant name (the worker remembers thousands of them)


def tenant_from_proto(t: worker_pb2.RequestTenant | None) -> RequestTenant:
    """The request's tenant for fair admission: an empty name reads "anonymous", weight 0
    reads 1 (proto3 zeros: the control plane left them unset); None: "anonymous".

    Raises:
        InvalidRequestError: a negative or non-finite weight, or a name over
            ``MAX_TENANT_NAME`` characters.
    """
    if t is None:
        return RequestTenant()
    weight = t.weight or 1.0
    if not math.isfinite(weight) or weight < 0:
        raise InvalidRequestError(f"tenant {t.name!r}: weight {t.weight} must be a finite number > 0 (0 reads 1)")
    if len(t.name) > MAX_TENANT_NAME:
        raise InvalidRequestError(f"tenant name has {len(t.name)} characters; at most {MAX_TENANT_NAME}")
    return RequestTenant(name=t.name or "anonymous", weight=weight, priority=t.priority)


def adapter_info(adapter_id: int, a, default_scale: float = 0.0) -> pb.AdapterInfo:
    return pb.AdapterInfo(
        id=adapter_id,
        name=a.name,
        path=str(a.path),
        sha256=a.sha256,
        arch=a.arch,
        alpha=a.alpha,
        ranks=list(a.ranks),
        target_tensors=sorted(a.pairs),
        task_name=a.task_name,
        prompt_prefix=a.prompt_prefix,
        alora_invocation_tokens=list(a.alora_invocation_tokens),
        default_scale=default_scale,
        size_bytes=a.size_bytes,
        n_nodes=a.n_nodes,
    )


def known_info(adapter_id: int, k) -> pb.AdapterInfo:
    """``AdapterInfo`` of an adapter known by sha256 only (bytes not on this worker yet)."""
    return pb.AdapterInfo(id=adapter_id, name=k.name, path=k.path, sha256=k.sha256, pinned=k.pinned)


def step_to_proto(st: StepInfo) -> pb.StepTelemetry:
    """``StepInfo`` → ``StepTelemetry`` (every field by name: a missing one raises)."""
    return pb.StepTelemetry(**dataclasses.asdict(st))


def telemetry_to_proto(t: RequestTelemetry) -> pb.RequestTelemetry:
    """``RequestTelemetry`` → proto, the one mapping (an unknown field raises ValueError)."""
    fields = dataclasses.asdict(t)
    adapters = fields.pop("adapters").to_proto().entries
    residency = [pb.AdapterResidency(**r) for r in fields.pop("adapter_residency")]
    return pb.RequestTelemetry(adapters=adapters, adapter_residency=residency, **fields)


def stats_to_proto(s: WorkerStatsRecord) -> worker_pb2.WorkerStats:
    """``WorkerStatsRecord`` → ``WorkerStats`` (an unknown field raises ValueError)."""
    fields = {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "scheduler"}
    sched = {f.name: getattr(s.scheduler, f.name) for f in dataclasses.fields(s.scheduler) if f.name != "tenants"}
    tenants = [worker_pb2.TenantService(**dataclasses.asdict(t)) for t in s.scheduler.tenants]
    return worker_pb2.WorkerStats(**fields, **sched, tenants=tenants)


def event_to_proto(rid: str, ev: Event) -> pb.GenerateEvent:
    """A scheduler event → ``GenerateEvent`` (errors never reach here: they end the call)."""
    if isinstance(ev, StartedEvent):
        plp = []
        if ev.prompt_logprobs is not None:
            tops = ev.prompt_top or [()] * len(ev.prompt_logprobs)
            for e, top in zip(ev.prompt_logprobs, tops, strict=True):
                plp.append(
                    pb.PromptLogprob()
                    if e is None
                    else pb.PromptLogprob(
                        has_logprob=True,
                        token_id=e[0],
                        logprob=e[1],
                        rank=e[2],
                        top=[pb.TokenLogprob(token_id=t, logprob=v) for t, v in top or ()],
                    )
                )
        return pb.GenerateEvent(
            request_id=rid, started=pb.Started(prompt_token_ids=ev.prompt_tokens, prompt_logprobs=plp)
        )
    if isinstance(ev, TokenEvent):
        return pb.GenerateEvent(
            request_id=rid,
            token=pb.GeneratedToken(
                token_id=ev.token_id,
                text=ev.text,
                logprob=ev.logprob,
                top=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in ev.top],
                step=step_to_proto(ev.step),
            ),
        )
    if isinstance(ev, FinishedEvent):
        return pb.GenerateEvent(
            request_id=rid,
            finished=pb.Finished(
                finish_reason=ev.finish_reason, text=ev.text, telemetry=telemetry_to_proto(ev.telemetry)
            ),
        )
    raise TypeError(f"no GenerateEvent for {type(ev).__name__}")


def _put_event(events: queue.Queue, rid: str, ev: Event) -> None:
    """A request's ``emit``: tag its event with the request id for the stream's writer."""
    events.put((rid, ev))


class _CallRequests:
    """The requests one Decode call submitted, and whether the call is over. The reader thread
    adds to it while gRPC's done-callback cancels it (another thread): a request whose submit
    was still running when the call ended (waiting for the tokenizer, an adapter fetch, a
    grammar) is cancelled as it is added, so it never holds a queue place or a KV sequence for a
    client that is gone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[str, GenRequest] = {}
        self.over = False

    def add(self, rid: str, req: GenRequest) -> bool:
        """Record ``req``; False (and ``req`` cancelled) when the call is over already."""
        with self._lock:
            self._requests[rid] = req
            over = self.over
        if over:
            req.cancelled.set()
        return not over

    def get(self, rid: str) -> GenRequest | None:
        with self._lock:
            return self._requests.get(rid)

    def cancel_all(self) -> None:
        """The call is over: cancel every request it submitted, and any added from now on."""
        with self._lock:
            self.over = True
            requests = list(self._requests.values())
        for req in requests:
            req.cancelled.set()


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Thin: each method converts, delegates to ``WorkerEngine`` and maps errors."""

    def __init__(self, engine: WorkerEngine):
        self.engine = engine
        self.adapter_dirs = resolve_dirs(engine.config.adapter_dirs)
        self._calls = threading.Condition()
        self._open_decode_calls = 0

    def open_decode_calls(self) -> int:
        """Decode calls open now (their generations running, queued or still streaming out)."""
        with self._calls:
            return self._open_decode_calls

    def wait_decode_idle(self, timeout_s: float, stop: threading.Event | None = None) -> bool:
        """Wait until no Decode call is open (a drain's end), at most ``timeout_s`` seconds or
        until ``stop`` is set (checked every 0.1 s); True when none is open."""
        deadline = time.monotonic() + timeout_s
        with self._calls:
            while self._open_decode_calls:
                left = deadline - time.monotonic()
                if left <= 0 or (stop is not None and stop.is_set()):
                    return False
                self._calls.wait(min(left, 0.1))
            return True

    def Decode(self, request_iterator, context):
        with self._calls:
            self._open_decode_calls += 1
        try:
            yield from self._decode(request_iterator, context)
        finally:
            # the call's requests have ended: host entries only they kept go now, so the host
            # tier is back at --max-cpu-loras at rest, not only at the next request
            self.engine.host.trim()
            with self._calls:
                self._open_decode_calls -= 1
                self._calls.notify_all()

    def _decode(self, request_iterator, context):
        events: queue.Queue = queue.Queue()
        submitted = _CallRequests()

        def cancel_all() -> None:
            submitted.cancel_all()
            self.engine.scheduler.wake()
            events.put(_CALL_DONE)

        context.add_callback(cancel_all)
        reader = threading.Thread(
            target=self._read_requests, args=(request_iterator, events, submitted), daemon=True, name="decode-reader"
        )
        reader.start()
        open_ids: set[str] = set()
        input_done = False
        while True:
            item = events.get()
            if item is _CALL_DONE:
                return
            if item is _END_OF_INPUT:
                input_done = True
            elif item[0] is _OPENED:
                open_ids.add(item[1])
            elif item[0] is _CLOSED:
                open_ids.discard(item[1])
            else:
                rid, ev = item
                if isinstance(ev, ErrorEvent):
                    cancel_all()
                    context.abort(status_of(ev.error), str(ev.error))
                yield event_to_proto(rid, ev)
                if isinstance(ev, FinishedEvent):
                    open_ids.discard(rid)
            if input_done and not open_ids:
                return

    def _read_requests(self, request_iterator, events: queue.Queue, submitted: _CallRequests) -> None:
        try:
            for msg in request_iterator:
                if submitted.over:
                    break  # cancelled: what is left unread is not admitted
                if msg.HasField("submit"):
                    self._submit(msg.submit, events, submitted, msg.tenant if msg.HasField("tenant") else None)
                elif msg.cancel_request_id:
                    req = submitted.get(msg.cancel_request_id)
                    if req is not None:
                        req.cancelled.set()
                        self.engine.scheduler.wake()
                        events.put((_CLOSED, msg.cancel_request_id))
        except grpc.RpcError:
            pass  # the call ended; the done-callback cancels what it submitted
        except UndecodableRequest:
            events.put(_CALL_DONE)  # the decode guard ends the call with INVALID_ARGUMENT
            return
        events.put(_END_OF_INPUT)

    def _submit(
        self,
        r: pb.GenerateRequest,
        events: queue.Queue,
        submitted: _CallRequests,
        tenant: worker_pb2.RequestTenant | None = None,
    ) -> None:
        rid = r.request_id
        if not r.HasField("adapters"):
            events.put(
                (
                    rid,
                    ErrorEvent(
                        InvalidRequestError(
                            "request carries no adapter vector: "
                            "workers only accept vectors resolved by the control plane"
                        )
                    ),
                )
            )
            return
        which = r.WhichOneof("prompt")
        if which is None:
            events.put((rid, ErrorEvent(InvalidRequestError("request has neither prompt text nor prompt tokens"))))
            return
        try:
            adapters = AdapterScales.from_proto(r.adapters)
        except AdapterScalesError as exc:  # names, a scale out of bounds, an id twice
            self.engine.metrics.on_rejected(tuple(sorted({e.id for e in r.adapters.entries if e.scale != 0.0})))
            events.put((rid, ErrorEvent(InvalidRequestError(str(exc)))))
            return
        try:
            events.put((_OPENED, rid))
            req = self.engine.submit(
                request_id=rid,
                prompt_tokens=list(r.tokens.ids) if which == "tokens" else None,
                prompt_text=r.text if which == "text" else None,
                params=sampling_from_proto(r.sampling),
                adapters=adapters,
                emit=functools.partial(_put_event, events, rid),
                tenant=tenant_from_proto(tenant),
            )
        except WorkerError as exc:
            events.put((rid, ErrorEvent(exc)))
            return
        if not submitted.add(rid, req):
            self.engine.scheduler.wake()  # the call ended during the submit: the loop drops it now

    def LoadAdapter(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "LoadAdapter stream carried no chunk")
        assert first is not None  # context.abort raises
        try:
            # The path is checked on the first chunk, before anything is opened or stat'ed.
            path = str(self._confined(first.id, first.server_path)) if first.server_path else ""
            data = bytearray(first.data)
            for chunk in request_iterator:
                data += chunk.data
            if path and data:
                raise InvalidRequestError(f"adapter {first.id}: server_path and data given together; send one")
            a = self.engine.load_adapter(
                first.id,
                sha256=first.sha256,
                path=path,
                data=bytes(data),
                name=first.name,
                fetch_on_demand=first.fetch_on_demand,
                pinned=first.pinned if first.HasField("pinned") else None,
            )
        except WorkerError as exc:
            context.abort(status_of(exc), str(exc))
        k = self.engine.known().get(first.id)
        if isinstance(a, KnownAdapter):
            return known_info(first.id, a)
        info = adapter_info(first.id, a)
        info.pinned = bool(k and k.pinned)
        return info

    def _confined(self, adapter_id: int, server_path: str):
        """``server_path`` resolved inside the worker's ``--adapter-dir``s (`loraplane.paths`).

        Raises:
            InvalidRequestError: empty, relative, or a NUL byte.
            PermissionDeniedError: outside every adapter dir (nothing was read).
        """
        try:
            return confine(server_path, self.adapter_dirs)
        except MalformedPath as exc:
            raise InvalidRequestError(f"adapter {adapter_id}: {exc}") from None
        except OutsideAdapterDirs as exc:
            raise PermissionDeniedError(f"adapter {adapter_id} on worker {self.engine.worker_id}: {exc}") from None

    def UnloadAdapter(self, request, context):
        # Drain for at most the caller's deadline (60 s without one); on timeout the adapter
        # stays draining and is freed once idle (heartbeats report it under draining_ids).
        remaining = context.time_remaining()
        timeout_s = min(60.0, remaining) if remaining is not None else 60.0
        try:
            self.engine.unload_adapter(request.id, timeout_s=max(0.0, timeout_s - 0.2))
        except WorkerError as exc:
            context.abort(status_of(exc), str(exc))
        return pb.Empty()

    def ListAdapters(self, request, context):
        host = self.engine.adapters()
        return worker_pb2.WorkerAdapterList(
            adapters=[
                adapter_info(i, host[i]) if i in host else known_info(i, k)
                for i, k in sorted(self.engine.known().items())
            ]
        )

    def Stats(self, request, context):
        return stats_to_proto(self.engine.stats())
