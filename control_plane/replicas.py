"""Keeping one control-plane replica in step with the others through the shared store.

Owned by the control-plane process: one `ReplicaSync` per process, one daemon thread.
Replicas share nothing but the database (`control_plane.store`). Adapters and the default
set need no syncing: every read goes to the database. Two things live in each replica's
memory and are synced here, every ``interval_s`` (the heartbeat interval):

**Worker membership.** A worker's ``RegisterWorker``/``Heartbeat`` reaches one replica (one
Service address: whichever pod its connection landed on) or every replica (a comma-separated
``--control-plane`` list). The replica that receives it records a sighting in the store
(`record`). Every replica then, each tick, reads the sightings younger than the
dead-after time (``dead_after_missed × heartbeat_interval``):

- a worker it does not know (or knows at another address) is *adopted*: dialled and
  reconciled exactly as if it had registered here (`WorkerPool.register`);
- a worker it knows counts as heartbeating, as of the sighting's age
  (`WorkerPool.heartbeat` with ``age_s``), unless this replica wrote that sighting itself
  (it has already seen that heartbeat).

So membership converges within one tick plus a dial after a worker's first heartbeat
anywhere; a worker that stops heartbeating everywhere is dead on every replica within the
dead-after time after its last sighting. With a single Service address, a worker whose
replica dies reconnects (gRPC re-resolves; kube-proxy picks a live pod) and its next
heartbeat reaches a replica that already adopted it, or gets NOT_FOUND and re-registers.

**Adapters held by workers.** An unregistration through replica A unloads the adapter from
the workers A knows hold it at once; the store also records the removal, and every replica
unloads each newly removed id from every worker it knows (NOT_FOUND counts as done), so an
adapter that replica B announced is unloaded too, whichever replica took the call.

Failures of one tick (database unreachable, a worker that cannot be dialled) are logged and
retried on the next tick.
"""

from __future__ import annotations

import threading

import structlog

from control_plane.errors import ControlPlaneError, NotFoundError
from control_plane.store import AdapterStore
from control_plane.workers import WorkerPool
from loraplane.v1 import control_plane_pb2

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

    def record(self, hello: control_plane_pb2.WorkerHello) -> None:
        """A worker registered with or heartbeated this replica: tell the others (failures
        are logged: the worker's own membership here is unaffected)."""
        try:
            self.store.record_worker(
                worker_id=hello.worker_id,
                addr=hello.addr,
                model=hello.model,
                model_sha256=hello.model_sha256,
                n_slots=hello.n_slots,
            )
        except ControlPlaneError as exc:
            log.warning("worker_sighting_not_recorded", worker_id=hello.worker_id, error=str(exc))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="replica-sync", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

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
            hello = control_plane_pb2.WorkerHello(
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
            self.pool.unload_adapter(adapter_id)
            log.info("removed_adapter_unloaded", adapter_id=adapter_id)
        self._removed_seen = removed
