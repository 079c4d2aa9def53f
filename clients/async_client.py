"""`AsyncLoraplaneClient`: the asyncio (``grpc.aio``) twin of `clients.client.LoraplaneClient`:
the same methods, adapter-map rules, replica failover and errors, awaitable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from clients.channel import (
    CHANNEL_OPTIONS,
    BusyRetries,
    backoff_before,
    max_attempts,
    wait_ready_async,
)
from clients.client_base import EMPTY, ClientBase, check_upload_source, pin_request, stream_ended_early, unreachable
from clients.errors import ServerUnreachable, from_rpc_error
from clients.peft import upload_source
from clients.results import (
    Adapter,
    DefaultSet,
    GenerateEvent,
    GenerateResult,
    ResultBuilder,
    Tenant,
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


class AsyncLoraplaneClient(ClientBase):
    """asyncio client (``grpc.aio``); same methods and replica handling as `LoraplaneClient`,
    awaitable.

    Create it inside a running event loop; ``async with`` closes it.
    """

    def _init_channels(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()

    async def __aenter__(self) -> AsyncLoraplaneClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        await self._connected()

    async def _connected(self) -> tuple[str, control_plane_pb2_grpc.ControlPlaneStub]:
        errors: list[ServerUnreachable] = []
        for addr in self._replicas.order():
            channel = self._channels.get(addr)
            if channel is None:
                channel = self._channels[addr] = grpc.aio.insecure_channel(addr, options=list(CHANNEL_OPTIONS))
            if addr not in self._ready:
                try:
                    await wait_ready_async(channel, addr, self._connect_timeout, self._wait_for_server)
                except ServerUnreachable as err:
                    errors.append(err)
                    self._replicas.failed(addr)
                    continue
                self._ready.add(addr)
            return addr, control_plane_pb2_grpc.ControlPlaneStub(channel)
        raise unreachable(self.addr, errors)

    def _failed(self, addr: str) -> None:
        self._ready.discard(addr)
        self._replicas.failed(addr)

    async def _unary(self, method: str, make_request: Callable[[], Any], *, not_found_is_done: bool = False) -> Any:
        n = len(self._replicas.addrs)
        last: tuple[grpc.aio.AioRpcError, str] | None = None
        busy = BusyRetries()
        attempt = 0
        while attempt < max_attempts(n):
            await asyncio.sleep(backoff_before(attempt, n))
            addr, stub = await self._connected()
            try:
                return await getattr(stub, method)(make_request(), timeout=self.timeout, metadata=self._metadata)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND and not_found_is_done and last is not None:
                    return None
                wait = busy.wait_s(err.code(), err.trailing_metadata())
                if wait is not None:
                    await asyncio.sleep(wait)  # the server is busy (pushback): same attempt again
                    continue
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise from_rpc_error(err, addr) from None
                attempt += 1
                last = (err, addr)
                self._failed(addr)
        assert last is not None
        raise from_rpc_error(*last) from None

    async def list_adapters(self) -> list[Adapter]:
        reply = await self._unary("ListAdapters", lambda: EMPTY)
        return [Adapter.from_proto(a) for a in reply.adapters]

    async def get_adapter(self, adapter: int | str) -> Adapter:
        return Adapter.from_proto(await self._unary("GetAdapter", lambda: adapter_ref(adapter)))

    async def add_adapter(self, path: str | Path, *, name: str | None = None, server_path: bool = False) -> Adapter:
        check_upload_source(path, server_path)
        if server_path:
            return Adapter.from_proto(
                await self._unary("RegisterAdapter", lambda: upload_chunks(path, name=name, server_path=True))
            )
        with upload_source(path) as (gguf_path, fmt):
            return Adapter.from_proto(
                await self._unary("RegisterAdapter", lambda: upload_chunks(gguf_path, name=name, source_format=fmt))
            )

    async def remove_adapter(self, adapter: int | str) -> None:
        await self._unary("UnregisterAdapter", lambda: adapter_ref(adapter), not_found_is_done=True)

    async def pin_adapter(self, adapter: int | str, pinned: bool = True) -> Adapter:
        return Adapter.from_proto(await self._unary("PinAdapter", lambda: pin_request(adapter, pinned)))

    async def get_default(self) -> DefaultSet:
        return DefaultSet.from_proto(await self._unary("GetDefaultAdapters", lambda: EMPTY))

    async def set_default(self, scales: AdapterMapping) -> DefaultSet:
        return DefaultSet.from_proto(await self._unary("SetDefaultAdapters", lambda: adapter_map(scales)))

    async def list_workers(self) -> list[WorkerInfo]:
        reply = await self._unary("ListWorkers", lambda: EMPTY)
        return [WorkerInfo.from_proto(w) for w in reply.workers]

    async def add_tenant(
        self, name: str, *, api_key: str | None = None, **settings: float | int | None
    ) -> tuple[Tenant, str]:
        limits = tenant_limits(settings)
        reply = await self._unary(
            "AddTenant",
            lambda: control_plane_pb2.AddTenantRequest(name=name, limits=limits, api_key=api_key or ""),
        )
        return Tenant.from_proto(reply.tenant), reply.api_key

    async def update_tenant(self, name: str, **settings: float | int | None) -> Tenant:
        limits = tenant_limits(settings)
        reply = await self._unary(
            "UpdateTenant", lambda: control_plane_pb2.UpdateTenantRequest(name=name, limits=limits)
        )
        return Tenant.from_proto(reply.tenant)

    async def list_tenants(self) -> list[Tenant]:
        reply = await self._unary("ListTenants", lambda: control_plane_pb2.ListTenantsRequest())
        return [Tenant.from_proto(t) for t in reply.tenants]

    async def remove_tenant(self, name: str) -> None:
        await self._unary(
            "RemoveTenant", lambda: control_plane_pb2.RemoveTenantRequest(name=name), not_found_is_done=True
        )

    async def generate_stream(
        self,
        prompt: str | None = None,
        *,
        prompt_tokens: Sequence[int] | None = None,
        adapters: AdapterMapping | None = None,
        **sampling: Any,
    ) -> AsyncIterator[GenerateEvent]:
        """Async twin of `LoraplaneClient.generate_stream`."""
        req = generate_request(prompt, prompt_tokens=prompt_tokens, adapters=adapters, **sampling)
        addr, stub = await self._connected()
        call = stub.Generate(req, timeout=self.timeout, metadata=self._metadata)
        try:
            async for ev in call:
                typed = event_from_proto(ev)
                if typed is not None:
                    yield typed
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                self._failed(addr)
            raise from_rpc_error(err, addr) from None
        finally:
            call.cancel()

    async def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_tokens: Sequence[int] | None = None,
        adapters: AdapterMapping | None = None,
        **sampling: Any,
    ) -> GenerateResult:
        builder = ResultBuilder()
        async for ev in self.generate_stream(prompt, prompt_tokens=prompt_tokens, adapters=adapters, **sampling):
            builder.add(ev)
        if builder.finished is None:
            raise stream_ended_early(builder.request_id)
        return builder.build()
