"""gRPC server/client interceptors shared by the control plane and the worker.

- `SharedSecretInterceptor`: methods matching a predicate need a metadata key to carry a
  secret (constant-time comparison), else UNAUTHENTICATED. The control plane's admin bearer
  token and the worker secret (membership RPCs at the control plane, every Worker RPC at a
  worker) are both instances.
- `DecodeGuardInterceptor`: a request that cannot be parsed (invalid UTF-8 in a string field,
  truncated bytes) answers INVALID_ARGUMENT naming the method and message type; grpc's own
  default is INTERNAL ("Exception deserializing request!").
- `ConcurrencyLimitInterceptor`: at most N calls of a group of methods run at once; call N+1
  gets RESOURCE_EXHAUSTED immediately (a non-blocking ``threading.BoundedSemaphore``). This is
  how long-lived calls (Generate relays, Decode streams, uploads) are kept from holding every
  thread of the server's pool, so heartbeats, health checks, Stats and reads always find one.
- `MetadataClientInterceptor`: adds fixed metadata (the worker secret) to every call of a
  channel (``grpc.intercept_channel``).

Order on a server (first = outermost): auth interceptors, then `DecodeGuardInterceptor`, then
`ConcurrencyLimitInterceptor`, so an unauthenticated call never takes a limiter permit.
"""

from __future__ import annotations

import collections
import functools
import hmac
import threading
from collections.abc import Callable, Mapping, Sequence

import grpc
import structlog

log = structlog.get_logger("loraplane.interceptors")

MethodPredicate = Callable[[str], bool]


def secret_matches(presented: str, secret: str) -> bool:
    """Whether ``presented`` equals ``secret``, compared in constant time (UTF-8 bytes)."""
    return hmac.compare_digest(presented.encode(), secret.encode())


def wrap_behavior(handler: grpc.RpcMethodHandler, wrap: Callable[[Callable], Callable]) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour function replaced by ``wrap(behaviour)`` (same kind)."""
    if handler.request_streaming and handler.response_streaming:
        return handler._replace(stream_stream=wrap(handler.stream_stream))
    if handler.request_streaming:
        return handler._replace(stream_unary=wrap(handler.stream_unary))
    if handler.response_streaming:
        return handler._replace(unary_stream=wrap(handler.unary_stream))
    return handler._replace(unary_unary=wrap(handler.unary_unary))


def refusal(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str, *, event: str = "rpc_refused", method: str = ""
) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as ``handler`` that aborts with ``code``.

    The request is never deserialized (no deserializer), so a refused caller cannot make the
    server parse anything.
    """

    def abort(_request, context: grpc.ServicerContext):
        log.warning(event, method=method, code=code.name, reason=message)
        context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


def metadata_value(metadata: Sequence[tuple[str, str]] | None, key: str) -> str | None:
    """The first value of ``key`` (case-insensitive) in invocation metadata, or None."""
    for k, v in metadata or ():
        if k.lower() == key:
            return v if isinstance(v, str) else None
    return None


class SharedSecretInterceptor(grpc.ServerInterceptor):
    """Methods for which ``applies(method)`` is true need ``key: <secret>`` metadata.

    Args:
        secret: the expected value (compared in constant time).
        key: metadata key (lower case).
        applies: which full method names (``/pkg.Service/Method``) are guarded.
        what: how refusals name the credential ("worker secret", ...).
        extract: turns the metadata value into the presented secret (e.g. strip ``Bearer``);
            None from it counts as absent.
        also: further secrets accepted in the same place (the admin token where the inference
            API key is asked for); each is compared, in constant time, whatever matched first.
        accept: ``accept(method, presented)``: a further acceptance of a value that matched none
            of the secrets (a tenant's API key, looked up by its hash); None: none.

    Refusal: UNAUTHENTICATED, message naming the method and the missing/rejected credential
    (never echoing what was presented).
    """

    def __init__(
        self,
        secret: str,
        *,
        key: str,
        applies: MethodPredicate,
        what: str,
        extract: Callable[[str], str | None] = lambda v: v,
        also: Sequence[str] = (),
        accept: Callable[[str, str], bool] | None = None,
    ) -> None:
        if not secret or not all(also):
            raise ValueError(f"{what}: an empty secret would accept anyone")
        self._secrets = (secret, *also)
        self._accept = accept
        self._key = key
        self._applies = applies
        self._what = what
        self._extract = extract

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not self._applies(method):
            return handler
        raw = metadata_value(handler_call_details.invocation_metadata, self._key)
        presented = self._extract(raw) if raw is not None else None
        if presented is None:
            return refusal(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method} needs the {self._what} ('{self._key}' metadata)",
                event="unauthenticated_call",
                method=method,
            )
        matched = any([secret_matches(presented, s) for s in self._secrets])  # a list: compare every one
        if not matched and not (self._accept is not None and self._accept(method, presented)):
            return refusal(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method}: {self._what} rejected",
                event="unauthenticated_call",
                method=method,
            )
        return handler


class UndecodableRequest(ValueError):
    """Raised from a guarded request iterator at a message that could not be parsed."""


