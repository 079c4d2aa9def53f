"""Python client of the loraplane control plane: `LoraplaneClient` (sync); its asyncio twin
(``grpc.aio``) is `clients.async_client.AsyncLoraplaneClient`.

    with LoraplaneClient("127.0.0.1:50051") as lp:
        shout = lp.add_adapter("shout.gguf")
        result = lp.generate("Tell me a story.", adapters={shout.id: 1.0}, max_tokens=24)

Adapter maps (``None`` = the default set, ``{}`` = none), errors (`ServerUnreachable`,
`LoraplaneError`), credentials, deadlines and replicas: docs/operations.md, "The Python client".
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from clients.channel import (
    CHANNEL_OPTIONS,
    BusyRetries,
    backoff_before,
    max_attempts,
    wait_ready,
)
from clients.client_base import (
    EMPTY,
    ClientBase,
    check_upload_source,
    pin_request,
    rpc_code,
    stream_ended_early,
    unreachable,
)
from clients.errors import LoraplaneError, ServerUnreachable, from_rpc_error
from clients.peft import upload_source
from clients.results import (
    Adapter,
    AdapterScale,
    DefaultSet,
    FinishedEvent,
    GeneratedLogprobs,
    GenerateEvent,
    GenerateResult,
    ResultBuilder,
    StartedEvent,
    Tenant,
    TokenEvent,
    TokenLogprob,
    WorkerInfo,
    event_from_proto,
)
from clients.wire import (
    AdapterMapping,
    adapter_map,
    adapter_ref,
    generate_request,
    tenant_limits,
    upload_chunks,
)
from loraplane.v1 import control_plane_pb2, control_plane_pb2_grpc

__all__ = [
    "Adapter",
    "AdapterScale",
    "DefaultSet",
    "FinishedEvent",
    "GenerateEvent",
    "GenerateResult",
    "GeneratedLogprobs",
    "LoraplaneClient",
    "LoraplaneError",
    "ServerUnreachable",
    "StartedEvent",
    "Tenant",
    "TokenEvent",
    "TokenLogprob",
    "WorkerInfo",
]


def _close_channels(channels: dict[str, grpc.Channel], lock: threading.Lock) -> None:
    """Close and forget every channel in ``channels`` (the sync client's finalizer)."""
    with lock:
        items = list(channels.values())
        channels.clear()
    for channel in items:
        channel.close()


class LoraplaneClient(ClientBase):
    """Blocking client. Thread-safe; close it (or use ``with``) to release the channels.

    Args:
        addr: ``HOST:PORT``, or several comma-separated (one per control-plane replica).
        admin_token: bearer token for admin calls (else ``$LORAPLANE_ADMIN_TOKEN``).
        api_key: the inference API key of a control plane started with ``--api-key`` (else
            ``$LORAPLANE_API_KEY``); sent when no admin token is known (the admin token passes
            wherever the key does).
        timeout: deadline of each call attempt, seconds (None: none).
        connect_timeout: how long to wait for each replica to accept the connection, seconds.
        wait_for_server: keep waiting through connection failures until ``connect_timeout``.

    Raises:
        ValueError: an empty address in the list.
    """

    def _init_channels(self) -> None:
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        # A client never closed must not keep the interpreter from exiting: grpc's
        # connectivity watch (started by `connect`) blocks grpc's shutdown at exit while a
        # channel is open. `weakref.finalize` closes them when the client is collected or, at
        # the latest, at interpreter exit (finalizers run from atexit).
        self._finalizer = weakref.finalize(self, _close_channels, self._channels, self._lock)

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        self._finalizer()  # closes every channel once; later calls do nothing

    def __enter__(self) -> LoraplaneClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        """Wait until a replica is reachable (done implicitly before each call)."""
        self._connected()

    def _connected(self) -> tuple[str, control_plane_pb2_grpc.ControlPlaneStub]:
        """The preferred replica that accepts a connection, with its stub.

        Raises:
            ServerUnreachable: none of the addresses accepted a connection.
        """
        errors: list[ServerUnreachable] = []
        for addr in self._replicas.order():
            with self._lock:
                channel = self._channels.get(addr)
                if channel is None:
                    channel = self._channels[addr] = grpc.insecure_channel(addr, options=list(CHANNEL_OPTIONS))
                ready = addr in self._ready
            if not ready:
                try:
                    wait_ready(channel, addr, self._connect_timeout, self._wait_for_server)
                except ServerUnreachable as err:
                    errors.append(err)
                    self._replicas.failed(addr)
                    continue
                with self._lock:
                    self._ready.add(addr)
            return addr, control_plane_pb2_grpc.ControlPlaneStub(channel)
        raise unreachable(self.addr, errors)

    def _failed(self, addr: str) -> None:
        with self._lock:
            self._ready.discard(addr)
        self._replicas.failed(addr)

    def _unary(self, method: str, make_request: Callable[[], Any], *, not_found_is_done: bool = False) -> Any:
        """Call ``method`` with retries on the next replica (see `clients.channel`).

        ``make_request`` builds the request anew for every attempt (an upload iterator
        cannot be replayed). ``not_found_is_done``: a retry answering NOT_FOUND returns None.
        """
        n = len(self._replicas.addrs)
        last: tuple[grpc.RpcError, str] | None = None
        busy = BusyRetries()
        attempt = 0
        while attempt < max_attempts(n):
            time.sleep(backoff_before(attempt, n))
            addr, stub = self._connected()
            try:
                return getattr(stub, method)(make_request(), timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as err:
                code = rpc_code(err)
                if code == grpc.StatusCode.NOT_FOUND and not_found_is_done and last is not None:
                    return None
                wait = busy.wait_s(code, err.trailing_metadata())
                if wait is not None:
                    time.sleep(wait)  # the server is busy (pushback): same attempt again
                    continue
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise from_rpc_error(err, addr) from None
                attempt += 1
                last = (err, addr)
                self._failed(addr)
        assert last is not None
        raise from_rpc_error(*last) from None

    # -- adapters --------------------------------------------------------------------------

    def list_adapters(self) -> list[Adapter]:
        reply = self._unary("ListAdapters", lambda: EMPTY)
        return [Adapter.from_proto(a) for a in reply.adapters]

    def get_adapter(self, adapter: int | str) -> Adapter:
        return Adapter.from_proto(self._unary("GetAdapter", lambda: adapter_ref(adapter)))

    def add_adapter(
        self, path: str | Path, *, name: str | None = None, server_path: bool = False, progress: Any = None
    ) -> Adapter:
        """Register an adapter GGUF: upload ``path`` in chunks, or (``server_path=True``) name a
        file the server reads itself. Content already registered returns the existing id (a
        new ``name`` becomes an alias of it); a ``name`` another adapter answers to is
        ALREADY_EXISTS.
        A replica failing mid-upload: the whole upload is sent again to the next one.
        A PEFT folder is converted here first (``clients.peft.upload_source``) and uploaded as
        GGUF; a PEFT folder given as a server path is converted by the control plane.
        ``progress(bytes_sent, total)`` is called per uploaded chunk."""
        check_upload_source(path, server_path)
        if server_path:
            return Adapter.from_proto(
                self._unary("RegisterAdapter", lambda: upload_chunks(path, name=name, server_path=True))
            )
        with upload_source(path) as (gguf_path, fmt):
            return Adapter.from_proto(
                self._unary(
                    "RegisterAdapter", lambda: upload_chunks(gguf_path, name=name, source_format=fmt, progress=progress)
                )
            )

    def remove_adapter(self, adapter: int | str) -> None:
        """Unregister ``adapter`` (an id, or a name / alias: the whole adapter goes, whatever
        names it); a retry on another replica that finds it gone is done."""
        self._unary("UnregisterAdapter", lambda: adapter_ref(adapter), not_found_is_done=True)

    def pin_adapter(self, adapter: int | str, pinned: bool = True) -> Adapter:
        """Pin (never evicted from workers' slot pools / host caches) or unpin an adapter."""
        return Adapter.from_proto(self._unary("PinAdapter", lambda: pin_request(adapter, pinned)))

    # -- default set -----------------------------------------------------------------------

    def get_default(self) -> DefaultSet:
        return DefaultSet.from_proto(self._unary("GetDefaultAdapters", lambda: EMPTY))

    def set_default(self, scales: AdapterMapping) -> DefaultSet:
        """Replace the global default set (``{}`` clears it); returns the set now in force."""
        return DefaultSet.from_proto(self._unary("SetDefaultAdapters", lambda: adapter_map(scales)))

    # -- workers ---------------------------------------------------------------------------

    def list_workers(self) -> list[WorkerInfo]:
        reply = self._unary("ListWorkers", lambda: EMPTY)
        return [WorkerInfo.from_proto(w) for w in reply.workers]

    # -- tenants (admin) -------------------------------------------------------------------

    def add_tenant(
        self, name: str, *, api_key: str | None = None, **settings: float | int | None
    ) -> tuple[Tenant, str]:
        """Add tenant ``name`` with one API key (``api_key``, else generated by the control
        plane); ``settings``: weight, priority, max_concurrent, tokens_per_minute,
        requests_per_minute (None / absent: the default; 0 limits: unlimited). Returns the
        tenant and its key in clear: shown this once, stored only hashed. ALREADY_EXISTS for a
        taken name or key."""
        limits = tenant_limits(settings)
        reply = self._unary(
            "AddTenant",
            lambda: control_plane_pb2.AddTenantRequest(name=name, limits=limits, api_key=api_key or ""),
        )
        return Tenant.from_proto(reply.tenant), reply.api_key

    def update_tenant(self, name: str, **settings: float | int | None) -> Tenant:
        """Change the settings given (the others keep their value); NOT_FOUND for no such tenant."""
        limits = tenant_limits(settings)
        reply = self._unary("UpdateTenant", lambda: control_plane_pb2.UpdateTenantRequest(name=name, limits=limits))
        return Tenant.from_proto(reply.tenant)

    def list_tenants(self) -> list[Tenant]:
        """Every tenant with its limits and current usage (all replicas)."""
        reply = self._unary("ListTenants", lambda: control_plane_pb2.ListTenantsRequest())
        return [Tenant.from_proto(t) for t in reply.tenants]

    def remove_tenant(self, name: str) -> None:
        """Remove tenant ``name`` and its keys; a retry on another replica that finds it gone is done."""
        self._unary("RemoveTenant", lambda: control_plane_pb2.RemoveTenantRequest(name=name), not_found_is_done=True)

    # -- generation ------------------------------------------------------------------------

    def generate_stream(
        self,
        prompt: str | None = None,
        *,
        prompt_tokens: Sequence[int] | None = None,
        adapters: AdapterMapping | None = None,
        **sampling: Any,
    ) -> Iterator[GenerateEvent]:
        """Yield `StartedEvent`, then one `TokenEvent` per token as it is produced, then
        `FinishedEvent`. ``sampling``: max_tokens, temperature, top_k, top_p, min_p,
        presence_penalty, frequency_penalty, repetition_penalty, seed, logprobs,
        prompt_logprobs, ignore_eos, request_id. Closing the iterator early cancels the call.
        Runs on the first replica that accepts a connection; never replayed once sent.
        """
        req = generate_request(prompt, prompt_tokens=prompt_tokens, adapters=adapters, **sampling)
        addr, stub = self._connected()
        call = stub.Generate(req, timeout=self.timeout, metadata=self._metadata)
        try:
            for ev in call:
                typed = event_from_proto(ev)
                if typed is not None:
                    yield typed
        except grpc.RpcError as err:
            if rpc_code(err) == grpc.StatusCode.UNAVAILABLE:
                self._failed(addr)  # the next call starts on another replica
            raise from_rpc_error(err, addr) from None
        finally:
            call.cancel()  # no-op once the stream has completed

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_tokens: Sequence[int] | None = None,
        adapters: AdapterMapping | None = None,
        **sampling: Any,
    ) -> GenerateResult:
        """Run `generate_stream` to the end and collect the result."""
        builder = ResultBuilder()
        for ev in self.generate_stream(prompt, prompt_tokens=prompt_tokens, adapters=adapters, **sampling):
            builder.add(ev)
        if builder.finished is None:
            raise stream_ended_early(builder.request_id)
        return builder.build()
