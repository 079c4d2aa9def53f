"""Worker membership: who is alive, what each worker holds, and telling them about adapters.

Owned by the control-plane process. Workers call ``RegisterWorker`` once and ``Heartbeat``
every ``heartbeat_interval_s``; a worker whose last heartbeat is older than
``dead_after_missed × heartbeat_interval_s``, or that failed a call (`mark_failed`), is dead
until its next heartbeat. State is computed from the clock when asked, so no reaper thread
is needed; transitions are logged when first observed.

On registration the control plane dials the worker and reconciles its adapters with the
registry: ones the registry no longer has (or whose content differs) are unloaded. Nothing
is pushed (issue 12): right before the router uses a worker it tells it about the adapters
the request needs that it does not know yet (`ensure_loaded`: a header-only ``LoadAdapter``
with ``fetch_on_demand``, id → sha256), and the worker fetches the bytes by sha256
(``FetchAdapter``) the first time it needs them. Removals are unloaded from every worker that
may hold them. Heartbeats carry what each worker holds (resident in slots, on host) and its
paging counters, so routing can prefer a holder (affinity) on any control plane.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import structlog

from control_plane.errors import InvalidArgumentError, NotFoundError, UnavailableError
from control_plane.registry import AdapterRegistry
from control_plane.store import AdapterRecord
from loraplane.limits import CHUNK_BYTES, GRPC_MESSAGE_OPTIONS
from loraplane.v1 import common_pb2, control_plane_pb2, worker_pb2_grpc

log = structlog.get_logger("control_plane.workers")



@dataclass(frozen=True)
class MembershipTimings:
    """Heartbeat cadence and how long calls to a worker may take.

    Attributes:
        heartbeat_interval_s: what workers are told to use (``WorkerAck``).
        dead_after_missed: a worker is dead after this many intervals without a heartbeat.
        connect_timeout_s: dialing a registering worker.
        load_timeout_s: one ``LoadAdapter`` / ``UnloadAdapter`` call.
    """

    heartbeat_interval_s: float = 1.0
    dead_after_missed: int = 3
    connect_timeout_s: float = 10.0
    load_timeout_s: float = 120.0

    @property
    def dead_after_s(self) -> float:
        return self.heartbeat_interval_s * self.dead_after_missed


@dataclass
class WorkerHandle:
    """One registered worker. Mutable fields change only under `WorkerPool`'s lock.

    Attributes:
        last_heartbeat: ``clock()`` time of the last RegisterWorker/Heartbeat.
        failed: why a call to it failed since that heartbeat (None: no failure).
        adapter_ids: adapters the worker holds, as far as the control plane knows.
        in_flight: Generate calls currently relayed from it.
    """

    worker_id: str
    addr: str
    model: str
    model_sha256: str
    n_slots: int
    channel: grpc.Channel
    stub: worker_pb2_grpc.WorkerStub
    last_heartbeat: float
    failed: str | None = None
    adapter_ids: set[int] = field(default_factory=set)
    in_flight: int = 0
    alive: bool = True
    resident_ids: set[int] = field(default_factory=set)   # in device slots (last heartbeat)
    host_ids: set[int] = field(default_factory=set)       # host tensors (last heartbeat)
    paging: control_plane_pb2.WorkerPaging = field(default_factory=control_plane_pb2.WorkerPaging)
    # One LoadAdapter at a time per worker, so concurrent requests do not push twice.
    load_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


@dataclass(frozen=True)
class WorkerView:
    """A snapshot of one worker for ``ListWorkers``."""

    worker_id: str
    addr: str
    state: str
    last_heartbeat_age_s: float
    adapter_ids: tuple[int, ...]
    model: str
    n_slots: int
    in_flight: int
    paging: control_plane_pb2.WorkerPaging
    resident_ids: tuple[int, ...]
    host_ids: tuple[int, ...]


class WorkerPool:
    """Registered workers, their liveness and the adapters they hold."""

    def __init__(self, registry: AdapterRegistry, timings: MembershipTimings = MembershipTimings(),
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.timings = timings
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: dict[str, WorkerHandle] = {}

    # -- membership RPCs ----------------------------------------------------------------

    def register(self, hello: control_plane_pb2.WorkerHello) -> None:
        """Dial the worker, reconcile its adapters with the registry, mark it alive.

        A worker registering again at the same address keeps its channel, so requests it is
        serving survive (its membership thread restarted, or it missed heartbeats). A new
        address replaces the old handle and closes the old channel.

        Raises:
            InvalidArgumentError: no worker_id or addr.
            UnavailableError: the worker cannot be reached at ``hello.addr``.
        """
        if not hello.worker_id or not hello.addr:
            raise InvalidArgumentError("WorkerHello needs worker_id and addr")
        with self._lock:
            old = self._workers.get(hello.worker_id)
        if old is not None and old.addr == hello.addr:
            handle = old
        else:
            channel = self._dial(hello)
            handle = WorkerHandle(
                worker_id=hello.worker_id, addr=hello.addr, model=hello.model,
                model_sha256=hello.model_sha256, n_slots=hello.n_slots, channel=channel,
                stub=worker_pb2_grpc.WorkerStub(channel), last_heartbeat=self._clock())
        try:
            self._reconcile(handle)
        except BaseException:
            if handle is not old:
                handle.channel.close()
            raise
        with self._lock:
            handle.model, handle.model_sha256, handle.n_slots = hello.model, hello.model_sha256, hello.n_slots
            handle.last_heartbeat = self._clock()
            handle.failed = None
            _note_holdings(handle, hello)
            self._workers[hello.worker_id] = handle
        if old is not None and old is not handle:
            old.channel.close()
        self._refresh()
        log.info("worker_registered", worker_id=hello.worker_id, addr=hello.addr,
                 adapter_ids=sorted(handle.adapter_ids), again=old is not None)

    def _dial(self, hello: control_plane_pb2.WorkerHello) -> grpc.Channel:
        channel = grpc.insecure_channel(hello.addr, options=GRPC_MESSAGE_OPTIONS)
        try:
            grpc.channel_ready_future(channel).result(timeout=self.timings.connect_timeout_s)
        except grpc.FutureTimeoutError:
            channel.close()
            raise UnavailableError(f"worker {hello.worker_id}: cannot reach it at {hello.addr} "
                                   f"within {self.timings.connect_timeout_s:g}s") from None
        return channel

    def heartbeat(self, hello: control_plane_pb2.WorkerHello, *, age_s: float = 0.0) -> None:
        """Record a heartbeat sent ``age_s`` seconds ago (0: now; another replica's sighting,
        `control_plane.replicas`, is older); a dead worker comes back alive.

        Raises:
            NotFoundError: the worker never registered (or the control plane restarted): it
                should call RegisterWorker again.
        """
        with self._lock:
            handle = self._workers.get(hello.worker_id)
            if handle is None:
                known = sorted(self._workers)
                raise NotFoundError(f"worker '{hello.worker_id}' is not registered (call RegisterWorker); "
                                    f"registered workers: {known}")
            handle.last_heartbeat = max(handle.last_heartbeat, self._clock() - age_s)
            handle.failed = None
            if age_s == 0.0:
                _note_holdings(handle, hello)
        self._refresh()

    @property
    def heartbeat_interval_ms(self) -> int:
        return int(round(self.timings.heartbeat_interval_s * 1000))

    # -- liveness -----------------------------------------------------------------------

    def mark_failed(self, worker_id: str, reason: str) -> None:
        """A call to the worker failed: treat it as dead until its next heartbeat."""
        with self._lock:
            handle = self._workers.get(worker_id)
            if handle is not None:
                handle.failed = reason
        self._refresh()

    def live(self) -> list[WorkerHandle]:
        """Workers currently alive, by id."""
        self._refresh()
        with self._lock:
            return [w for _, w in sorted(self._workers.items()) if w.alive]

    def snapshot(self) -> list[WorkerView]:
        self._refresh()
        now = self._clock()
        with self._lock:
            return [WorkerView(w.worker_id, w.addr, "alive" if w.alive else "dead",
                               max(0.0, now - w.last_heartbeat), tuple(sorted(w.adapter_ids)),
                               w.model, w.n_slots, w.in_flight, w.paging,
                               tuple(sorted(w.resident_ids)), tuple(sorted(w.host_ids)))
                    for _, w in sorted(self._workers.items())]

    def _refresh(self) -> None:
        now = self._clock()
        with self._lock:
            for w in self._workers.values():
                alive = w.failed is None and now - w.last_heartbeat <= self.timings.dead_after_s
                if alive != w.alive:
                    w.alive = alive
                    reason = w.failed or f"no heartbeat for {now - w.last_heartbeat:.1f}s"
                    if alive:
                        log.info("worker_alive", worker_id=w.worker_id)
                    else:
                        log.warning("worker_dead", worker_id=w.worker_id, reason=reason)

    # -- in-flight accounting (router) --------------------------------------------------

    def begin(self, handle: WorkerHandle) -> None:
        with self._lock:
            handle.in_flight += 1

    def end(self, handle: WorkerHandle) -> None:
        with self._lock:
            handle.in_flight -= 1

    # -- adapters on workers ------------------------------------------------------------

    def set_pinned(self, record: AdapterRecord) -> None:
        """Tell every live worker that knows ``record`` its new pin flag (failures logged;
        a worker told later gets the flag with the id, `ensure_loaded`)."""
        for w in self.live():
            if record.id not in w.adapter_ids:
                continue
            try:
                w.stub.LoadAdapter(iter([self._header(record)]), timeout=self.timings.load_timeout_s)
            except grpc.RpcError as exc:
                log.warning("adapter_pin_failed", worker_id=w.worker_id, adapter_id=record.id,
                            code=exc.code().name, error=exc.details())

    def unload_adapter(self, adapter_id: int) -> None:
        """Unload a removed adapter from every worker that holds it (failures are logged).

        Live workers are all asked, not only those this replica pushed it to: another
        replica may have pushed it (`control_plane.replicas`); NOT_FOUND means not held."""
        with self._lock:
            holders = [w for w in self._workers.values() if adapter_id in w.adapter_ids or w.alive]
        for w in holders:
            try:
                w.stub.UnloadAdapter(common_pb2.AdapterRef(id=adapter_id), timeout=self.timings.load_timeout_s)
                with self._lock:
                    w.adapter_ids.discard(adapter_id)
                    w.resident_ids.discard(adapter_id)
                    w.host_ids.discard(adapter_id)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    with self._lock:
                        w.adapter_ids.discard(adapter_id)
                        w.resident_ids.discard(adapter_id)
                        w.host_ids.discard(adapter_id)
                    continue
                log.warning("adapter_unload_failed", worker_id=w.worker_id, adapter_id=adapter_id,
                            code=exc.code().name, error=exc.details())

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
                raise UnavailableError(f"worker {w.worker_id}: loading adapter {record.id} failed: "
                                       f"{exc.code().name}: {exc.details()}") from exc
            except OSError as exc:
                raise UnavailableError(f"adapter {record.id}: cannot read '{record.path}' to push it "
                                       f"to worker {w.worker_id}: {exc}") from exc
            with self._lock:
                w.adapter_ids.add(record.id)
        log.info("adapter_announced", worker_id=w.worker_id, adapter_id=record.id)

    @staticmethod
    def _header(record: AdapterRecord) -> common_pb2.AdapterChunk:
        """The header-only ``LoadAdapter`` chunk: id, sha256, name, pin; bytes on demand."""
        return common_pb2.AdapterChunk(id=record.id, sha256=record.sha256, name=record.name,
                                       fetch_on_demand=True, pinned=record.pinned)

    def _chunks(self, record: AdapterRecord) -> Iterator[common_pb2.AdapterChunk]:
        """``AdapterChunk``s of ``record``: the first names id, sha256 and name; every chunk
        carries up to 1 MiB of data."""
        first = True
        for piece in self.registry.read_chunks(record, CHUNK_BYTES):
            if first:
                yield common_pb2.AdapterChunk(id=record.id, sha256=record.sha256, name=record.name, data=piece)
                first = False
            else:
                yield common_pb2.AdapterChunk(data=piece)

    def _reconcile(self, w: WorkerHandle) -> None:
        """Align a (re)registering worker's adapters with the registry: keep what matches,
        unload what the registry no longer has (or holds with other content). Nothing is
        pushed: the router announces adapters when a request needs them."""
        try:
            held = w.stub.ListAdapters(common_pb2.Empty(), timeout=self.timings.load_timeout_s).adapters
        except grpc.RpcError as exc:
            raise UnavailableError(f"worker {w.worker_id}: ListAdapters failed: "
                                   f"{exc.code().name}: {exc.details()}") from exc
        wanted = {r.id: r for r in self.registry.list()}
        kept = {i.id for i in held if i.id in wanted and wanted[i.id].sha256 == i.sha256}
        with self._lock:
            w.adapter_ids = set(kept)
        for info in held:
            if info.id in kept:
                continue
            try:
                w.stub.UnloadAdapter(common_pb2.AdapterRef(id=info.id), timeout=self.timings.load_timeout_s)
            except grpc.RpcError as exc:
                log.warning("adapter_unload_failed", worker_id=w.worker_id, adapter_id=info.id,
                            code=exc.code().name, error=exc.details())

    def close(self) -> None:
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
        for w in workers:
            w.channel.close()


def _note_holdings(handle: WorkerHandle, hello: control_plane_pb2.WorkerHello) -> None:
    """Record what a worker reports holding (caller holds the pool's lock). A hello without
    the paging field (an older worker, or a replica's sighting) leaves the record as it is."""
    if hello.HasField("paging"):
        handle.resident_ids = set(hello.resident_adapter_ids)
        handle.host_ids = set(hello.host_adapter_ids)
        handle.paging = hello.paging
