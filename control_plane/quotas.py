"""Per-tenant quotas at the control plane, global across replicas through the store.

One `QuotaBook` per control-plane process, with one daemon thread (``tenant-quotas``) that syncs
with the store every `SYNC_INTERVAL_S`. ``Router.generate`` calls `QuotaBook.admit` after the
adapter map is resolved and before any worker is picked; the `Admission` it returns is settled
when the request's stream ends, however it ends. A tenant with a limit is admitted and settled
by one store statement each (`AdapterStore.admit_tenant_request`,
`AdapterStore.settle_tenant_request`, in `control_plane.store.tenant_sql`); a refusal raises
`QuotaExceededError`, a request no bucket could ever hold is refused by
`control_plane.quota_rules`. The sync also renews this replica's claims (`CLAIM_LEASE_S`) and
refreshes the local copy of every tenant's levels that usage views, metrics and a database
outage fall back on.

The limits, the refusals and the rules across replicas and outages: docs/tenants.md, "Quotas"
and "Several replicas".
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from control_plane.errors import ControlPlaneError, InvalidArgumentError
from control_plane.quota_rules import (
    REASONS,
    QuotaExceededError,
    TokenBucket,
    rebucket,
    refusal,
    retry_after,
)
from control_plane.store import AdapterStore
from control_plane.store.tenant_records import AdmissionClaim, TenantRecord, TenantState, UsageDelta
from control_plane.tenants import KEYS_REFRESH_S, ResolvedTenant, TenantDirectory

log = structlog.get_logger("loraplane.control_plane.quotas")

SYNC_INTERVAL_S = 0.25
"""Seconds between quota syncs with the store."""
IN_FLIGHT_TTL_S = 5.0
"""A replica's in-flight row older than this no longer counts (the replica is gone)."""
CLAIM_LEASE_S = 5.0
"""A concurrency claim not renewed for this long (its replica is gone) is deleted, seconds."""
ADMIT_ATTEMPTS = 3
"""Store admissions tried for one request when each refusal finds, on reading the row back, that
the limit was freed meanwhile (another request of the tenant ended between the two calls)."""
DEFAULT_MAX_TOKENS = 16
"""What the worker generates when ``max_tokens`` is 0 (``worker.rpc.servicer.sampling_from_proto``)."""

__all__ = [
    "REASONS",
    "Admission",
    "QuotaBook",
    "QuotaExceededError",
    "TenantUsageView",
    "TokenBucket",
    "retry_after",
]


@dataclass
class TenantUsageView:
    """One tenant's usage as this replica knows it (`QuotaBook.usage`).

    Attributes:
        in_flight: requests in flight over all replicas (this one's now, the others' as of the
            last sync).
        tokens_available / requests_available: bucket levels now (0 for an unlimited one).
        requests_total / tokens_total / rejected_total: the stored totals plus this replica's
            unsent counts.
        synced_age_s: seconds since the last successful sync (None: never).
    """

    in_flight: int = 0
    tokens_available: float = 0.0
    requests_available: float = 0.0
    requests_total: int = 0
    tokens_total: int = 0
    rejected_total: int = 0
    synced_age_s: float | None = None


@dataclass
class _Usage:
    """One tenant's local state (guarded by `QuotaBook`'s lock)."""

    tokens: TokenBucket | None = None
    requests: TokenBucket | None = None
    in_flight: int = 0  # this replica's
    others: int = 0  # the other replicas', as of the last sync
    sent_in_flight: int = 0  # what this replica's row says
    unsent: UsageDelta = field(default_factory=UsageDelta)
    stored: TenantState | None = None
    limits: tuple[int, int] = (0, 0)  # (tokens, requests) per minute the buckets were made for


