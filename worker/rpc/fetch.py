"""Fetching adapter bytes from the control plane (``WorkerMembership.FetchAdapter``).

The worker asks by content hash the first time a request needs an adapter it has no bytes
for; the control plane streams ``AdapterChunk``s from its store (files for SQLite, the
``adapter_blobs`` table for PostgreSQL). With several control-plane replicas listed, each is
tried in order until one answers: every replica reads the same store. The call carries the
worker secret when one is configured (the control plane guards it like membership).

Each call has a deadline (``timeout_s``). A busy control plane (RESOURCE_EXHAUSTED: its
FetchAdapter cap is taken) or a transient failure (UNAVAILABLE, CANCELLED: it cut off a call
it found stalled, DEADLINE_EXCEEDED) is retried after a backoff (the server's pushback when it
sent one) for up to ``attempts`` rounds over the replicas; NOT_FOUND and the rest (a refused
secret, UNAUTHENTICATED, says what to configure) fail at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc

from loraplane.interceptors import pushback_s
from loraplane.limits import GRPC_MESSAGE_OPTIONS
from loraplane.v1 import membership_pb2, membership_pb2_grpc
from loraplane.worker_secret import with_secret
from worker.errors import AdapterFetchError
from worker.rpc.membership import control_plane_addresses

RETRIED = frozenset(
    {
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)
"""Fetch failures worth another try (busy, unreachable, cut off, too slow)."""


class ControlPlaneFetcher:
    """``sha256 → chunks`` over gRPC (a ``worker.lora.host_cache.Fetcher``); raises
    ``AdapterFetchError`` (``not_found`` when the control plane has no such content), which
    ``fetch_to_file`` re-raises naming the adapter id.

    Args:
        spec: one control-plane address or several, comma-separated.
        worker_id: sent along for the control plane's logs.
        timeout_s: deadline of one FetchAdapter call, seconds.
        secret: the worker secret (None: none sent).
        attempts: rounds over the replicas for retried failures (`RETRIED`).
        backoff_s: first wait between rounds (doubled each round, at least the pushback).
    """

    def __init__(
        self,
        spec: str,
        worker_id: str,
        *,
        timeout_s: float = 300.0,
        secret: str | None = None,
        attempts: int = 4,
        backoff_s: float = 0.2,
    ) -> None:
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self._channels = [grpc.insecure_channel(a, options=GRPC_MESSAGE_OPTIONS) for a in control_plane_addresses(spec)]
        self._stubs = [membership_pb2_grpc.WorkerMembershipStub(with_secret(c, secret)) for c in self._channels]

    def __call__(self, sha256: str) -> Iterator[bytes]:
        errors: list[str] = []
        delay = self.backoff_s
        for attempt in range(self.attempts):
            wait = 0.0
            for stub in self._stubs:
                chunks: list[bytes] = []
                try:
                    for chunk in stub.FetchAdapter(
                        membership_pb2.FetchAdapterRequest(sha256=sha256, worker_id=self.worker_id),
                        timeout=self.timeout_s,
                    ):
                        chunks.append(chunk.data)
                except grpc.RpcError as exc:
                    code = exc.code()
                    if code == grpc.StatusCode.NOT_FOUND:
                        raise AdapterFetchError(f"NOT_FOUND: {exc.details()}", not_found=True) from None
                    errors.append(f"{code.name}: {exc.details()}")
                    if code not in RETRIED:
                        raise AdapterFetchError("; ".join(errors)) from None
                    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
                    wait = max(wait, pushback_s(trailing) or 0.0)
                    continue
                yield from chunks
                return
            if attempt + 1 < self.attempts and self._stubs:
                time.sleep(max(delay, wait))
                delay *= 2
        raise AdapterFetchError("; ".join(errors) or "no control plane to fetch from")

    def close(self) -> None:
        """Close the channels."""
        for c in self._channels:
            c.close()
