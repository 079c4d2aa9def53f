"""Worker membership: who is alive, what each worker holds, and telling them about adapters.

Owned by the control-plane process. Workers call ``RegisterWorker`` once and ``Heartbeat``
every ``heartbeat_interval_s``; a worker whose last heartbeat is older than
``dead_after_missed × heartbeat_interval_s``, or that failed a call (`mark_failed`), is dead
until its next heartbeat. State is computed from the clock when asked; transitions are logged
when first observed. The router registers a cancel for every relay in flight (`begin`); when a
worker is found dead those cancels run at once (outside the lock), so a stopped or hung worker
never holds its clients. Since nobody may ask while every client is blocked on that worker, a
watchdog thread (started with the first relay) asks every half heartbeat interval (≤ 0.5 s).

Joining is asynchronous: ``RegisterWorker`` only checks the hello and queues a join, then
answers (``joined=false``); one of `MembershipTimings.join_threads` join threads dials the
worker (at most ``connect_timeout_s``) and reconciles its adapters with the registry: ones the
registry no longer has (or whose content differs) are unloaded. No bytes are sent:
right before the router uses a worker it announces the adapters the request needs that the
worker does not know yet (`ensure_loaded`: a header-only ``LoadAdapter`` with
``fetch_on_demand``, id → sha256, pin flag), and the worker fetches the bytes by sha256
(``FetchAdapter``) the first time it needs them. Only then is the worker
listed and routable; its heartbeats answer ``joined=true`` from then on. At most
``max_pending_joins`` joins wait at once (RESOURCE_EXHAUSTED beyond), so a flood of
registrations naming unreachable addresses costs join threads, never handler threads.

Trust: with a worker secret configured (``trusted``) every membership call that reaches the
pool has proved it, and a worker id may move to a new address (a restarted worker). Without
one, a worker id that is alive at one address cannot be registered or heartbeated from
another (PERMISSION_DENIED) until it is dead.

Reconciliation from heartbeats: workers report what they hold (``WorkerHello.holdings``); the
pool's view follows the report (an adapter unloaded behind our back is announced again when next
needed), adapters the registry no longer has are unloaded in the background, and adapters
still draining after an unregister are listed under ``draining_ids`` until the worker frees
them. Heartbeats also carry what each worker holds in its slots and host cache and its paging
counters (``resident_adapter_ids``, ``host_adapter_ids``, ``paging``), so routing can prefer a
holder (affinity) on any control plane.

Liveness never waits for the database: membership lives in memory, a heartbeat is recorded
before anything else, and the reconciliation its report asks for (which reads the registry)
runs on a thread of its own (`_reconcile_due`, latest report per worker, one registry read
per round), so a database outage neither delays a heartbeat's answer nor makes a worker look
dead. A join during an outage skips the registry check (the worker's heartbeats reconcile it
once the database answers again).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import grpc
import structlog

from control_plane.errors import (
    ControlPlaneError,
    DatabaseUnavailableError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
)
from control_plane.registry import AdapterRegistry
from control_plane.store import AdapterRecord
from loraplane.limits import GRPC_MESSAGE_OPTIONS
from loraplane.queue_shares import Share, gives_way
from loraplane.v1 import common_pb2, control_plane_pb2, worker_pb2_grpc
from loraplane.worker_secret import with_secret

log = structlog.get_logger("loraplane.control_plane.workers")


@dataclass(frozen=True)
class MembershipTimings:
    """Heartbeat cadence and how long calls to a worker may take.

    Attributes:
        heartbeat_interval_s: what workers are told to use (``WorkerAck``).
        dead_after_missed: a worker is dead after this many intervals without a heartbeat.
        connect_timeout_s: dialing a registering worker (in a join thread).
        load_timeout_s: one ``LoadAdapter`` call, and ``ListAdapters`` during a join.
        unload_wait_s: one ``UnloadAdapter`` call: how long a worker may drain before the
            adapter is reported as draining instead (the worker frees it once idle).
        join_threads: workers dialed / reconciled at once.
        max_pending_joins: joins queued or running at once; more → RESOURCE_EXHAUSTED.
    """

    heartbeat_interval_s: float = 1.0
    dead_after_missed: int = 3
    connect_timeout_s: float = 5.0
    load_timeout_s: float = 120.0
    unload_wait_s: float = 5.0
    join_threads: int = 4
    max_pending_joins: int = 16

    @property
    def dead_after_s(self) -> float:
        return self.heartbeat_interval_s * self.dead_after_missed


@dataclass
class WorkerHandle:
    """One registered worker. Mutable fields change only under `WorkerPool`'s lock.

    Attributes:
        last_heartbeat: ``clock()`` time of the last RegisterWorker/Heartbeat.
        failed: why a call to it failed since that heartbeat (None: no failure).
        adapter_ids: adapters the worker holds, as far as the control plane knows (its last
            heartbeat, plus what was announced since).
        draining_ids: unregistered adapters the worker is still draining.
        in_flight: Generate calls currently relayed from it.
        relays: the cancel callbacks of those relays that registered one (`WorkerPool.begin`),
            by token; all of them are called, and dropped, when the worker is declared dead.
        tenants: those relays by tenant: how many, the tenant's weight and priority.
        n_ctx: its KV tokens per slot, as its hello reported (0: not reported).
        queue_limit: requests it queues beyond its slots (None: an older worker, unknown).
        incarnation: random per worker process; a new one at the same id is a restart.
        restarts: how many times this worker id came back as a new process: new incarnations
            seen here, or the supervisor's count (``WorkerHello.supervisor_restarts``: ``serve``
            also counts restarts that died before registering) when that is higher.
        draining: its last heartbeat said it is shutting down (SIGTERM): alive and listed,
            but not routed to (`WorkerPool.live`).
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
    draining_ids: set[int] = field(default_factory=set)
    in_flight: int = 0
    relays: dict[int, Callable[[str], None]] = field(default_factory=dict, repr=False)
    # queue shares (`WorkerPool.has_room`): whether it shares its queue between tenants (its
    # --fairness vtc), its relays in flight by tenant, and each relay token's tenant
    shares_queue: bool = False
    tenants: dict[str, Share] = field(default_factory=dict, repr=False)
    relay_tenants: dict[int, str] = field(default_factory=dict, repr=False)
    n_ctx: int = 0  # KV tokens per slot (0: not reported)
    alive: bool = True
    queue_limit: int | None = None
    incarnation: str = ""
    restarts: int = 0
    draining: bool = False
    loaded_at: dict[int, float] = field(default_factory=dict, repr=False)
    unloading: set[int] = field(default_factory=set, repr=False)
    resident_ids: set[int] = field(default_factory=set)  # in device slots (last heartbeat)
    host_ids: set[int] = field(default_factory=set)  # in the host tier (last heartbeat)
    paging: control_plane_pb2.WorkerPaging = field(default_factory=control_plane_pb2.WorkerPaging)
    pinned_ids: set[int] = field(default_factory=set)  # in device slots, pinned (last heartbeat)
    kv_cells: tuple[int, int] = (0, 0)  # KV cells used by running requests, total (last heartbeat)

    @property
    def capacity(self) -> int | None:
        """Requests it admits at once (slots + queue limit); None when unknown."""
        return None if self.queue_limit is None else self.n_slots + self.queue_limit

    # One LoadAdapter at a time per worker, so concurrent requests do not announce twice.
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
    restarts: int = 0
    draining_adapter_ids: tuple[int, ...] = ()
    paging: control_plane_pb2.WorkerPaging = field(default_factory=control_plane_pb2.WorkerPaging)
    resident_ids: tuple[int, ...] = ()
    host_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class WorkerHoldingsView:
    """One alive worker's last reported holdings (for the metrics): adapter ids in device
    slots, in the host tier, pinned in slots, and KV cells (used by running requests, total)."""

    worker_id: str
    resident_ids: frozenset[int]
    host_ids: frozenset[int]
    pinned_ids: frozenset[int]
    kv_cells: tuple[int, int]


