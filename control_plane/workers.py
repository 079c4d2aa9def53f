"""What the control plane records of each worker: `WorkerHandle` (one registered worker),
`MembershipTimings`, and the read-only views `WorkerView` (``ListWorkers``) and
`WorkerHoldingsView` (the metrics).

`control_plane.membership.WorkerPool` creates and updates the handles (membership, liveness,
relays in flight); `control_plane.announcer.AdapterAnnouncer` updates what each one holds.
Both change a handle's mutable fields only under the pool's lock. The why:
docs/architecture.md (control plane, workers).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import grpc

from loraplane.queue_shares import Share, gives_way
from loraplane.v1 import common_pb2, membership_pb2, worker_pb2_grpc


@dataclass(frozen=True)
class MembershipTimings:
    """Heartbeat cadence and how long calls to a worker may take.

    Attributes:
        heartbeat_interval_s: what workers are told to use (``WorkerAck``).
        dead_after_missed: a worker is dead after this many intervals without a heartbeat.
        connect_timeout_s: dialing a registering worker, and its ``Stats`` and
            ``ListAdapters`` calls (in a join thread).
        load_timeout_s: one ``LoadAdapter`` call (an announcement or a pin change).
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
        """Seconds without a heartbeat after which a worker is dead."""
        return self.heartbeat_interval_s * self.dead_after_missed


@dataclass
class WorkerHandle:
    """One registered worker. Mutable fields change only under `WorkerPool`'s lock (which
    `AdapterAnnouncer` shares).

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
    paging: common_pb2.WorkerPaging = field(default_factory=common_pb2.WorkerPaging)
    pinned_ids: set[int] = field(default_factory=set)  # in device slots, pinned (last heartbeat)
    kv_cells: tuple[int, int] = (0, 0)  # KV cells used by running requests, total (last heartbeat)

    @property
    def capacity(self) -> int | None:
        """Requests it admits at once (slots + queue limit); None when unknown."""
        return None if self.queue_limit is None else self.n_slots + self.queue_limit

    # One LoadAdapter at a time per worker, so concurrent requests do not announce twice.
    load_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count_tenant(self, token: int, tenant: Share) -> None:
        """Count relay ``token`` for ``tenant`` (caller holds the pool's lock)."""
        held = self.tenants.get(tenant.name)
        self.tenants[tenant.name] = replace(tenant, requests=(held.requests if held else 0) + 1)
        self.relay_tenants[token] = tenant.name

    def uncount_tenant(self, token: int) -> None:
        """Relay ``token`` is over: its tenant's count drops, the tenant goes at 0 (caller
        holds the pool's lock; a token counted for no tenant changes nothing)."""
        name = self.relay_tenants.pop(token, None)
        held = self.tenants.get(name) if name is not None else None
        if held is not None and held.requests > 1:
            self.tenants[held.name] = replace(held, requests=held.requests - 1)
        elif held is not None:
            del self.tenants[held.name]

    def has_room_for(self, tenant: Share) -> bool:
        """Whether one more request of ``tenant`` (``requests`` ignored) may be relayed here
        (caller holds the pool's lock): fewer relays in flight than slots + queue limit
        (unknown: yes), or, full but sharing its queue between tenants, another tenant here
        gives way to it (`loraplane.queue_shares.gives_way`)."""
        if self.capacity is None or self.in_flight < self.capacity:
            return True
        if not self.shares_queue:
            return False
        held = self.tenants.get(tenant.name)
        newcomer = replace(tenant, requests=held.requests if held else 0)
        return any(gives_way(h, newcomer) for name, h in self.tenants.items() if name != tenant.name)

    def note_paging(self, hello: membership_pb2.WorkerHello) -> None:
        """Record what the worker reports holding in slots and its host tier, and its KV cells
        (caller holds the pool's lock). A hello without ``paging`` (an older worker, or another
        replica's sighting) leaves the record as it is."""
        if hello.HasField("paging"):
            self.resident_ids = set(hello.resident_adapter_ids)
            self.host_ids = set(hello.host_adapter_ids)
            self.paging = hello.paging
            self.pinned_ids = set(hello.pinned_adapter_ids)
            self.kv_cells = (hello.kv_cells_used, hello.kv_cells_total)


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
    paging: common_pb2.WorkerPaging = field(default_factory=common_pb2.WorkerPaging)
    resident_ids: tuple[int, ...] = ()
    host_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, w: WorkerHandle, now: float) -> WorkerView:
        """``w`` as ``ListWorkers`` shows it at clock time ``now`` (caller holds the pool's lock)."""
        return cls(
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


@dataclass(frozen=True)
class WorkerHoldingsView:
    """One alive worker's last reported holdings (for the metrics): adapter ids in device
    slots, in the host tier, pinned in slots, and KV cells (used by running requests, total)."""

    worker_id: str
    resident_ids: frozenset[int]
    host_ids: frozenset[int]
    pinned_ids: frozenset[int]
    kv_cells: tuple[int, int]

    @classmethod
    def of(cls, w: WorkerHandle) -> WorkerHoldingsView:
        """``w``'s last reported holdings (caller holds the pool's lock)."""
        return cls(w.worker_id, frozenset(w.resident_ids), frozenset(w.host_ids), frozenset(w.pinned_ids), w.kv_cells)
