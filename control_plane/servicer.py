"""The control plane's gRPC servicers: proto in, domain call, proto out.

`ControlPlaneServicer` serves the public ``ControlPlane`` service (admin, reads, Generate);
`WorkerMembershipServicer` serves ``WorkerMembership`` (RegisterWorker, Heartbeat,
FetchAdapter: what workers call), on the same server and port.

Every method delegates to the registry, the worker pool or the router; `boundary` turns a raised
error into the call's status code, read from the control plane's one error table
(`control_plane.error_codes`).
"""

from __future__ import annotations

import functools
import inspect
import uuid
from collections.abc import Callable

import grpc
import structlog

from control_plane import convert
from control_plane.config import DEFAULT_FETCH_STALL_TIMEOUT_S
from control_plane.error_codes import codes_of
from control_plane.errors import ControlPlaneError, NotFoundError, UnavailableError
from control_plane.membership import WorkerPool
from control_plane.quotas import QuotaExceededError
from control_plane.registry import AdapterRegistry
from control_plane.replicas import ReplicaSync
from control_plane.router import Router
from control_plane.stall import StallWatchdog
from control_plane.tenant_admin import TenantAdmin
from loraplane.interceptors import metadata_value
from loraplane.limits import CHUNK_BYTES
from loraplane.logging import bind_request
from loraplane.v1 import common_pb2, control_plane_pb2, control_plane_pb2_grpc, membership_pb2, membership_pb2_grpc

log = structlog.get_logger("loraplane.control_plane.servicer")

RETRY_AFTER_KEY = "retry-after"
"""Trailing metadata of a quota refusal: whole seconds before the request could pass (the HTTP
front's ``Retry-After``). Not gRPC's pushback key: clients retry pushback on their own, and a
tenant over its quota should see the refusal."""


def _retry_after(context, exc: Exception) -> None:
    """Put a quota refusal's ``retry-after`` into the call's trailing metadata."""
    if isinstance(exc, QuotaExceededError):
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(exc.retry_after_s)),))


def _failure(method: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ControlPlaneError):
        code = codes_of(exc).grpc
        log.info("rpc_refused", method=method, code=code.name, error=str(exc))
        return code, str(exc)
    log.exception("rpc_internal_error", method=method)
    return grpc.StatusCode.INTERNAL, f"{method}: internal error: {type(exc).__name__}: {exc}"


def boundary(fn: Callable) -> Callable:
    """Log the call with its method name and turn raised errors into ``context.abort``."""
    method = fn.__name__
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def stream(self, request, context):
            with bind_request(method=method):
                try:
                    yield from fn(self, request, context)
                    return
                except Exception as exc:  # noqa: BLE001 - the boundary maps everything
                    code, message = _failure(method, exc)
                    _retry_after(context, exc)
                context.abort(code, message)

        return stream

    @functools.wraps(fn)
    def unary(self, request, context):
        with bind_request(method=method):
            try:
                return fn(self, request, context)
            except Exception as exc:  # noqa: BLE001 - the boundary maps everything
                code, message = _failure(method, exc)
            context.abort(code, message)

    return unary


def ensure_request_id(request: common_pb2.GenerateRequest) -> common_pb2.GenerateRequest:
    if not request.request_id:
        request.request_id = uuid.uuid4().hex
    return request


def _byte_size(message) -> int:
    return message.ByteSize()


