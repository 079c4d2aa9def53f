"""The tenant rows' records, as the store reads and writes them (`control_plane.store.base`
declares the operations; `control_plane.store.tenant_sql` spells the SQL)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TenantRecord:
    """One tenant as stored (``tenants`` table, migration 6).

    Attributes:
        name: unique; what requests are accounted to (`control_plane.tenants.check_tenant_name`).
        weight: fair share on the workers (VTC weight, > 0).
        priority: priority class on the workers (lower is served first).
        max_concurrent: requests in flight over all replicas (0: unlimited).
        tokens_per_minute: prompt + output tokens per minute (0: unlimited).
        requests_per_minute: requests per minute (0: unlimited).
        key_count: API keys that map to it (stored as sha256 only).
        created_at: unix time it was added, seconds.
    """

    name: str
    weight: float = 1.0
    priority: int = 0
    max_concurrent: int = 0
    tokens_per_minute: int = 0
    requests_per_minute: int = 0
    key_count: int = 0
    created_at: float = 0.0

    @property
    def limited(self) -> bool:
        """Whether any quota applies."""
        return bool(self.max_concurrent or self.tokens_per_minute or self.requests_per_minute)


TenantStates = list["TenantState"]
"""A module-level alias (the stores' ``list`` method shadows the builtin in their class bodies)."""

TENANT_SETTINGS = ("weight", "priority", "max_concurrent", "tokens_per_minute", "requests_per_minute")
"""The columns `AdapterStore.update_tenant` may change."""


@dataclass
class UsageDelta:
    """One replica's tenant usage not yet written to the store (`AdapterStore.sync_tenants`).

    Attributes:
        tokens: tokens taken from the token bucket (reservations at admission minus what
            settling gave back; may be negative).
        requests: requests taken from the request bucket.
        requests_total / tokens_total / rejected_total: what the totals grow by (admitted
            requests, settled prompt + output tokens, refusals over quota).
    """

    tokens: float = 0.0
    requests: float = 0.0
    requests_total: int = 0
    tokens_total: int = 0
    rejected_total: int = 0

    def __bool__(self) -> bool:
        return bool(self.tokens or self.requests or self.requests_total or self.tokens_total or self.rejected_total)

    def add(self, other: UsageDelta) -> None:
        """Add ``other`` into this one."""
        self.tokens += other.tokens
        self.requests += other.requests
        self.requests_total += other.requests_total
        self.tokens_total += other.tokens_total
        self.rejected_total += other.rejected_total


@dataclass(frozen=True)
class TenantState:
    """A tenant's stored limits and usage as of one read (the database's clock).

    Attributes:
        record: the tenant.
        tokens_level / requests_level: the buckets' levels now (refilled at limit / 60 per
            second up to the limit since they were last written; may be negative after
            replicas overshot together). 0 when that limit is 0 (unlimited).
        in_flight_others: requests in flight on the *other* replicas (their rows younger than
            the in-flight TTL); all replicas' when read by `AdapterStore.tenant_states`.
        requests_total / tokens_total / rejected_total: totals since the tenant was added.
    """

    record: TenantRecord
    tokens_level: float = 0.0
    requests_level: float = 0.0
    in_flight_others: int = 0
    requests_total: int = 0
    tokens_total: int = 0
    rejected_total: int = 0


@dataclass(frozen=True)
class AdmissionClaim:
    """The store's answer to one admission of a request (`AdapterStore.admit_tenant_request`),
    as of that instant on the database's clock.

    Attributes:
        admitted: every limit allowed it, and it was taken from them.
        claimed: a concurrency claim was written for it (the tenant has ``max_concurrent``);
            release it with `AdapterStore.settle_tenant_request`.
        max_concurrent / requests_per_minute / tokens_per_minute: the tenant's limits as stored.
        claims: requests holding a claim over all replicas (this one included when claimed).
        requests_level / tokens_level: the buckets now (after this request when admitted).
    """

    admitted: bool
    claimed: bool
    max_concurrent: int
    claims: int
    requests_per_minute: int
    tokens_per_minute: int
    requests_level: float
    tokens_level: float
