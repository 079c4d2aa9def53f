"""Fetching adapter bytes from the control plane (``ControlPlane.FetchAdapter``).

The worker asks by content hash the first time a request needs an adapter it has no bytes
for; the control plane streams ``AdapterChunk``s from its store (files for SQLite, the
``adapter_blobs`` table for PostgreSQL). With several control-plane replicas listed, each is
tried in order until one answers: every replica reads the same store. The call carries the
worker secret when one is configured (the control plane guards it like membership).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from loraplane.limits import GRPC_MESSAGE_OPTIONS
from loraplane.v1 import control_plane_pb2, control_plane_pb2_grpc
from loraplane.worker_secret import with_secret
from worker.errors import AdapterFetchError
from worker.rpc.membership import control_plane_addresses


class ControlPlaneFetcher:
    """``sha256 → chunks`` over gRPC (a ``worker.lora.host_cache.Fetcher``); raises
    ``AdapterFetchError`` (``not_found`` when the control plane has no such content), which
    ``fetch_to_file`` re-raises naming the adapter id.

    Args:
        spec: one control-plane address or several, comma-separated.
        worker_id: sent along for the control plane's logs.
        timeout_s: deadline of one fetch.
        secret: the worker secret (None: none sent).
    """

    def __init__(self, spec: str, worker_id: str, *, timeout_s: float = 300.0, secret: str | None = None) -> None:
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        self._channels = [grpc.insecure_channel(a, options=GRPC_MESSAGE_OPTIONS) for a in control_plane_addresses(spec)]
        self._stubs = [control_plane_pb2_grpc.ControlPlaneStub(with_secret(c, secret)) for c in self._channels]

    def __call__(self, sha256: str) -> Iterator[bytes]:
        errors: list[str] = []
        for stub in self._stubs:
            chunks: list[bytes] = []
            try:
                for chunk in stub.FetchAdapter(
                    control_plane_pb2.FetchAdapterRequest(sha256=sha256, worker_id=self.worker_id),
                    timeout=self.timeout_s,
                ):
                    chunks.append(chunk.data)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    raise AdapterFetchError(f"NOT_FOUND: {exc.details()}", not_found=True) from None
                errors.append(f"{exc.code().name}: {exc.details()}")
                continue
            yield from chunks
            return
        raise AdapterFetchError("; ".join(errors) or "no control plane to fetch from")

    def close(self) -> None:
        """Close the channels."""
        for c in self._channels:
            c.close()