class Admission:
    """An admitted request's reservation; `settle` it once when the request ends (later calls
    do nothing).

    Attributes:
        reserved: tokens reserved at admission (0 without a tokens-per-minute limit).
        in_store: the store admitted it (`AdapterStore.admit_tenant_request`), so its settling
            is written there too; False: decided on this replica's copy (no limit, or the
            database unreachable), settled through the sync.
        claim_id: its concurrency claim in the store (None: none).
    """

    def __init__(
        self,
        book: QuotaBook,
        tenant: ResolvedTenant,
        reserved: int,
        *,
        in_store: bool = False,
        claim_id: str | None = None,
    ) -> None:
        self.book = book
        self.tenant = tenant
        self.reserved = reserved
        self.in_store = in_store
        self.claim_id = claim_id
        self._lock = threading.Lock()
        self._done = False

    def settle(self, prompt_tokens: int, output_tokens: int, *, wait: bool = True) -> None:
        """The request ended having used ``prompt_tokens + output_tokens``: give back the rest
        of the reservation (or take what it used beyond it), leave the in-flight count and
        release its claim — one store call when the store admitted it, or, with ``wait``
        False (a thread that must not block: the HTTP front's event loop, a gRPC callback),
        handed to the sync thread, woken at once."""
        with self._lock:
            if self._done:
                return
            self._done = True
        self.book._settle(self, int(prompt_tokens), int(output_tokens), wait=wait)


