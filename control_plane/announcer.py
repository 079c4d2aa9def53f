"""Announcing adapters to workers, and following what each worker holds.

`AdapterAnnouncer` is the ``adapters`` part of `control_plane.membership.WorkerPool` and shares
its lock. It announces the adapters a request needs to the worker about to serve it
(`ensure_loaded`: header only, the worker fetches the bytes by sha256), tells workers a new pin
flag (`set_pinned`), unloads a removed adapter everywhere (`unload_adapter`), reconciles a
joining worker's adapters with the registry (`reconcile_join`) and follows the holdings each
heartbeat reports (`report`, on a thread of its own). The why (bytes on demand, liveness never
waiting for the database): docs/architecture.md, "Workers: membership and announcing".
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence

import grpc
import structlog

from control_plane.errors import ControlPlaneError, DatabaseUnavailableError, UnavailableError
from control_plane.registry import AdapterRegistry
from control_plane.store import AdapterRecord
from control_plane.workers import MembershipTimings, WorkerHandle
from loraplane.v1 import common_pb2, membership_pb2

log = structlog.get_logger("loraplane.control_plane.announcer")


class AdapterAnnouncer:
    """What each worker knows of the registry's adapters (``WorkerHandle.adapter_ids``,
    ``draining_ids``), and telling it more or less.

    Args:
        registry: the adapters: records to announce, the registered set to reconcile against.
        timings: the deadlines of ``LoadAdapter`` (``load_timeout_s``), ``UnloadAdapter``
            (``unload_wait_s``) and a join's ``ListAdapters`` (``connect_timeout_s``); the
            heartbeat interval bounds how old a report in flight can be.
        lock: the pool's lock: every handle field this class reads or changes, under it.
        workers: every registered worker's handle, liveness as of now, by id
            (`WorkerPool.handles`); called without ``lock`` held.
        clock: the pool's clock (when an adapter was announced), seconds.
    """

    def __init__(
        self,
        registry: AdapterRegistry,
        timings: MembershipTimings,
        *,
        lock: threading.Lock,
        workers: Callable[[], list[WorkerHandle]],
        clock: Callable[[], float],
    ) -> None:
        self.registry = registry
        self.timings = timings
        self._lock = lock
        self._workers = workers
        self._clock = clock
        self._unloads = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="cp-unload")
        # Heartbeat reports waiting to be reconciled: worker id → (handle, holdings).
        self._holdings_due: dict[str, tuple[WorkerHandle, membership_pb2.WorkerHoldings]] = {}
        self._holdings_scheduled = False
        self._holdings_failing = False
        self._reconciler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cp-holdings")

    # -- announcing ---------------------------------------------------------------------

    def ensure_loaded(self, handle: WorkerHandle, adapter_ids: Sequence[int]) -> None:
        """Make sure ``handle`` knows every adapter in ``adapter_ids`` (id → sha256; it
        fetches the bytes itself when it needs them).

        Raises:
            NotFoundError: an id is no longer registered.
            UnavailableError: the worker refused or failed a load.
        """
        for adapter_id in adapter_ids:
            if adapter_id not in handle.adapter_ids:
                self._load(handle, self.registry.get(adapter_id))

    def _load(self, w: WorkerHandle, record: AdapterRecord) -> None:
        with w.load_lock:
            if record.id in w.adapter_ids:
                return
            try:
                w.stub.LoadAdapter(iter([self._header(record)]), timeout=self.timings.load_timeout_s)
            except grpc.RpcError as exc:
                raise UnavailableError(
                    f"worker {w.worker_id}: announcing adapter {record.id} failed: {exc.code().name}: {exc.details()}"
                ) from exc
            with self._lock:
                w.adapter_ids.add(record.id)
                w.loaded_at[record.id] = self._clock()
        log.info("adapter_announced", worker_id=w.worker_id, adapter_id=record.id)

    @staticmethod
    def _header(record: AdapterRecord) -> common_pb2.AdapterChunk:
        """The header-only ``LoadAdapter`` chunk: id, sha256, name, pin; bytes on demand."""
        return common_pb2.AdapterChunk(
            id=record.id, sha256=record.sha256, name=record.name, fetch_on_demand=True, pinned=record.pinned
        )

    def set_pinned(self, record: AdapterRecord) -> None:
        """Tell every live, not draining worker that knows ``record`` its new pin flag (failures
        logged; a worker told later gets the flag with the id, `ensure_loaded`)."""
        for w in self._workers():
            if not w.alive or w.draining or record.id not in w.adapter_ids:
                continue
            try:
                w.stub.LoadAdapter(iter([self._header(record)]), timeout=self.timings.load_timeout_s)
            except grpc.RpcError as exc:
                log.warning(
                    "adapter_pin_failed",
                    worker_id=w.worker_id,
                    adapter_id=record.id,
                    code=exc.code().name,
                    error=exc.details(),
                )

    # -- unloading ----------------------------------------------------------------------

    def unload_adapter(self, adapter_id: int) -> None:
        """Unload a removed adapter from every worker that may hold it, in parallel, waiting at
        most ``unload_wait_s`` (+1 s) in all. Live workers are all asked, not only those this
        replica announced it to: another replica may have announced it (`control_plane.replicas`);
        NOT_FOUND means not held. A worker still draining it then lists it under
        ``draining_ids`` until its heartbeats say it is freed; other failures are logged and
        retried by heartbeat reconciliation."""
        workers = self._workers()
        with self._lock:
            holders = [w for w in workers if (adapter_id in w.adapter_ids or w.alive) and adapter_id not in w.unloading]
            for w in holders:
                w.unloading.add(adapter_id)
        pending = [self._unloads.submit(self._unload_one, w, adapter_id) for w in holders]
        concurrent.futures.wait(pending, timeout=self.timings.unload_wait_s + 1.0)

    def _unload_one(self, w: WorkerHandle, adapter_id: int) -> None:
        """One ``UnloadAdapter`` call (deadline ``unload_wait_s``); the caller put
        ``adapter_id`` in ``w.unloading``, this removes it."""
        try:
            w.stub.UnloadAdapter(common_pb2.AdapterRef(id=adapter_id), timeout=self.timings.unload_wait_s)
            outcome = "freed"
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.NOT_FOUND:
                outcome = "freed"  # it did not hold it (any more)
            elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
                outcome = "draining"
                log.warning(
                    "adapter_unload_pending",
                    worker_id=w.worker_id,
                    adapter_id=adapter_id,
                    reason=f"still used by running requests after {self.timings.unload_wait_s:g}s; "
                    "the worker frees it when they finish",
                )
            else:
                outcome = "failed"
                log.warning(
                    "adapter_unload_failed",
                    worker_id=w.worker_id,
                    adapter_id=adapter_id,
                    code=code.name,
                    error=exc.details(),
                )
        with self._lock:
            w.unloading.discard(adapter_id)
            if outcome != "failed":
                w.adapter_ids.discard(adapter_id)
                w.loaded_at.pop(adapter_id, None)
                w.resident_ids.discard(adapter_id)
                w.host_ids.discard(adapter_id)
            if outcome == "draining":
                w.draining_ids.add(adapter_id)
            elif outcome == "freed":
                w.draining_ids.discard(adapter_id)

    # -- reconciling with the registry --------------------------------------------------

    def reconcile_join(self, w: WorkerHandle) -> None:
        """Align a (re)registering worker's adapters with the registry, before it is listed:
        keep what matches, unload what the registry no longer has (or holds with other
        content). No bytes are sent: the router announces adapters when a request needs them.
        The database unavailable: the worker joins believing it holds nothing (its heartbeats
        unload what is stale once the database answers).

        Raises:
            UnavailableError: the worker's ``ListAdapters`` failed.
        """
        try:
            held = w.stub.ListAdapters(common_pb2.Empty(), timeout=self.timings.connect_timeout_s).adapters
        except grpc.RpcError as exc:
            raise UnavailableError(
                f"worker {w.worker_id}: ListAdapters failed: {exc.code().name}: {exc.details()}"
            ) from exc
        try:
            wanted = {r.id: r for r in self.registry.list()}
        except DatabaseUnavailableError as exc:
            log.warning("worker_join_unreconciled", worker_id=w.worker_id, error=str(exc))
            with self._lock:
                w.adapter_ids = set()
            return
        kept = {i.id for i in held if i.id in wanted and wanted[i.id].sha256 == i.sha256}
        with self._lock:
            w.adapter_ids = set(kept)
        for info in held:
            if info.id in kept:
                continue
            try:
                w.stub.UnloadAdapter(common_pb2.AdapterRef(id=info.id), timeout=self.timings.unload_wait_s)
            except grpc.RpcError as exc:
                log.warning(
                    "adapter_unload_failed",
                    worker_id=w.worker_id,
                    adapter_id=info.id,
                    code=exc.code().name,
                    error=exc.details(),
                )

    def report(self, handle: WorkerHandle, holdings: membership_pb2.WorkerHoldings) -> None:
        """Hand a heartbeat's report of what ``handle`` holds to the reconciler thread (the
        newest report per worker replaces an older one still waiting); returns at once."""
        copy = membership_pb2.WorkerHoldings()
        copy.CopyFrom(holdings)
        with self._lock:
            self._holdings_due[handle.worker_id] = (handle, copy)
            if self._holdings_scheduled:
                return
            self._holdings_scheduled = True
        try:
            self._reconciler.submit(self._reconcile_due)
        except RuntimeError:  # closed
            pass

    def _reconcile_due(self) -> None:
        """Reconciler-thread body: one registry read for every report waiting. The registry
        unavailable (database outage): the reports are dropped (the next heartbeats bring new
        ones) and the failure is logged once until it answers again."""
        with self._lock:
            due, self._holdings_due = self._holdings_due, {}
            self._holdings_scheduled = False
        try:
            registered = {r.id: r.sha256 for r in self.registry.list()}
        except ControlPlaneError as exc:
            if not self._holdings_failing:
                log.warning("worker_holdings_not_reconciled", workers=sorted(due), error=str(exc))
            self._holdings_failing = True
            return
        if self._holdings_failing:
            log.info("worker_holdings_reconciled_again", workers=sorted(due))
        self._holdings_failing = False
        for handle, holdings in due.values():
            try:
                self._reconcile_holdings(handle, holdings, registered)
            except Exception:  # noqa: BLE001 - one worker's report must not stop the others'
                log.exception("worker_holdings_reconcile_failed", worker_id=handle.worker_id)

    def _reconcile_holdings(
        self, w: WorkerHandle, holdings: membership_pb2.WorkerHoldings, registered: dict[int, str]
    ) -> None:
        """Follow the worker's own report: what it holds is what we believe it holds (except
        adapters announced since the report may have been built), and what it holds that the
        registry (``registered``: id → sha256) no longer has (or has with other content) is
        unloaded in the background."""
        held = {a.id: a.sha256 for a in holdings.adapters}
        good = {i for i, sha in held.items() if registered.get(i) == sha}
        now = self._clock()
        recent_s = 3 * self.timings.heartbeat_interval_s  # a report in flight is at most this old
        with self._lock:
            announced_since = {i for i in w.adapter_ids if now - w.loaded_at.get(i, -1e18) < recent_s}
            believed = good | announced_since
            if believed != w.adapter_ids:
                log.warning(
                    "worker_adapters_reconciled",
                    worker_id=w.worker_id,
                    lost=sorted(w.adapter_ids - believed),
                    found=sorted(believed - w.adapter_ids),
                )
            w.adapter_ids = believed
            w.draining_ids = set(holdings.draining_ids) - believed
            stale = sorted(i for i in set(held) - good if i not in w.unloading)
            w.unloading.update(stale)
        for adapter_id in stale:
            log.info("stale_adapter_unloading", worker_id=w.worker_id, adapter_id=adapter_id)
            self._unloads.submit(self._unload_one, w, adapter_id)

    def close(self) -> None:
        """Stop the unload and reconciler threads (work still queued is dropped)."""
        self._unloads.shutdown(wait=False, cancel_futures=True)
        self._reconciler.shutdown(wait=False, cancel_futures=True)