class _Undecodable:
    """Stands in for a request message whose bytes could not be parsed."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class DecodeGuardInterceptor(grpc.ServerInterceptor):
    """Undecodable requests → INVALID_ARGUMENT (see the module docstring).

    Unary requests are checked before the behaviour runs. Streamed requests are checked as
    they are read: the iterator raises `UndecodableRequest` at the bad message and, whatever
    the behaviour then does with that exception, the call ends INVALID_ARGUMENT.
    """

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        parse = handler.request_deserializer

        def guarded_parse(data: bytes):
            try:
                return parse(data)
            except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's fault
                return _Undecodable(exc)

        def message(bad: _Undecodable) -> str:
            return f"{method}: request cannot be decoded: {bad.error}"

        def wrap(behavior):
            if handler.request_streaming:
                return self._wrap_stream(behavior, handler.response_streaming, message)
            return self._wrap_unary(behavior, handler.response_streaming, message)

        return wrap_behavior(handler._replace(request_deserializer=guarded_parse), wrap)

    @staticmethod
    def _wrap_unary(behavior, response_streaming: bool, message):
        if response_streaming:

            def stream(request, context):
                if isinstance(request, _Undecodable):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message(request))
                yield from behavior(request, context)

            return stream

        def unary(request, context):
            if isinstance(request, _Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, message(request))
            return behavior(request, context)

        return unary

    @staticmethod
    def _wrap_stream(behavior, response_streaming: bool, message):
        def checked(requests, seen: list):
            for r in requests:
                if isinstance(r, _Undecodable):
                    seen.append(r)
                    raise UndecodableRequest(message(r))
                yield r

        if response_streaming:

            def stream(requests, context):
                seen: list = []
                try:
                    yield from behavior(checked(requests, seen), context)
                except Exception:
                    if seen:
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, message(seen[0]))
                    raise
                if seen:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message(seen[0]))

            return stream

        def unary(requests, context):
            seen: list = []
            try:
                result = behavior(checked(requests, seen), context)
            except Exception:
                if seen:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message(seen[0]))
                raise
            if seen:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, message(seen[0]))
            return result

        return unary


PUSHBACK_KEY = "grpc-retry-pushback-ms"
"""Trailing-metadata key of gRPC's server pushback (gRFC A6): milliseconds to wait before a retry."""

BUSY_PUSHBACK_MS = 200
"""Pushback sent with a concurrency-limit refusal."""


def pushback_s(trailing: Sequence[tuple[str, str | bytes]] | None) -> float | None:
    """Seconds of server pushback in ``trailing`` metadata, or None when there is none."""
    for key, value in trailing or ():
        if key == PUSHBACK_KEY:
            try:
                return max(0.0, int(value) / 1000.0)
            except (TypeError, ValueError):
                return None
    return None


class ConcurrencyLimitInterceptor(grpc.ServerInterceptor):
    """At most ``limit`` concurrent calls per group; the next gets RESOURCE_EXHAUSTED at once.

    Args:
        groups: ``{group name: (limit, applies)}``; a method belongs to the first group whose
            ``applies(method)`` is true (methods in no group are not limited). A limit is in
            calls; a streaming call holds its permit until the stream ends.
        hint: appended to refusals (which flag raises the limit).
    """

    def __init__(self, groups: Mapping[str, tuple[int, MethodPredicate]], *, hint: str = "") -> None:
        self._groups = [
            (name, limit, applies, threading.BoundedSemaphore(limit)) for name, (limit, applies) in groups.items()
        ]
        self._hint = hint
        self.refused: collections.Counter[str] = collections.Counter()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        for name, limit, applies, sem in self._groups:
            if applies(method):
                return wrap_behavior(
                    handler,
                    functools.partial(
                        self._limited,
                        response_streaming=handler.response_streaming,
                        name=name,
                        limit=limit,
                        sem=sem,
                        method=method,
                    ),
                )
        return handler

    def _refuse(self, context, name: str, limit: int, method: str) -> None:
        self.refused[name] += 1
        # gRPC's server pushback: tells clients this refusal is "busy, retry after N ms" (and
        # not, say, an upload over the size limit, also RESOURCE_EXHAUSTED).
        context.set_trailing_metadata(((PUSHBACK_KEY, str(BUSY_PUSHBACK_MS)),))
        context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{method}: {limit} {name} calls already in progress; retry later{self._hint}",
        )

    def _limited(
        self, behavior, response_streaming: bool, name: str, limit: int, sem: threading.BoundedSemaphore, method: str
    ):
        if response_streaming:

            def stream(request, context):
                if not sem.acquire(blocking=False):
                    self._refuse(context, name, limit, method)
                try:
                    yield from behavior(request, context)
                finally:
                    sem.release()

            return stream

        def unary(request, context):
            if not sem.acquire(blocking=False):
                self._refuse(context, name, limit, method)
            try:
                return behavior(request, context)
            finally:
                sem.release()

        return unary


class _ClientCallDetails(
    collections.namedtuple(
        "_ClientCallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class MetadataClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``metadata`` pairs to every call made through the intercepted channel."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _ClientCallDetails(
            d.method,
            d.timeout,
            tuple(d.metadata or ()) + self._metadata,
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)