class WorkerPool:
    """Registered workers, their liveness and the adapters they hold.

    Args:
        secret: the worker secret the server checks on membership calls (None: membership
            is open, so addresses of live workers are pinned); also sent on every Worker RPC.
    """

    def __init__(
        self,
        registry: AdapterRegistry,
        timings: MembershipTimings = MembershipTimings(),
        *,
        clock: Callable[[], float] = time.monotonic,
        secret: str | None = None,
    ) -> None:
        self.registry = registry
        self.timings = timings
        self.trusted = secret is not None
        self._secret = secret
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: dict[str, WorkerHandle] = {}
        self._joining: dict[str, str] = {}  # worker id → address being joined
        self._joins = concurrent.futures.ThreadPoolExecutor(timings.join_threads, thread_name_prefix="cp-join")
        self._unloads = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="cp-unload")
        # Heartbeat reports waiting to be reconciled: worker id → (handle, holdings).
        self._holdings_due: dict[str, tuple[WorkerHandle, control_plane_pb2.WorkerHoldings]] = {}
        self._holdings_scheduled = False
        self._holdings_failing = False
        self._reconciler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cp-holdings")
        self._tokens = itertools.count(1)
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None
        # Called (under the pool's lock, so it must not block) with each heartbeat's per-adapter
        # paging counters: (worker id, incarnation, counts) — the metrics turn them into counters.
        self.on_paging: Callable[[str, str, Sequence[control_plane_pb2.AdapterPagingCount]], None] | None = None

    # -- membership RPCs ----------------------------------------------------------------

    def register(self, hello: control_plane_pb2.WorkerHello) -> bool:
        """Queue a join of ``hello``'s worker (dial, reconcile adapters, mark alive); True
        when it is already joined at this address (nothing to do).

        Raises:
            InvalidArgumentError: no worker_id or addr.
            PermissionDeniedError: untrusted membership, and the id is alive (or joining) at
                another address.
            ResourceExhaustedError: ``max_pending_joins`` joins are already pending.
        """
        if not hello.worker_id or not hello.addr:
            raise InvalidArgumentError("WorkerHello needs worker_id and addr")
        self._refresh()
        with self._lock:
            old = self._workers.get(hello.worker_id)
            joining = self._joining.get(hello.worker_id)
            if joining == hello.addr:
                return False
            if not self.trusted:
                self._check_not_taken(hello, old, joining)
            if len(self._joining) >= self.timings.max_pending_joins:
                raise ResourceExhaustedError(
                    f"worker {hello.worker_id}: {len(self._joining)} worker joins already pending "
                    f"(limit {self.timings.max_pending_joins}); retry later"
                )
            self._joining[hello.worker_id] = hello.addr
        copy = control_plane_pb2.WorkerHello()
        copy.CopyFrom(hello)
        self._joins.submit(self._join, copy)
        log.info("worker_join_queued", worker_id=hello.worker_id, addr=hello.addr)
        return False

    @staticmethod
    def _check_not_taken(hello: control_plane_pb2.WorkerHello, old: WorkerHandle | None, joining: str | None) -> None:
        if old is not None and old.alive and old.addr != hello.addr:
            raise PermissionDeniedError(
                f"worker id '{hello.worker_id}' is alive at {old.addr}; it cannot be registered from "
                f"{hello.addr} without the worker secret (or before it is dead)"
            )
        if joining is not None and joining != hello.addr:
            raise PermissionDeniedError(
                f"worker id '{hello.worker_id}' is joining from {joining}; it cannot be registered "
                f"from {hello.addr} without the worker secret"
            )

    def _join(self, hello: control_plane_pb2.WorkerHello) -> None:
        """Join-thread body: dial, reconcile, install; failures are logged (the worker's next
        heartbeat gets NOT_FOUND and it registers again)."""
        try:
            self._join_now(hello)
        except ControlPlaneError as exc:
            log.warning("worker_join_failed", worker_id=hello.worker_id, addr=hello.addr, error=str(exc))
        except Exception:  # noqa: BLE001 - a join thread must never die silently
            log.exception("worker_join_failed", worker_id=hello.worker_id, addr=hello.addr)
        finally:
            with self._lock:
                if self._joining.get(hello.worker_id) == hello.addr:
                    del self._joining[hello.worker_id]

    def _join_now(self, hello: control_plane_pb2.WorkerHello) -> None:
        """Dial the worker, reconcile its adapters with the registry, mark it alive.

        A worker registering again at the same address keeps its channel, so requests it is
        serving survive (its membership thread restarted, or it missed heartbeats). A new
        address replaces the old handle and closes the old channel.

        Raises:
            UnavailableError: the worker cannot be reached at ``hello.addr``.
        """
        with self._lock:
            old = self._workers.get(hello.worker_id)
        if old is not None and old.addr == hello.addr:
            handle = old
        else:
            channel = self._dial(hello)
            handle = WorkerHandle(
                worker_id=hello.worker_id,
                addr=hello.addr,
                model=hello.model,
                model_sha256=hello.model_sha256,
                n_slots=hello.n_slots,
                channel=channel,
                stub=worker_pb2_grpc.WorkerStub(with_secret(channel, self._secret)),
                last_heartbeat=self._clock(),
            )
        try:
            self._reconcile(handle)
        except BaseException:
            if handle is not old:
                handle.channel.close()
            raise
        shares = self._shares_queue(handle)
        restarted = (
            old is not None
            and bool(hello.incarnation)
            and old.incarnation != hello.incarnation
            and bool(old.incarnation)
        )
        with self._lock:
            handle.model, handle.model_sha256, handle.n_slots = hello.model, hello.model_sha256, hello.n_slots
            handle.queue_limit = hello.queue_limit if hello.HasField("queue_limit") else None
            handle.n_ctx = hello.n_ctx
            handle.restarts = max((old.restarts if old is not None else 0) + int(restarted), hello.supervisor_restarts)
            handle.incarnation = hello.incarnation
            handle.draining = hello.draining
            handle.shares_queue = shares
            handle.last_heartbeat = self._clock()
            handle.failed = None
            _note_holdings(handle, hello)
            self._paging_reported(handle, hello)
            self._workers[hello.worker_id] = handle
        if old is not None and old is not handle:
            old.channel.close()
        self._refresh()
        log.info(
            "worker_restarted" if restarted else "worker_registered",
            worker_id=hello.worker_id,
            addr=hello.addr,
            adapter_ids=sorted(handle.adapter_ids),
            again=old is not None,
            restarts=handle.restarts,
        )

    def _shares_queue(self, handle: WorkerHandle) -> bool:
        """Whether the worker shares its queue between tenants (``--fairness vtc`` in its
        ``Stats``); False when it cannot say (an older worker, or the call failed)."""
        try:
            return handle.stub.Stats(common_pb2.Empty(), timeout=self.timings.connect_timeout_s).fairness == "vtc"
        except grpc.RpcError as exc:
            log.info("worker_stats_unavailable", worker_id=handle.worker_id, error=exc.code().name)
            return False

    def _dial(self, hello: control_plane_pb2.WorkerHello) -> grpc.Channel:
        channel = grpc.insecure_channel(hello.addr, options=GRPC_MESSAGE_OPTIONS)
        try:
            grpc.channel_ready_future(channel).result(timeout=self.timings.connect_timeout_s)
        except grpc.FutureTimeoutError:
            channel.close()
            raise UnavailableError(
                f"worker {hello.worker_id}: cannot reach it at {hello.addr} within {self.timings.connect_timeout_s:g}s"
            ) from None
        return channel

    def heartbeat(self, hello: control_plane_pb2.WorkerHello, *, age_s: float = 0.0) -> bool:
        """Record a heartbeat sent ``age_s`` seconds ago (0: now; another replica's sighting,
        `control_plane.replicas`, is older) — a dead worker comes back alive — and reconcile
        what it reports holding; True when the worker is joined, False while its join is pending.

        Raises:
            NotFoundError: the worker never registered (or the control plane restarted, or its
                join failed): it should call RegisterWorker again.
            PermissionDeniedError: untrusted membership, and the id is registered at another
                address.
        """
        with self._lock:
            handle = self._workers.get(hello.worker_id)
            joining = self._joining.get(hello.worker_id)
            if handle is None or handle.addr != hello.addr:
                if joining == hello.addr:
                    return False
                if handle is not None and not self.trusted:
                    raise PermissionDeniedError(
                        f"worker id '{hello.worker_id}' is registered at {handle.addr}, not {hello.addr}; "
                        f"heartbeats from another address need the worker secret"
                    )
                known = sorted(self._workers)
                raise NotFoundError(
                    f"worker '{hello.worker_id}' is not registered at {hello.addr} "
                    f"(call RegisterWorker); registered workers: {known}"
                )
            handle.last_heartbeat = max(handle.last_heartbeat, self._clock() - age_s)
            handle.failed = None
            if age_s == 0.0:
                _note_holdings(handle, hello)
                self._paging_reported(handle, hello)
                handle.restarts = max(handle.restarts, hello.supervisor_restarts)
                if hello.draining and not handle.draining:
                    log.info("worker_draining", worker_id=handle.worker_id, in_flight=handle.in_flight)
                handle.draining = hello.draining
        self._refresh()
        if hello.HasField("holdings"):
            self._queue_holdings(handle, hello.holdings)
        return True

    def _queue_holdings(self, handle: WorkerHandle, holdings: control_plane_pb2.WorkerHoldings) -> None:
        """Hand a heartbeat's report to the reconciler thread (the newest report per worker
        replaces an older one still waiting)."""
        copy = control_plane_pb2.WorkerHoldings()
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
        self, w: WorkerHandle, holdings: control_plane_pb2.WorkerHoldings, registered: dict[int, str]
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

    def _paging_reported(self, handle: WorkerHandle, hello: control_plane_pb2.WorkerHello) -> None:
        """Hand a heartbeat's per-adapter paging counters to ``on_paging`` (caller holds the
        lock); a hello without ``paging`` (another replica's sighting) carries none."""
        if self.on_paging is not None and hello.HasField("paging"):
            self.on_paging(handle.worker_id, hello.incarnation, hello.adapter_paging)

    def holdings(self) -> list[WorkerHoldingsView]:
        """What each alive worker (draining included: it still holds cache and adapters)
        reported on its last heartbeat, by id."""
        self._refresh()
        with self._lock:
            return [
                WorkerHoldingsView(
                    w.worker_id, frozenset(w.resident_ids), frozenset(w.host_ids), frozenset(w.pinned_ids), w.kv_cells
                )
                for _, w in sorted(self._workers.items())
                if w.alive
            ]

    def live(self) -> list[WorkerHandle]:
        """Workers currently alive and not draining (the ones to route to), by id."""
        self._refresh()
        with self._lock:
            return [w for _, w in sorted(self._workers.items()) if w.alive and not w.draining]

    def max_n_ctx(self) -> int | None:
        """The largest KV context per slot (tokens) among live workers that report one; None
        when none does. A prompt of at least this many tokens can run nowhere."""
        return max((w.n_ctx for w in self.live() if w.n_ctx > 0), default=None)

    def snapshot(self) -> list[WorkerView]:
        self._refresh()
        now = self._clock()
        with self._lock:
            return [
                WorkerView(
                    w.worker_id,
                    w.addr,
                    ("draining" if w.draining else "alive") if w.alive else "dead",
                    max(0.0, now - w.last_heartbeat),
                    tuple(sorted(w.adapter_ids)),
                    w.model,
                    w.n_slots,
                    w.in_flight,
                    w.restarts,
                    tuple(sorted(w.draining_ids)),
                    w.paging,
                    tuple(sorted(w.resident_ids)),
                    tuple(sorted(w.host_ids)),
                )
                for _, w in sorted(self._workers.items())
            ]

    def _refresh(self) -> None:
        """Recompute every worker's liveness from the clock, log transitions, and cancel the
        relays in flight to a worker declared dead for silence (no heartbeat for
        ``dead_after_s``; `begin`): a stopped (SIGSTOP) or hung worker holds no client beyond
        that moment. A worker only marked failed (one call's error) keeps its other relays.
        The cancels run outside the lock."""
        now = self._clock()
        to_cancel: list[tuple[WorkerHandle, str, list[Callable[[str], None]]]] = []
        with self._lock:
            for w in self._workers.values():
                alive = w.failed is None and now - w.last_heartbeat <= self.timings.dead_after_s
                reason = w.failed or f"no heartbeat for {now - w.last_heartbeat:.1f} s"
                if alive != w.alive:
                    w.alive = alive
                    if alive:
                        log.info("worker_alive", worker_id=w.worker_id)
                    else:
                        log.warning("worker_dead", worker_id=w.worker_id, reason=reason, in_flight=w.in_flight)
                # Only silence cuts a worker's streams: a worker marked failed by one call
                # (an error on one request) still heartbeats, and its other streams are
                # healthy; they end on their own if it is really broken.
                silent = now - w.last_heartbeat > self.timings.dead_after_s
                if silent and w.relays:
                    to_cancel.append((w, f"no heartbeat for {now - w.last_heartbeat:.1f} s", list(w.relays.values())))
                    w.relays.clear()
        for w, reason, cancels in to_cancel:
            log.warning("worker_dead_relays_cancelled", worker_id=w.worker_id, relays=len(cancels), reason=reason)
            for cancel in cancels:
                try:
                    cancel(reason)
                except Exception:  # noqa: BLE001 - one relay's cancel must not stop the others'
                    log.exception("relay_cancel_failed", worker_id=w.worker_id)

    def _watch(self) -> None:
        """Watchdog-thread body: liveness is otherwise computed only when asked (a call, a
        heartbeat), so with clients blocked on a stopped worker and no other traffic nobody
        would ask; this asks every ``heartbeat_interval_s / 2`` (0.05–0.5 s), so relays to a
        worker are cancelled within that much of its ``dead_after_s``."""
        period = min(0.5, max(0.05, self.timings.heartbeat_interval_s / 2))
        while not self._closed.wait(period):
            try:
                self._refresh()
            except Exception:  # noqa: BLE001 - the watchdog must outlive one bad pass
                log.exception("worker_watchdog_failed")

    def _start_watchdog(self) -> None:
        """Start `_watch` once, on the first relay that registers a cancel."""
        with self._lock:
            if self._watchdog is not None or self._closed.is_set():
                return
            self._watchdog = threading.Thread(target=self._watch, name="cp-worker-watchdog", daemon=True)
        self._watchdog.start()

    # -- in-flight accounting (router) --------------------------------------------------

    def begin(
        self, handle: WorkerHandle, cancel: Callable[[str], None] | None = None, *, tenant: Share | None = None
    ) -> int:
        """One more request relayed from ``handle``; returns the token `end` takes.

        ``cancel(reason)``, when given, is called once (from the thread that notices, outside
        the pool's lock) if the worker is declared dead while the relay runs — no heartbeat
        for ``dead_after_s`` (a stopped or hung process), or `mark_failed` — with the reason
        (``"no heartbeat for 3.2 s"``); on the watchdog's next pass (`_watch`) when it is
        already dead. It must cancel the worker call and not block. `end` unregisters it.
        ``tenant``: the request's tenant (name, weight, priority), counted for `has_room`."""
        token = next(self._tokens)
        with self._lock:
            handle.in_flight += 1
            if cancel is not None:
                handle.relays[token] = cancel
            if tenant is not None:
                held = handle.tenants.get(tenant.name)
                handle.tenants[tenant.name] = replace(tenant, requests=(held.requests if held else 0) + 1)
                handle.relay_tenants[token] = tenant.name
        if cancel is not None:
            self._start_watchdog()
        return token

    def end(self, handle: WorkerHandle, token: int | None = None) -> None:
        """The relay `begin` returned ``token`` for is over: one fewer in flight, its cancel
        dropped. Call exactly once per `begin`."""
        with self._lock:
            handle.in_flight -= 1
            if token is not None:
                handle.relays.pop(token, None)
                name = handle.relay_tenants.pop(token, None)
                held = handle.tenants.get(name) if name is not None else None
                if held is not None and held.requests > 1:
                    handle.tenants[held.name] = replace(held, requests=held.requests - 1)
                elif held is not None:
                    del handle.tenants[held.name]

    def has_room(self, handle: WorkerHandle, tenant: Share) -> bool:
        """Whether ``handle`` can take one more request of ``tenant`` (``requests`` ignored):
        fewer relays from here in flight than its slots + queue limit (unknown: yes), or, full
        but sharing its queue between tenants (``--fairness vtc``), another tenant there gives
        way to it (`loraplane.queue_shares`: the worker then evicts that tenant's newest queued
        request, or refuses if its own count says otherwise)."""
        with self._lock:
            if handle.capacity is None or handle.in_flight < handle.capacity:
                return True
            if not handle.shares_queue:
                return False
            held = handle.tenants.get(tenant.name)
            newcomer = replace(tenant, requests=held.requests if held else 0)
            return any(gives_way(h, newcomer) for name, h in handle.tenants.items() if name != tenant.name)

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
                log.warning(
                    "adapter_pin_failed",
                    worker_id=w.worker_id,
                    adapter_id=record.id,
                    code=exc.code().name,
                    error=exc.details(),
                )

    def unload_adapter(self, adapter_id: int) -> None:
        """Unload a removed adapter from every worker that may hold it, in parallel, waiting at
        most ``unload_wait_s`` (+1 s) in all. Live workers are all asked, not only those this
        replica announced it to: another replica may have announced it (`control_plane.replicas`);
        NOT_FOUND means not held. A worker still draining it then lists it under
        ``draining_ids`` until its heartbeats say it is freed; other failures are logged and
        retried by heartbeat reconciliation."""
        with self._lock:
            holders = [
                w
                for w in self._workers.values()
                if (adapter_id in w.adapter_ids or w.alive) and adapter_id not in w.unloading
            ]
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

    def _reconcile(self, w: WorkerHandle) -> None:
        """Align a (re)registering worker's adapters with the registry: keep what matches,
        unload what the registry no longer has (or holds with other content). No bytes are
        sent: the router announces adapters when a request needs them."""
        try:
            held = w.stub.ListAdapters(common_pb2.Empty(), timeout=self.timings.connect_timeout_s).adapters
        except grpc.RpcError as exc:
            raise UnavailableError(
                f"worker {w.worker_id}: ListAdapters failed: {exc.code().name}: {exc.details()}"
            ) from exc
        try:
            wanted = {r.id: r for r in self.registry.list()}
        except DatabaseUnavailableError as exc:
            # The database is down: join anyway, believing the worker holds nothing (requests
            # announce what they need; its heartbeats unload what is stale once it answers).
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

    def close(self) -> None:
        self._closed.set()
        self._joins.shutdown(wait=False, cancel_futures=True)
        self._unloads.shutdown(wait=False, cancel_futures=True)
        self._reconciler.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
        for w in workers:
            w.channel.close()


def _note_holdings(handle: WorkerHandle, hello: control_plane_pb2.WorkerHello) -> None:
    """Record what a worker reports holding in slots and its host tier (caller holds the pool's
    lock). A hello without ``paging`` (an older worker, or another replica's sighting) leaves
    the record as it is."""
    if hello.HasField("paging"):
        handle.resident_ids = set(hello.resident_adapter_ids)
        handle.host_ids = set(hello.host_adapter_ids)
        handle.paging = hello.paging
        handle.pinned_ids = set(hello.pinned_adapter_ids)
        handle.kv_cells = (hello.kv_cells_used, hello.kv_cells_total)