class QuotaBook:
    """Admission against tenant limits, decided by the store and synced with it (see the module
    docstring).

    Args:
        store: the shared store.
        directory: the tenants and keys; refreshed by this book.
        clock: monotonic seconds (tests inject one): the local copy's refill.
        sync_interval_s / in_flight_ttl_s / claim_lease_s / keys_refresh_s: see the module
            constants.
        metrics: an object with ``tenant_admitted(name)``, ``tenant_rejected(name, reason)``,
            ``tenant_tokens(name, prompt, output)`` and ``tenant_sync_failed()`` (None: not counted).
    """

    def __init__(
        self,
        store: AdapterStore,
        directory: TenantDirectory,
        *,
        clock: Callable[[], float] = time.monotonic,
        sync_interval_s: float = SYNC_INTERVAL_S,
        in_flight_ttl_s: float = IN_FLIGHT_TTL_S,
        claim_lease_s: float = CLAIM_LEASE_S,
        keys_refresh_s: float = KEYS_REFRESH_S,
        metrics: Any = None,
    ) -> None:
        self.store = store
        self.directory = directory
        self.clock = clock
        self.sync_interval_s = sync_interval_s
        self.in_flight_ttl_s = in_flight_ttl_s
        self.claim_lease_s = claim_lease_s
        self.keys_refresh_s = keys_refresh_s
        self.metrics = metrics
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._usage: dict[str, _Usage] = {}
        self._local: dict[str, int] = {}  # in flight here, every tenant (limited or not)
        self._unreleased: list[str] = []  # claims whose settle did not reach the store
        self._synced_at: float | None = None
        self._failing = False  # the store is unreachable: decide locally until a sync succeeds
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # -- admission ---------------------------------------------------------------------------

    def admit(
        self,
        tenant: ResolvedTenant,
        *,
        max_tokens: int,
        prompt_tokens: Callable[[], int] | int = 0,
        context_tokens: Callable[[], int | None] | int | None = None,
    ) -> Admission:
        """Admit one request of ``tenant`` or refuse it.

        Args:
            max_tokens: the request's ``max_tokens`` (0: the worker's default, 16).
            prompt_tokens: its prompt length, or a function computing it (called only when the
                tenant has a tokens-per-minute limit).
            context_tokens: the most tokens (prompt + output) one KV sequence holds on any live
                worker (`WorkerPool.max_n_ctx`), or a function computing it (called only with a
                tokens-per-minute limit); None: unknown. A worker stops a request when its
                sequence is full, so the output reserved is at most what the prompt leaves of
                it: a chat request without ``max_tokens`` (the HTTP front sends "until the
                context is full") reserves the context, not 2^31 tokens.

        Raises:
            QuotaExceededError: over ``max_concurrent``, ``requests_per_minute`` or
                ``tokens_per_minute`` (checked in that order).
            InvalidArgumentError: the request alone needs more tokens than ``tokens_per_minute``.
        """
        record = tenant.record
        need = 0
        if record is not None and record.tokens_per_minute:
            n_prompt = int(prompt_tokens() if callable(prompt_tokens) else prompt_tokens)
            n_out = max_tokens or DEFAULT_MAX_TOKENS
            n_ctx = context_tokens() if callable(context_tokens) else context_tokens
            what = "max_tokens"
            if n_ctx and n_prompt + n_out > n_ctx:
                n_out, what = max(0, n_ctx - n_prompt), f"output tokens the context of {n_ctx} leaves"
            need = n_prompt + n_out
            if need > record.tokens_per_minute:
                fix = "lower max_tokens" if n_out and n_prompt < record.tokens_per_minute else "shorten the prompt"
                raise InvalidArgumentError(
                    f"tenant '{tenant.name}': the request needs {need} tokens ({n_prompt} prompt + "
                    f"{n_out} {what}), more than its tokens_per_minute "
                    f"{record.tokens_per_minute}; {fix}"
                )
        claim_id = uuid.uuid4().hex
        stored = None
        if record is not None and record.limited and not self._failing:
            stored = self._admit_in_store(record, need, claim_id)
        with self._lock:
            if record is not None and stored is not None:
                self._admitted_in_store(record, stored)
            elif record is not None:  # a row: its usage is accounted (and its limits checked)
                self._check(tenant.name, record, need)
            self._local[tenant.name] = self._local.get(tenant.name, 0) + 1
        if self.metrics is not None:
            self.metrics.tenant_admitted(tenant.name)
        claimed = stored is not None and stored.claimed
        return Admission(self, tenant, need, in_store=stored is not None, claim_id=claim_id if claimed else None)

    def _admit_in_store(self, record: TenantRecord, need: int, claim_id: str) -> AdmissionClaim | None:
        """The store's admission of one request of ``record`` (module docstring); None when it
        cannot decide (the database unreachable: fail open; or the tenant no longer stored).

        Raises:
            QuotaExceededError: refused, with the store's reason.
        """
        for _ in range(ADMIT_ATTEMPTS):
            try:
                got = self.store.admit_tenant_request(
                    record.name, claim_id=claim_id, tokens=need, lease_s=self.claim_lease_s
                )
            except ControlPlaneError as exc:
                self._store_failed(exc)
                return None
            if got is None or got.admitted:
                return got
            refused = refusal(
                record.name,
                need=need,
                in_flight=got.claims,
                max_concurrent=got.max_concurrent,
                requests_level=got.requests_level,
                requests_per_minute=got.requests_per_minute,
                tokens_level=got.tokens_level,
                tokens_per_minute=got.tokens_per_minute,
            )
            if refused is not None:
                raise self._counted(record, refused)
            # else: the limit was freed between the refusal and the read: try again
        reason = next(r for r, limit in zip(REASONS, _limits(record), strict=True) if limit)
        lost = f"{ADMIT_ATTEMPTS} admissions in a row found its limits taken by concurrent requests"
        raise self._counted(record, QuotaExceededError(record.name, reason, lost, 1))

    def _counted(self, record: TenantRecord, refused: QuotaExceededError) -> QuotaExceededError:
        """``refused``, counted (the tenant's rejected total and the metric)."""
        with self._lock:
            self._usage_of(record, self.clock()).unsent.rejected_total += 1
        if self.metrics is not None:
            self.metrics.tenant_rejected(record.name, refused.reason)
        return refused

    def _admitted_in_store(self, record: TenantRecord, got: AdmissionClaim) -> None:
        """The local copy after the store admitted a request: the levels it answered (less
        what this replica has not sent yet), one more in flight here; under the lock."""
        now = self.clock()
        u = self._usage_of(record, now)
        u.in_flight += 1
        u.requests = (
            TokenBucket(got.requests_per_minute, got.requests_level - u.unsent.requests, now)
            if got.requests_per_minute
            else None
        )
        u.tokens = (
            TokenBucket(got.tokens_per_minute, got.tokens_level - u.unsent.tokens, now)
            if got.tokens_per_minute
            else None
        )
        u.limits = (got.tokens_per_minute, got.requests_per_minute)

    def _check(self, name: str, record: TenantRecord, need: int) -> None:
        """Admit on this replica's copy (take from the buckets, count it in flight and in the
        totals, all sent with the next sync) or raise; under the lock."""
        now = self.clock()
        u = self._usage_of(record, now)
        refused = refusal(
            name,
            need=need,
            in_flight=u.in_flight + u.others,
            max_concurrent=record.max_concurrent,
            requests_level=u.requests.level(now) if u.requests is not None else 0.0,
            requests_per_minute=record.requests_per_minute if u.requests is not None else 0,
            tokens_level=u.tokens.level(now) if u.tokens is not None else 0.0,
            tokens_per_minute=record.tokens_per_minute if u.tokens is not None else 0,
        )
        if refused is not None:
            u.unsent.rejected_total += 1
            if self.metrics is not None:
                self.metrics.tenant_rejected(name, refused.reason)
            raise refused
        if u.requests is not None:
            u.requests.take(1.0, now)
        if u.tokens is not None:
            u.tokens.take(need, now)
        u.in_flight += 1
        u.unsent.requests += 1.0 if u.requests is not None else 0.0
        u.unsent.tokens += need
        u.unsent.requests_total += 1

    def _usage_of(self, record: TenantRecord, now: float) -> _Usage:
        """The local state of a limited tenant, made (buckets full) or re-limited as needed."""
        u = self._usage.get(record.name)
        if u is None:
            u = self._usage[record.name] = _Usage()
        limits = (record.tokens_per_minute, record.requests_per_minute)
        if u.limits != limits:  # new, or its limits changed before the next sync
            u.tokens = rebucket(u.tokens, record.tokens_per_minute, now)
            u.requests = rebucket(u.requests, record.requests_per_minute, now)
            u.limits = limits
        return u

    def _settle(self, admission: Admission, prompt_tokens: int, output_tokens: int, *, wait: bool = True) -> None:
        name = admission.tenant.name
        used = prompt_tokens + output_tokens
        record = admission.tenant.record
        direct: UsageDelta | None = None  # written to the store now (else with the sync)
        with self._lock:
            left = self._local.get(name, 0) - 1
            if left > 0:
                self._local[name] = left
            else:
                self._local.pop(name, None)
            u = self._usage.get(name)
            if record is not None:  # a row: its usage is accounted
                back = admission.reserved - used if record.tokens_per_minute else 0
                delta = UsageDelta(tokens=-back, tokens_total=used)
                if u is not None:
                    u.in_flight = max(0, u.in_flight - 1)
                    if u.tokens is not None and back:
                        u.tokens.take(-back, self.clock())
                if admission.in_store and wait and not self._failing:
                    direct = delta
                else:
                    self._usage.setdefault(name, _Usage()).unsent.add(delta)
                    if admission.claim_id is not None:
                        self._unreleased.append(admission.claim_id)
        if admission.in_store and not wait:
            self.wake()
        if direct is not None:
            try:
                self.store.settle_tenant_request(name, admission.claim_id, direct)
            except ControlPlaneError as exc:  # the next syncs write it (the claim lapses meanwhile)
                self._store_failed(exc)
                with self._lock:
                    self._usage.setdefault(name, _Usage()).unsent.add(direct)
                    if admission.claim_id is not None:
                        self._unreleased.append(admission.claim_id)
        if self.metrics is not None:
            self.metrics.tenant_tokens(name, prompt_tokens, output_tokens)

    def _store_failed(self, exc: ControlPlaneError) -> None:
        """The store is unreachable: decide on the local copy until a sync succeeds."""
        if not self._failing:
            log.warning("tenant_quota_sync_failing", error=str(exc), retry_in_s=self.sync_interval_s)
        self._failing = True

    # -- syncing -------------------------------------------------------------------------------

    def sync(self, *, raise_unavailable: bool = False) -> list[TenantState] | None:
        """One sync with the store (see the module docstring); the states read, or None when
        the store is unavailable (the deltas are kept for the next sync).

        Raises:
            DatabaseUnavailableError: the store is unavailable and ``raise_unavailable`` (an
                admin read).
        """
        with self._sync_lock:
            with self._lock:
                deltas: dict[str, UsageDelta] = {}
                in_flight: dict[str, int] = {}
                for name, u in self._usage.items():
                    if u.unsent:
                        deltas[name], u.unsent = u.unsent, UsageDelta()
                    if u.in_flight or u.sent_in_flight:
                        in_flight[name] = u.in_flight
                released, self._unreleased = self._unreleased, []
            try:
                states = self.store.sync_tenants(
                    deltas, in_flight, self.in_flight_ttl_s, released=released, claim_lease_s=self.claim_lease_s
                )
            except ControlPlaneError as exc:
                with self._lock:
                    for name, d in deltas.items():
                        self._usage.setdefault(name, _Usage()).unsent.add(d)
                    self._unreleased.extend(released)
                self._store_failed(exc)
                if self.metrics is not None:
                    self.metrics.tenant_sync_failed()
                if raise_unavailable:
                    raise
                return None
            if self._failing:
                log.info("tenant_quota_sync_recovered")
            self._failing = False
            self._apply(states, in_flight)
            self.directory.set_records([s.record for s in states])
            return states

    def _apply(self, states: list[TenantState], sent: dict[str, int]) -> None:
        """The levels read become the local buckets, less what was admitted here since."""
        with self._lock:
            now = self.clock()
            self._synced_at = now
            seen = set()
            for s in states:
                r = s.record
                seen.add(r.name)
                u = self._usage.setdefault(r.name, _Usage())
                u.stored = s
                u.limits = (r.tokens_per_minute, r.requests_per_minute)
                u.tokens = (
                    TokenBucket(r.tokens_per_minute, s.tokens_level - u.unsent.tokens, now)
                    if r.tokens_per_minute
                    else None
                )
                u.requests = (
                    TokenBucket(r.requests_per_minute, s.requests_level - u.unsent.requests, now)
                    if r.requests_per_minute
                    else None
                )
                if r.name in sent:
                    u.sent_in_flight = sent[r.name]
                u.others = s.in_flight_others
            for name in [n for n, u in self._usage.items() if n not in seen and not u.in_flight]:
                del self._usage[name]  # removed (or never stored) and idle

    def refresh_keys(self) -> bool:
        """Reload the key table from the store; False when it is unavailable (the last one stays)."""
        try:
            keys = self.store.tenant_keys()
        except ControlPlaneError as exc:
            log.debug("tenant_keys_unavailable", error=str(exc))
            return False
        self.directory.set_keys(keys)
        return True

    def refresh(self) -> None:
        """Sync and reload the keys now (after an admin change through this replica)."""
        self.sync()
        self.refresh_keys()

    def start(self) -> None:
        """Load the keys and levels once, then sync on a daemon thread."""
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="tenant-quotas", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        keys_at = self.clock()
        while not self._stop.is_set():
            self._wake.wait(self.sync_interval_s)
            woken = self._wake.is_set()
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.sync()
                if woken or self.clock() - keys_at >= self.keys_refresh_s:
                    self.refresh_keys()
                    keys_at = self.clock()
            except Exception:  # noqa: BLE001 - keep syncing; the next round retries
                log.exception("tenant_quota_sync_error")

    def wake(self) -> None:
        """Run a sync (and a key reload) on the thread now."""
        self._wake.set()

    # -- views ---------------------------------------------------------------------------------

    def usage(self, name: str) -> TenantUsageView:
        """Tenant ``name``'s usage as this replica knows it now."""
        with self._lock:
            now = self.clock()
            u = self._usage.get(name)
            local = self._local.get(name, 0)
            if u is None:
                return TenantUsageView(in_flight=local)
            s = u.stored
            return TenantUsageView(
                in_flight=u.in_flight + u.others,
                tokens_available=u.tokens.level(now) if u.tokens is not None else 0.0,
                requests_available=u.requests.level(now) if u.requests is not None else 0.0,
                requests_total=(s.requests_total if s else 0) + u.unsent.requests_total,
                tokens_total=(s.tokens_total if s else 0) + u.unsent.tokens_total,
                rejected_total=(s.rejected_total if s else 0) + u.unsent.rejected_total,
                synced_age_s=None if self._synced_at is None else now - self._synced_at,
            )

    def local_in_flight(self) -> dict[str, int]:
        """Requests in flight on this replica, by tenant (every tenant, limited or not)."""
        with self._lock:
            return dict(self._local)

    def synced_age_s(self) -> float | None:
        """Seconds since the last successful sync (None: never)."""
        with self._lock:
            return None if self._synced_at is None else self.clock() - self._synced_at


def _limits(record: TenantRecord) -> tuple[int, int, int]:
    """``record``'s limits in `REASONS` order."""
    return (record.max_concurrent, record.requests_per_minute, record.tokens_per_minute)
