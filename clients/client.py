"""Python client of the loraplane control plane: `LoraplaneClient` (sync) and
`AsyncLoraplaneClient` (asyncio, ``grpc.aio``).

    with LoraplaneClient("127.0.0.1:50051") as lp:
        shout = lp.add_adapter("shout.gguf")
        result = lp.generate("Tell me a story.", adapters={shout.id: 1.0}, max_tokens=24)
        print(result.text, result.telemetry["cached_prompt_tokens"])

Adapter maps: ``adapters=None`` → the control plane's default set (field unset on the wire);
``adapters={}`` → explicitly no adapters; ``{id: scale}`` → exactly those, every other
registered adapter at 0.

Errors: `ServerUnreachable` when no connection can be made (checked once, before the first
call, with a deadline of ``connect_timeout``), `LoraplaneError` (``code``, ``message``) when
the server refuses. The admin token (argument, else ``$LORAPLANE_ADMIN_TOKEN``) is sent as
``authorization: Bearer <token>`` metadata on every call. ``timeout`` is the per-call deadline
in seconds (None: none); for `generate_stream` it bounds the whole stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
import weakref
from pathlib import Path
from typing import Any

import grpc

from clients.channel import CHANNEL_OPTIONS, auth_metadata, wait_ready, wait_ready_async
from clients.errors import LoraplaneError, ServerUnreachable, from_rpc_error
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
    TokenEvent,
    TokenLogprob,
    WorkerInfo,
    event_from_proto,
)
from clients.wire import adapter_map, generate_request, upload_chunks
from loraplane.v1 import common_pb2, control_plane_pb2_grpc

__all__ = [
    "Adapter", "AdapterScale", "AsyncLoraplaneClient", "DefaultSet", "FinishedEvent",
    "GenerateEvent", "GenerateResult", "GeneratedLogprobs", "LoraplaneClient",
    "LoraplaneError", "ServerUnreachable", "StartedEvent", "TokenEvent", "TokenLogprob",
    "WorkerInfo",
]

DEFAULT_CONNECT_TIMEOUT_S = 5.0
_EMPTY = common_pb2.Empty()


def _check_upload_source(path: str | Path, server_path: bool) -> None:
    """Fail before the call: an unreadable file inside grpc's request thread only says UNKNOWN."""
    if not server_path and not Path(path).is_file():
        raise FileNotFoundError(f"adapter file not found: {path}")


def _stream_ended_early(request_id: str) -> LoraplaneError:
    return LoraplaneError("UNKNOWN",
                          f"generation stream of request {request_id!r} ended before finishing")


class LoraplaneClient:
    """Blocking client. Thread-safe; close it (or use ``with``) to release the channel."""

    def __init__(self, addr: str, *, admin_token: str | None = None,
                 timeout: float | None = None,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 wait_for_server: bool = False) -> None:
        self.addr = addr
        self.timeout = timeout
        self._connect_timeout = connect_timeout
        self._wait_for_server = wait_for_server
        self._metadata = auth_metadata(admin_token)
        self._channel = grpc.insecure_channel(addr, options=list(CHANNEL_OPTIONS))
        self._stub = control_plane_pb2_grpc.ControlPlaneStub(self._channel)
        self._connected = False
        # A client never closed must not keep the interpreter from exiting: grpc's
        # connectivity watch (started by `connect`) blocks grpc's shutdown at exit while the
        # channel is open. `weakref.finalize` closes it when the client is collected or, at
        # the latest, at interpreter exit (finalizers run from atexit).
        self._finalizer = weakref.finalize(self, self._channel.close)

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        self._finalizer()  # closes the channel once; later calls do nothing

    def __enter__(self) -> LoraplaneClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        """Wait until the server is reachable (done implicitly before the first call)."""
        if not self._connected:
            wait_ready(self._channel, self.addr, self._connect_timeout, self._wait_for_server)
            self._connected = True

    def _unary(self, method: Any, request: Any) -> Any:
        self.connect()
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.addr) from None

    # -- adapters --------------------------------------------------------------------------

    def list_adapters(self) -> list[Adapter]:
        reply = self._unary(self._stub.ListAdapters, _EMPTY)
        return [Adapter.from_proto(a) for a in reply.adapters]

    def get_adapter(self, adapter_id: int) -> Adapter:
        return Adapter.from_proto(
            self._unary(self._stub.GetAdapter, common_pb2.AdapterRef(id=adapter_id)))

    def add_adapter(self, path: str | Path, *, name: str | None = None,
                    server_path: bool = False) -> Adapter:
        """Register an adapter GGUF: upload ``path`` in chunks, or (``server_path=True``) name a
        file the server reads itself. Content already registered returns the existing id."""
        _check_upload_source(path, server_path)
        chunks = upload_chunks(path, name=name, server_path=server_path)
        return Adapter.from_proto(self._unary(self._stub.RegisterAdapter, chunks))

    def remove_adapter(self, adapter_id: int) -> None:
        self._unary(self._stub.UnregisterAdapter, common_pb2.AdapterRef(id=adapter_id))

    # -- default set -----------------------------------------------------------------------

    def get_default(self) -> DefaultSet:
        return DefaultSet.from_proto(self._unary(self._stub.GetDefaultAdapters, _EMPTY))

    def set_default(self, scales: Mapping[int, float]) -> DefaultSet:
        """Replace the global default set (``{}`` clears it); returns the set now in force."""
        return DefaultSet.from_proto(
            self._unary(self._stub.SetDefaultAdapters, adapter_map(scales)))

    # -- workers ---------------------------------------------------------------------------

    def list_workers(self) -> list[WorkerInfo]:
        reply = self._unary(self._stub.ListWorkers, _EMPTY)
        return [WorkerInfo.from_proto(w) for w in reply.workers]

    # -- generation ------------------------------------------------------------------------

    def generate_stream(self, prompt: str | None = None, *,
                        prompt_tokens: Sequence[int] | None = None,
                        adapters: Mapping[int, float] | None = None,
                        **sampling: Any) -> Iterator[GenerateEvent]:
        """Yield `StartedEvent`, then one `TokenEvent` per token as it is produced, then
        `FinishedEvent`. ``sampling``: max_tokens, temperature, top_k, top_p, seed, logprobs,
        prompt_logprobs, ignore_eos, request_id. Closing the iterator early cancels the call.
        """
        req = generate_request(prompt, prompt_tokens=prompt_tokens, adapters=adapters,
                               **sampling)
        self.connect()
        call = self._stub.Generate(req, timeout=self.timeout, metadata=self._metadata)
        try:
            for ev in call:
                typed = event_from_proto(ev)
                if typed is not None:
                    yield typed
        except grpc.RpcError as err:
            raise from_rpc_error(err, self.addr) from None
        finally:
            call.cancel()  # no-op once the stream has completed

    def generate(self, prompt: str | None = None, *,
                 prompt_tokens: Sequence[int] | None = None,
                 adapters: Mapping[int, float] | None = None,
                 **sampling: Any) -> GenerateResult:
        """Run `generate_stream` to the end and collect the result."""
        builder = ResultBuilder()
        for ev in self.generate_stream(prompt, prompt_tokens=prompt_tokens,
                                       adapters=adapters, **sampling):
            builder.add(ev)
        if builder.finished is None:
            raise _stream_ended_early(builder.request_id)
        return builder.build()


