"""Worker membership: who is registered, who is alive, and what is relayed to each.

`WorkerPool` serves ``RegisterWorker`` (a join queued for a join thread: dial, reconcile the
worker's adapters, list it) and ``Heartbeat``; computes liveness from the clock (a watchdog
thread cancels the relays of a worker that went silent); honours drain; counts the relays in
flight per worker and tenant (`begin`, `end`, `has_room`); and gives the views ``ListWorkers``
and the metrics read. What workers hold of the registry's adapters is its ``adapters``
(`control_plane.announcer.AdapterAnnouncer`); the records are in `control_plane.workers`.
The why (asynchronous joins, trust, liveness never waiting for the database):
docs/architecture.md, "Workers: membership and announcing".
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable, Sequence

import grpc
import structlog

from control_plane.announcer import AdapterAnnouncer
from control_plane.errors import (
    ControlPlaneError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
)
from control_plane.registry import AdapterRegistry
from control_plane.workers import MembershipTimings, WorkerHandle, WorkerHoldingsView, WorkerView
from loraplane.limits import GRPC_MESSAGE_OPTIONS
from loraplane.queue_shares import Share
from loraplane.v1 import common_pb2, membership_pb2, worker_pb2_grpc
from loraplane.worker_secret import with_secret

log = structlog.get_logger("loraplane.control_plane.membership")

DEFAULT_TIMINGS = MembershipTimings()


class WorkerPool:
    """Registered workers, their liveness and the relays in flight to each.

    What the workers hold of the registry's adapters, and telling them, is ``adapters``
    (`AdapterAnnouncer`, sharing this pool's lock): the router calls
    ``pool.adapters.ensure_loaded``, removal ``pool.adapters.unload_adapter``.

    Args:
        registry: the adapters a joining worker's holdings are reconciled against.
        timings: heartbeat cadence and call deadlines.
        clock: seconds, monotonic (tests pass their own).
        secret: the worker secret the server checks on membership calls (None: membership
            is open, so addresses of live workers are pinned); also sent on every Worker RPC.
    """

    def __init__(
        self,
        registry: AdapterRegistry,
        timings: MembershipTimings = DEFAULT_TIMINGS,
        *,
        clock: Callable[[], float] = time.monotonic,
        secret: str | None = None,
    ) -> None:
        self.timings = timings
        self.trusted = secret is not None
        self._secret = secret
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: dict[str, WorkerHandle] = {}
        self._joining: dict[str, str] = {}  # worker id → address being joined
        self._joins = concurrent.futures.ThreadPoolExecutor(timings.join_threads, thread_name_prefix="cp-join")
        self.adapters = AdapterAnnouncer(registry, timings, lock=self._lock, workers=self.handles, clock=clock)
        self._tokens = itertools.count(1)
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None
        # Called (under the pool's lock, so it must not block) with each heartbeat's per-adapter
        # paging counters: (worker id, incarnation, counts) — the metrics turn them into counters.
        self.on_paging: Callable[[str, str, Sequence[membership_pb2.AdapterPagingCount]], None] | None = None

    # -- membership RPCs ----------------------------------------------------------------

    def register(self, hello: membership_pb2.WorkerHello) -> bool:
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
        copy = membership_pb2.WorkerHello()
        copy.CopyFrom(hello)
        self._joins.submit(self._join, copy)
        log.info("worker_join_queued", worker_id=hello.worker_id, addr=hello.addr)
        return False

    @staticmethod
    def _check_not_taken(hello: membership_pb2.WorkerHello, old: WorkerHandle | None, joining: str | None) -> None:
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

    def _join(self, hello: membership_pb2.WorkerHello) -> None:
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

    def _join_now(self, hello: membership_pb2.WorkerHello) -> None:
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
            self.adapters.reconcile_join(handle)
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
            handle.note_paging(hello)
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

    def _dial(self, hello: membership_pb2.WorkerHello) -> grpc.Channel:
        channel = grpc.insecure_channel(hello.addr, options=GRPC_MESSAGE_OPTIONS)
        try:
            grpc.channel_ready_future(channel).result(timeout=self.timings.connect_timeout_s)
        except grpc.FutureTimeoutError:
            channel.close()
            raise UnavailableError(
                f"worker {hello.worker_id}: cannot reach it at {hello.addr} within {self.timings.connect_timeout_s:g}s"
            ) from None
        return channel

    def heartbeat(self, hello: membership_pb2.WorkerHello, *, age_s: float = 0.0) -> bool:
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
                handle.note_paging(hello)
                self._paging_reported(handle, hello)
                handle.restarts = max(handle.restarts, hello.supervisor_restarts)
                if hello.draining and not handle.draining:
                    log.info("worker_draining", worker_id=handle.worker_id, in_flight=handle.in_flight)
                handle.draining = hello.draining
        self._refresh()
        if hello.HasField("holdings"):
            self.adapters.report(handle, hello.holdings)
        return True

    @property
    def heartbeat_interval_ms(self) -> int:
        """``heartbeat_interval_s`` in whole milliseconds, as ``WorkerAck`` carries it."""
        return int(round(self.timings.heartbeat_interval_s * 1000))

    # -- liveness -----------------------------------------------------------------------

    def mark_failed(self, worker_id: str, reason: str) -> None:
        """A call to the worker failed: treat it as dead until its next heartbeat."""
        with self._lock:
            handle = self._workers.get(worker_id)
            if handle is not None:
                handle.failed = reason
        self._refresh()

    def _paging_reported(self, handle: WorkerHandle, hello: membership_pb2.WorkerHello) -> None:
        """Hand a heartbeat's per-adapter paging counters to ``on_paging`` (caller holds the
        lock); a hello without ``paging`` (another replica's sighting) carries none."""
        if self.on_paging is not None and hello.HasField("paging"):
            self.on_paging(handle.worker_id, hello.incarnation, hello.adapter_paging)

    def holdings(self) -> list[WorkerHoldingsView]:
        """What each alive worker (draining included: it still holds cache and adapters)
        reported on its last heartbeat, by id."""
        self._refresh()
        with self._lock:
            return [WorkerHoldingsView.of(w) for _, w in sorted(self._workers.items()) if w.alive]

    def handles(self) -> list[WorkerHandle]:
        """Every registered worker's handle (dead and draining ones too), liveness as of now,
        by id."""
        self._refresh()
        with self._lock:
            return [w for _, w in sorted(self._workers.items())]

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
        """Every registered worker as ``ListWorkers`` shows it, by id."""
        self._refresh()
        now = self._clock()
        with self._lock:
            return [WorkerView.of(w, now) for _, w in sorted(self._workers.items())]

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
                handle.count_tenant(token, tenant)
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
                handle.uncount_tenant(token)

    def has_room(self, handle: WorkerHandle, tenant: Share) -> bool:
        """Whether ``handle`` can take one more request of ``tenant`` (``requests`` ignored):
        fewer relays from here in flight than its slots + queue limit (unknown: yes), or, full
        but sharing its queue between tenants (``--fairness vtc``), another tenant there gives
        way to it (`loraplane.queue_shares`: the worker then evicts that tenant's newest queued
        request, or refuses if its own count says otherwise)."""
        with self._lock:
            return handle.has_room_for(tenant)

    def close(self) -> None:
        """Stop the join, watchdog and `AdapterAnnouncer` threads and close every channel."""
        self._closed.set()
        self._joins.shutdown(wait=False, cancel_futures=True)
        self.adapters.close()
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
        for w in workers:
            w.channel.close()
