"""Status details of any size reach the client: bounded before they leave a server.

A gRPC status message travels as the ``grpc-message`` trailer, percent-encoded (every byte
outside printable ASCII, and ``%``, takes three bytes: gRPC's PROTOCOL-HTTP2.md). Clients
refuse trailers over their metadata limit (grpc core: 8 KiB soft, 16 KiB hard by default) and
then report ``RESOURCE_EXHAUSTED: … metadata size exceeds soft limit`` instead of the status
the server sent, so a long message — an adapter file with hundreds of problems, a model GGUF
registered as an adapter — used to lose the good code and text entirely.

`bound_details` cuts a message to at most `MAX_DETAILS_BYTES` encoded bytes: a message that
is a list of problems (``head\\n  - p1\\n  - p2 …``, as ``AdapterError`` writes it) keeps its
head and as many whole problems as fit, then ``… (N more problems)``; any other message keeps
its start and ``… (N more bytes)``. `BoundedStatusInterceptor`, the outermost interceptor of the
control plane's and the worker's servers, applies it to every status of every method (aborts
from servicers and from other interceptors, ``set_details``, and exceptions no one caught) and
logs the full text as ``status_details_bounded`` whenever it cuts.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import structlog

from loraplane.interceptors import wrap_behavior

log = structlog.get_logger("loraplane.status_details")

MAX_DETAILS_BYTES = 4096
"""Most percent-encoded bytes of a status message a server sends (half grpc core's 8 KiB soft
limit on all metadata, leaving room for the other headers and trailers)."""

_PROBLEM_SEP = "\n  - "


def encoded_size(text: str) -> int:
    """Bytes ``text`` takes as a percent-encoded ``grpc-message`` trailer."""
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in text.encode("utf-8"))


def _cut(text: str, budget: int) -> str:
    """The longest prefix of ``text`` (whole characters) whose encoded size is ≤ ``budget``."""
    used = 0
    for i, ch in enumerate(text):
        used += encoded_size(ch)
        if used > budget:
            return text[:i]
    return text


def bound_details(text: str, limit: int = MAX_DETAILS_BYTES) -> str:
    """``text`` if it fits in ``limit`` encoded bytes, else its start plus what was left off.

    Lists of problems (lines starting ``"  - "`` after a head line) are cut between whole
    problems and end ``"\\n  … (N more problems)"``; other text ends ``"… (N more bytes)"``
    (N: UTF-8 bytes of ``text`` left off). The result always fits in ``limit`` (≥ 64).
    """
    if encoded_size(text) <= limit:
        return text
    parts = text.split(_PROBLEM_SEP)
    if len(parts) > 2:
        head, problems = parts[0], parts[1:]
        kept, n_kept = head, 0
        for problem in problems:
            candidate = kept + _PROBLEM_SEP + problem
            rest = len(problems) - n_kept - 1
            if encoded_size(f"{candidate}\n  … ({rest} more problems)") > limit:
                break
            kept, n_kept = candidate, n_kept + 1
        tail = f"\n  … ({len(problems) - n_kept} more problems)"
        if n_kept and encoded_size(kept + tail) <= limit:
            return kept + tail
    total = len(text.encode("utf-8"))
    # reserve room for the marker at its widest (N ≤ total)
    marker_room = encoded_size(f"… ({total} more bytes)")
    head = _cut(text, limit - marker_room)
    return f"{head}… ({total - len(head.encode('utf-8'))} more bytes)"


class _BoundedContext:
    """A ``grpc.ServicerContext`` whose status details are bounded (everything else delegated)."""

    def __init__(self, context: grpc.ServicerContext, method: str) -> None:
        self._context = context
        self._method = method
        self.aborted = False

    def __getattr__(self, name: str):
        return getattr(self._context, name)

    def _bounded(self, code, details: str) -> str:
        if not isinstance(details, str):
            return details
        bounded = bound_details(details)
        if bounded != details:
            log.warning(
                "status_details_bounded",
                method=self._method,
                code=getattr(code, "name", str(code)),
                sent_bytes=len(bounded.encode("utf-8")),
                full_bytes=len(details.encode("utf-8")),
                details=details,
            )
        return bounded

    def abort(self, code: grpc.StatusCode, details: str):
        self.aborted = True
        self._context.abort(code, self._bounded(code, details))

    def abort_with_status(self, status):
        self.aborted = True
        details = getattr(status, "details", None)
        if isinstance(details, str) and encoded_size(details) > MAX_DETAILS_BYTES:
            status = status._replace(details=self._bounded(status.code, details))
        self._context.abort_with_status(status)

    def set_details(self, details: str) -> None:
        self._context.set_details(self._bounded(self._context.code(), details))


def _uncaught(context: _BoundedContext, exc: Exception) -> None:
    """Abort as grpc would for an exception no one caught (UNKNOWN), with bounded details."""
    log.exception("rpc_uncaught_exception", method=context._method)
    context.abort(grpc.StatusCode.UNKNOWN, f"Exception calling application: {exc}")


class BoundedStatusInterceptor(grpc.ServerInterceptor):
    """Bounds every status message the server sends (`bound_details`); put it outermost.

    Wraps each handler's behaviour with a context proxy whose ``abort``,
    ``abort_with_status`` and ``set_details`` bound the message, and turns an exception the
    behaviour did not catch into UNKNOWN ``Exception calling application: …`` (grpc's own
    wording) bounded the same way. Being outermost, it also covers refusals produced by the
    interceptors inside it (auth, decode guard, concurrency limits).
    """

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method

        def wrap(behavior: Callable) -> Callable:
            if handler.response_streaming:

                def stream(request, context):
                    bounded = _BoundedContext(context, method)
                    try:
                        yield from behavior(request, bounded)
                    except Exception as exc:
                        if bounded.aborted:
                            raise
                        _uncaught(bounded, exc)

                return stream

            def unary(request, context):
                bounded = _BoundedContext(context, method)
                try:
                    return behavior(request, bounded)
                except Exception as exc:
                    if bounded.aborted:
                        raise
                    _uncaught(bounded, exc)

            return unary

        return wrap_behavior(handler, wrap)