class AsyncLoraplaneClient:
    """asyncio client (``grpc.aio``); same methods as `LoraplaneClient`, awaitable.

    Create it inside a running event loop; ``async with`` closes it.
    """

    def __init__(self, addr: str, *, admin_token: str | None = None,
                 timeout: float | None = None,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 wait_for_server: bool = False) -> None:
        self.addr = addr
        self.timeout = timeout
        self._connect_timeout = connect_timeout
        self._wait_for_server = wait_for_server
        self._metadata = auth_metadata(admin_token)
        self._channel = grpc.aio.insecure_channel(addr, options=list(CHANNEL_OPTIONS))
        self._stub = control_plane_pb2_grpc.ControlPlaneStub(self._channel)
        self._connected = False

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncLoraplaneClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        if not self._connected:
            await wait_ready_async(self._channel, self.addr, self._connect_timeout,
                                   self._wait_for_server)
            self._connected = True

    async def _unary(self, method: Any, request: Any) -> Any:
        await self.connect()
        try:
            return await method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, self.addr) from None

    async def list_adapters(self) -> list[Adapter]:
        reply = await self._unary(self._stub.ListAdapters, _EMPTY)
        return [Adapter.from_proto(a) for a in reply.adapters]

    async def get_adapter(self, adapter_id: int) -> Adapter:
        return Adapter.from_proto(
            await self._unary(self._stub.GetAdapter, common_pb2.AdapterRef(id=adapter_id)))

    async def add_adapter(self, path: str | Path, *, name: str | None = None,
                          server_path: bool = False) -> Adapter:
        _check_upload_source(path, server_path)
        chunks = upload_chunks(path, name=name, server_path=server_path)
        return Adapter.from_proto(await self._unary(self._stub.RegisterAdapter, chunks))

    async def remove_adapter(self, adapter_id: int) -> None:
        await self._unary(self._stub.UnregisterAdapter, common_pb2.AdapterRef(id=adapter_id))

    async def get_default(self) -> DefaultSet:
        return DefaultSet.from_proto(await self._unary(self._stub.GetDefaultAdapters, _EMPTY))

    async def set_default(self, scales: Mapping[int, float]) -> DefaultSet:
        return DefaultSet.from_proto(
            await self._unary(self._stub.SetDefaultAdapters, adapter_map(scales)))

    async def list_workers(self) -> list[WorkerInfo]:
        reply = await self._unary(self._stub.ListWorkers, _EMPTY)
        return [WorkerInfo.from_proto(w) for w in reply.workers]

    async def generate_stream(self, prompt: str | None = None, *,
                              prompt_tokens: Sequence[int] | None = None,
                              adapters: Mapping[int, float] | None = None,
                              **sampling: Any) -> AsyncIterator[GenerateEvent]:
        """Async twin of `LoraplaneClient.generate_stream`."""
        req = generate_request(prompt, prompt_tokens=prompt_tokens, adapters=adapters,
                               **sampling)
        await self.connect()
        call = self._stub.Generate(req, timeout=self.timeout, metadata=self._metadata)
        try:
            async for ev in call:
                typed = event_from_proto(ev)
                if typed is not None:
                    yield typed
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err, self.addr) from None
        finally:
            call.cancel()

    async def generate(self, prompt: str | None = None, *,
                       prompt_tokens: Sequence[int] | None = None,
                       adapters: Mapping[int, float] | None = None,
                       **sampling: Any) -> GenerateResult:
        builder = ResultBuilder()
        async for ev in self.generate_stream(prompt, prompt_tokens=prompt_tokens,
                                             adapters=adapters, **sampling):
            builder.add(ev)
        if builder.finished is None:
            raise _stream_ended_early(builder.request_id)
        return builder.build()
