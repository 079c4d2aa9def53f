"""Keeping one control-plane replica in step with the others through the shared store.

One `ReplicaSync` per control-plane process, with a daemon thread that ticks every
``interval_s`` (the heartbeat interval) and a writer thread of its own. `ReplicaSync.record`
notes the latest worker hello in memory (the writer thread writes it to the store as a
sighting, so no heartbeat waits for the database); each tick reads the other replicas' recent
sightings and adopts or refreshes those workers in the `WorkerPool`, and unloads adapters
removed through any replica from every worker this replica knows. Adapters and the default
set need no syncing: every read goes to the database.

How membership converges, what a database outage costs: docs/architecture.md, "Replicas".
"""

from __future__ import annotations

import threading
import time

import structlog

from control_plane.errors import ControlPlaneError, NotFoundError
from control_plane.membership import WorkerPool
from control_plane.store import AdapterStore
from loraplane.v1 import membership_pb2

log = structlog.get_logger("loraplane.control_plane.replicas")


class ReplicaSync:
    """The sync thread of one replica (see the module docstring).

    Args:
        store: the shared store.
        pool: this replica's workers.
        interval_s: seconds between ticks (the workers' heartbeat interval).
        dead_after_s: sightings older than this are ignored (the worker is dead).
    """

    def __init__(self, store: AdapterStore, pool: WorkerPool, *, interval_s: float, dead_after_s: float) -> None:
        self.store = store
        self.pool = pool
        self.interval_s = interval_s
        self.dead_after_s = dead_after_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Removals before this replica started need no unloading here: a worker it adopts
        # or that registers with it is reconciled against the registry.
        self._removed_seen: set[int] = store.removed_ids()
        # Sightings not yet written: worker id → (hello, time.monotonic() of the heartbeat).
        self._pending: dict[str, tuple[membership_pb2.WorkerHello, float]] = {}
        self._pending_lock = threading.Lock()
        self._wake = threading.Event()
        self._writer: threading.Thread | None = None
        self._write_failing = False

    def record(self, hello: membership_pb2.WorkerHello) -> None:
        """A worker registered with or heartbeated this replica: tell the others. Returns at
        once; the writer thread writes it (`flush_sightings`), so the caller never waits for
        the database."""
        copy = membership_pb2.WorkerHello(
            worker_id=hello.worker_id,
            addr=hello.addr,
            model=hello.model,
            model_sha256=hello.model_sha256,
            n_slots=hello.n_slots,
        )
        with self._pending_lock:
            self._pending[hello.worker_id] = (copy, time.monotonic())
        self._wake.set()

    def flush_sightings(self) -> bool:
        """Write the pending sightings; ones that fail (database unavailable) stay pending
        unless a newer heartbeat of the same worker replaced them. True when all were written.
        """
        with self._pending_lock:
            batch, self._pending = self._pending, {}
        failed: dict[str, tuple[membership_pb2.WorkerHello, float]] = {}
        error = ""
        for worker_id, (hello, seen_at) in batch.items():
            if error:  # the database is down: do not wait on it once per worker
                failed[worker_id] = (hello, seen_at)
                continue
            try:
                self.store.record_worker(
                    worker_id=hello.worker_id,
                    addr=hello.addr,
                    model=hello.model,
                    model_sha256=hello.model_sha256,
                    n_slots=hello.n_slots,
                    age_s=max(0.0, time.monotonic() - seen_at),
                )
            except ControlPlaneError as exc:
                error = str(exc)
                failed[worker_id] = (hello, seen_at)
        with self._pending_lock:
            for worker_id, item in failed.items():
                self._pending.setdefault(worker_id, item)  # a newer heartbeat wins
        if error and not self._write_failing:
            log.warning(
                "worker_sightings_not_recorded", workers=sorted(failed), error=error, retry_in_s=self.interval_s
            )
        elif not error and self._write_failing:
            log.info("worker_sightings_recorded_again", workers=sorted(batch))
        self._write_failing = bool(error)
        return not error

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="replica-sync", daemon=True)
        self._thread.start()
        self._writer = threading.Thread(target=self._write_loop, name="replica-sightings", daemon=True)
        self._writer.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for thread in (self._thread, self._writer):
            if thread is not None:
                thread.join(timeout=30)

    def _write_loop(self) -> None:
        """Write sightings as they come; after a failure, retry every ``interval_s``."""
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                ok = self.flush_sightings()
            except Exception:  # noqa: BLE001 - keep writing; the next round retries
                log.exception("worker_sightings_write_failed")
                ok = False
            if not ok and self._stop.wait(self.interval_s):
                return
            if not ok:
                self._wake.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - keep syncing; the next tick retries
                log.exception("replica_sync_failed")

    def tick(self) -> None:
        """One round: adopt and refresh workers from sightings, unload removed adapters."""
        self._sync_workers()
        self._unload_removed()

    def _sync_workers(self) -> None:
        try:
            sightings = self.store.recent_workers(self.dead_after_s)
        except ControlPlaneError as exc:
            log.warning("worker_sightings_unavailable", error=str(exc))
            return
        known = {v.worker_id: v.addr for v in self.pool.snapshot()}
        for s in sightings:
            hello = membership_pb2.WorkerHello(
                worker_id=s.worker_id, addr=s.addr, model=s.model, model_sha256=s.model_sha256, n_slots=s.n_slots
            )
            if known.get(s.worker_id) == s.addr:
                if s.replica_id != self.store.replica_id:
                    try:
                        self.pool.heartbeat(hello, age_s=s.age_s)
                    except NotFoundError:  # forgotten meanwhile: adopt on the next tick
                        pass
                continue
            try:
                self.pool.register(hello)
                log.info("worker_adopted", worker_id=s.worker_id, addr=s.addr, seen_by=s.replica_id)
            except ControlPlaneError as exc:
                log.warning("worker_adoption_failed", worker_id=s.worker_id, addr=s.addr, error=str(exc))

    def _unload_removed(self) -> None:
        try:
            removed = self.store.removed_ids()
        except ControlPlaneError as exc:
            log.warning("removed_adapters_unavailable", error=str(exc))
            return
        for adapter_id in sorted(removed - self._removed_seen):
            self.pool.adapters.unload_adapter(adapter_id)
            log.info("removed_adapter_unloaded", adapter_id=adapter_id)
        self._removed_seen = removed
