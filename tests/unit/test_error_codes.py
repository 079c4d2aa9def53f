"""The control plane's one error table (`control_plane.error_codes`): every row, exactly, and
that the gRPC servicer and the HTTP front both answer from it."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import grpc
import pytest

import control_plane
from control_plane.error_codes import ERROR_CODES, UNLISTED, ErrorCodes, codes_of
from control_plane.errors import (
    AlreadyExistsError,
    AmbiguousNameError,
    ControlPlaneError,
    DatabaseUnavailableError,
    DataCorruptionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from control_plane.http.errors import from_control_plane
from control_plane.quota_rules import QuotaExceededError
from control_plane.router import WorkerRequestError
from control_plane.servicer import boundary

C = grpc.StatusCode

# (gRPC code, HTTP status, OpenAI type, OpenAI code) per row, written out by hand.
EXPECTED = {
    InvalidArgumentError: (C.INVALID_ARGUMENT, 400, "invalid_request_error", None),
    AlreadyExistsError: (C.ALREADY_EXISTS, 400, "invalid_request_error", None),
    NotFoundError: (C.NOT_FOUND, 404, "not_found_error", None),
    PermissionDeniedError: (C.PERMISSION_DENIED, 403, "permission_error", None),
    ResourceExhaustedError: (C.RESOURCE_EXHAUSTED, 429, "rate_limit_error", None),
    QuotaExceededError: (C.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "rate_limit_exceeded"),
    UnauthenticatedError: (C.UNAUTHENTICATED, 401, "authentication_error", None),
    UnavailableError: (C.UNAVAILABLE, 503, "service_unavailable", None),
    DataCorruptionError: (C.DATA_LOSS, 500, "internal_error", None),
    C.INVALID_ARGUMENT: (C.INVALID_ARGUMENT, 400, "invalid_request_error", "invalid_argument"),
    C.OUT_OF_RANGE: (C.OUT_OF_RANGE, 400, "invalid_request_error", "out_of_range"),
    C.FAILED_PRECONDITION: (C.FAILED_PRECONDITION, 400, "invalid_request_error", "failed_precondition"),
    C.NOT_FOUND: (C.NOT_FOUND, 404, "not_found_error", "not_found"),
    C.RESOURCE_EXHAUSTED: (C.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "resource_exhausted"),
    C.UNAVAILABLE: (C.UNAVAILABLE, 503, "service_unavailable", "unavailable"),
}


def _error_for(key: type[ControlPlaneError] | grpc.StatusCode) -> ControlPlaneError:
    """An instance of the row's error: a worker refusal for a code row."""
    if isinstance(key, grpc.StatusCode):
        return WorkerRequestError(key, "worker w1: refused")
    if key is QuotaExceededError:
        return QuotaExceededError("acme", "tokens_per_minute", "over tokens_per_minute 100", 7)
    return key("refused")


class _Aborted(Exception):
    pass


class _Context:
    """The part of a gRPC servicer context `boundary` uses; records the abort."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.trailing: tuple = ()

    def abort(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        raise _Aborted(message)

    def set_trailing_metadata(self, metadata: tuple) -> None:
        self.trailing = metadata


def _grpc_code(exc: Exception, *, stream: bool = False) -> tuple[grpc.StatusCode | None, tuple]:
    """The status code (and trailing metadata) the servicer's `boundary` answers ``exc`` with,
    raised by a unary method or by a streaming one (Generate's kind)."""

    class Servicer:
        @boundary
        def Unary(self, request, context):
            raise exc

        @boundary
        def Stream(self, request, context):
            yield from ()
            raise exc

    context = _Context()
    with pytest.raises(_Aborted):
        if stream:
            list(Servicer().Stream(None, context))
        else:
            Servicer().Unary(None, context)
    return context.code, context.trailing


def test_every_row_of_the_table_exactly():
    rows = {key: (r.grpc, r.http, r.type, r.code) for key, r in ERROR_CODES.items()}
    assert rows == EXPECTED
    assert UNLISTED == ErrorCodes(C.INTERNAL, 500, "internal_error", None)


@pytest.mark.parametrize("key", list(EXPECTED), ids=lambda k: getattr(k, "__name__", None) or k.name)
def test_both_apis_answer_each_row_from_the_table(key):
    grpc_code, http, kind, code = EXPECTED[key]
    exc = _error_for(key)
    assert _grpc_code(exc)[0] == grpc_code
    assert _grpc_code(exc, stream=True)[0] == grpc_code
    err = from_control_plane(exc)
    assert (err.status, err.type, err.code) == (http, kind, code)
    assert err.body()["error"] == {"message": str(exc), "type": kind, "param": None, "code": code}


def test_retry_after_on_429_and_503_only():
    """HTTP: ``Retry-After`` on every 429 and 503 (the error's own wait, else 1 s); gRPC: a
    quota refusal's wait in the ``retry-after`` trailing metadata of the stream."""
    assert from_control_plane(DatabaseUnavailableError("sqlite:///x", "locked")).headers == {"Retry-After": "2"}
    assert from_control_plane(UnavailableError("no live worker")).headers == {"Retry-After": "1"}
    assert from_control_plane(ResourceExhaustedError("every worker full")).headers == {"Retry-After": "1"}
    quota = QuotaExceededError("acme", "requests_per_minute", "over requests_per_minute 5", 9)
    assert from_control_plane(quota).headers == {"Retry-After": "9"}
    assert _grpc_code(quota, stream=True) == (C.RESOURCE_EXHAUSTED, (("retry-after", "9"),))
    assert from_control_plane(NotFoundError("adapter 9")).headers is None


def test_subclasses_take_their_nearest_listed_class():
    assert codes_of(AmbiguousNameError("x")) == ERROR_CODES[InvalidArgumentError]
    assert codes_of(DatabaseUnavailableError("db", "down")) == ERROR_CODES[UnavailableError]
    assert codes_of(type("Unlisted", (ControlPlaneError,), {})("x")) == UNLISTED


def test_an_unlisted_worker_code_keeps_its_code_on_grpc_and_is_a_500_on_http():
    """The client's own deadline passing (the router relays DEADLINE_EXCEEDED as is)."""
    exc = WorkerRequestError(C.DEADLINE_EXCEEDED, "deadline exceeded (the client's, 0.001 s)")
    assert _grpc_code(exc)[0] == C.DEADLINE_EXCEEDED
    err = from_control_plane(exc)
    assert (err.status, err.type, err.code) == (500, "internal_error", "deadline_exceeded")


def test_every_control_plane_error_class_has_a_row():
    """No error class of the control plane falls through to INTERNAL by accident."""
    classes = set()
    for info in pkgutil.walk_packages(control_plane.__path__, "control_plane."):
        module = importlib.import_module(info.name)
        classes |= {
            c
            for _, c in inspect.getmembers(module, inspect.isclass)
            if issubclass(c, ControlPlaneError) and c is not ControlPlaneError
        }
    assert len(classes) >= 12
    unlisted = sorted(
        c.__name__ for c in classes if c is not WorkerRequestError and not any(k in ERROR_CODES for k in c.__mro__)
    )
    assert unlisted == []