class ControlPlaneServicer(control_plane_pb2_grpc.ControlPlaneServicer):
    def __init__(
        self,
        registry: AdapterRegistry,
        pool: WorkerPool,
        router: Router,
        replicas: ReplicaSync | None = None,
        *,
        generate_watchdog: StallWatchdog | None = None,
        tenants: TenantAdmin | None = None,
    ) -> None:
        self.registry = registry
        self.pool = pool
        self.router = router
        self.replicas = replicas  # None: sightings are not shared (tests of one replica)
        # cancels Generate calls whose client stopped reading (None: never)
        self.generate_watchdog = generate_watchdog
        self.tenants = tenants  # None: the tenant RPCs answer UNAVAILABLE

    # -- admin ---------------------------------------------------------------------------

    @boundary
    def RegisterAdapter(self, request_iterator, context):
        upload = convert.upload_from_chunks(request_iterator)
        if upload.server_path:
            reg = self.registry.register_server_path(upload.server_path, name=upload.name)
        else:
            reg = self.registry.register_upload(
                upload.data, name=upload.name, source_format=upload.source_format or "gguf"
            )
        # Nothing is sent: workers fetch the bytes by sha256 when a request first needs them.
        return convert.adapter_info(reg.record)

    @boundary
    def UnregisterAdapter(self, request, context):
        # by id or by any of its names: the whole adapter goes (HTTP unload_lora_adapter drops a name)
        adapter_id = convert.ref_id(request, self.registry.names.lookup)
        self.registry.unregister(adapter_id)
        self.pool.adapters.unload_adapter(adapter_id)
        return common_pb2.Empty()

    @boundary
    def PinAdapter(self, request, context):
        rec = self.registry.set_pinned(convert.ref_id(request, self.registry.names.lookup), request.pinned)
        self.pool.adapters.set_pinned(rec)
        return convert.adapter_info(rec)

    @boundary
    def SetDefaultAdapters(self, request, context):
        return convert.adapter_map(
            self.registry.set_default_set(convert.request_map(request, self.registry.names.lookup))
        )

    # -- reads ---------------------------------------------------------------------------

    @boundary
    def ListAdapters(self, request, context):
        return control_plane_pb2.AdapterList(adapters=[convert.adapter_info(r) for r in self.registry.list()])

    @boundary
    def GetAdapter(self, request, context):
        return convert.adapter_info(self.registry.get(convert.ref_id(request, self.registry.names.lookup)))

    @boundary
    def GetDefaultAdapters(self, request, context):
        return convert.adapter_map(self.registry.default_set())

    @boundary
    def ListWorkers(self, request, context):
        return control_plane_pb2.WorkerList(workers=[convert.worker_info(v) for v in self.pool.snapshot()])

    # -- tenants (admin) -------------------------------------------------------------------

    def _tenant_admin(self) -> TenantAdmin:
        if self.tenants is None:
            raise UnavailableError("tenants are not served by this control plane")
        return self.tenants

    @boundary
    def AddTenant(self, request, context):
        view, key = self._tenant_admin().add(request.name, convert.tenant_settings(request.limits), request.api_key)
        return control_plane_pb2.AddTenantResponse(tenant=convert.tenant_info(view), api_key=key)

    @boundary
    def UpdateTenant(self, request, context):
        view = self._tenant_admin().update(request.name, convert.tenant_settings(request.limits))
        return control_plane_pb2.UpdateTenantResponse(tenant=convert.tenant_info(view))

    @boundary
    def ListTenants(self, request, context):
        views = self._tenant_admin().list()
        return control_plane_pb2.ListTenantsResponse(tenants=[convert.tenant_info(v) for v in views])

    @boundary
    def RemoveTenant(self, request, context):
        self._tenant_admin().remove(request.name)
        return control_plane_pb2.RemoveTenantResponse()

    # -- generation ----------------------------------------------------------------------

    @boundary
    def Generate(self, request, context):
        ensure_request_id(request)
        authorization = metadata_value(context.invocation_metadata(), "authorization")
        principal = self.router.tenants.principal(authorization)
        with bind_request(request_id=request.request_id):
            events = self.router.generate(request, context, principal=principal)
            if self.generate_watchdog is not None:
                events = self.generate_watchdog.stream(context, events, request.request_id, size=_byte_size)
            yield from events


class WorkerMembershipServicer(membership_pb2_grpc.WorkerMembershipServicer):
    """The ``WorkerMembership`` service (``protos/loraplane/v1/membership.proto``): what
    workers call on the control plane — RegisterWorker, Heartbeat, FetchAdapter. Served by
    the same gRPC server and port as `ControlPlaneServicer`; the worker door
    (`loraplane.worker_secret`) guards every method of it."""

    def __init__(
        self,
        registry: AdapterRegistry,
        pool: WorkerPool,
        replicas: ReplicaSync | None = None,
        *,
        fetch_watchdog: StallWatchdog | None = None,
    ) -> None:
        self.registry = registry
        self.pool = pool
        self.replicas = replicas  # None: sightings are not shared (tests of one replica)
        # cuts off FetchAdapter readers that stall (None: the config's default timeout)
        self.fetch_watchdog = fetch_watchdog or StallWatchdog(DEFAULT_FETCH_STALL_TIMEOUT_S)

    @boundary
    def RegisterWorker(self, request, context):
        joined = self.pool.register(request)
        if self.replicas is not None:
            self.replicas.record(request)
        return membership_pb2.WorkerAck(heartbeat_interval_ms=self.pool.heartbeat_interval_ms, joined=joined)

    @boundary
    def FetchAdapter(self, request, context):
        """Stream the bytes of content ``request.sha256`` (NOT_FOUND when none is registered,
        or its bytes are gone). A reader that stalls is cancelled (`control_plane.stall`)."""
        rec = self.registry.get_by_sha256(request.sha256)
        log.info("adapter_fetch", sha256=request.sha256, adapter_id=rec.id, worker_id=request.worker_id)
        what = f"FetchAdapter adapter {rec.id} for worker {request.worker_id or '?'} ({context.peer()})"
        try:
            for piece in self.fetch_watchdog.stream(context, self.registry.read_chunks(rec, CHUNK_BYTES), what):
                yield common_pb2.AdapterChunk(data=piece)
        except FileNotFoundError as exc:
            raise NotFoundError(f"adapter {rec.id}: its bytes are missing on the control plane ({exc})") from None

    @boundary
    def Heartbeat(self, request, context):
        joined = self.pool.heartbeat(request)
        if self.replicas is not None:
            self.replicas.record(request)
        return membership_pb2.WorkerAck(heartbeat_interval_ms=self.pool.heartbeat_interval_ms, joined=joined)
