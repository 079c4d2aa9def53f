"""The tenant tables' SQL, spelled once for both databases (`Dialect` fills the differences).

Tables (migrations 6 and 7, `control_plane.store.migrations`): ``tenants``, ``tenant_keys``,
``tenant_in_flight`` and ``tenant_claims``. `Dialect.admit_update` is the admission: one guarded
``UPDATE`` of the tenant's row; `Dialect.sync_update` is a sync's per-tenant write, whose
``released`` is the only decrement of ``claims``. `record_of`, `state_of` and `admission_of` turn
rows into `control_plane.store.tenant_records` values. The implementations run these statements
(`control_plane.store.sqlite`, `control_plane.store.postgres_tenants`).

What the tables hold, why admission is exact across replicas, buckets on the database's clock:
docs/tenants.md, "Several replicas".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from control_plane.store.tenant_records import AdmissionClaim, TenantRecord, TenantState

BUCKETS = (("tokens_level", "tokens_per_minute"), ("requests_level", "requests_per_minute"))
ADMISSION_COLUMNS = (
    "max_concurrent",
    "claims",
    "requests_per_minute",
    "tokens_per_minute",
    "requests_level",
    "tokens_level",
)
"""What `Dialect.admit_update` returns and `Dialect.admission_state` reads (`admission_of`)."""
CLAIM_COLUMNS = "(claim_id, tenant, replica_id, expires_at)"


@dataclass(frozen=True)
class Dialect:
    """What differs between SQLite and PostgreSQL here.

    Attributes:
        param: a named parameter's placeholder (``:x`` / ``%(x)s``).
        now: the current time in epoch seconds (a parameter for SQLite, the clock for PostgreSQL).
        least / greatest: the two-argument minimum and maximum functions.
    """

    param: Callable[[str], str]
    now: str
    least: str
    greatest: str

    def bucket_now(self, level: str, limit: str, at: str = "level_at") -> str:
        """A bucket's level as of `now` (0 for an unlimited bucket): ``level`` as written at
        ``at`` plus ``limit / 60`` per second since, at most ``limit``."""
        return (
            f"(CASE WHEN {limit} = 0 THEN 0 ELSE {self.least}({limit}, "
            f"{level} + {self.greatest}(0, {self.now} - {at}) * {limit} / 60.0) END)"
        )

    def sync_update(self, released: str | None = None) -> str:
        """``UPDATE`` one tenant with one replica's deltas (parameters ``name``, ``tokens``,
        ``requests``, ``requests_total``, ``tokens_total``, ``rejected_total``): both buckets
        refilled to now, then the deltas taken (at most the limit: a give-back never overfills);
        ``claims`` less ``released`` (an SQL expression: claim rows just deleted; default the
        parameter ``released``)."""
        p = self.param
        sets = [
            f"{level} = (CASE WHEN {limit} = 0 THEN 0 ELSE "
            f"{self.least}({limit}, {self.bucket_now(level, limit)} - {p(delta)}) END)"
            for (level, limit), delta in zip(BUCKETS, ("tokens", "requests"), strict=True)
        ]
        sets.append(f"level_at = {self.greatest}(level_at, {self.now})")
        sets += [f"{c} = {c} + {p(c)}" for c in ("requests_total", "tokens_total", "rejected_total")]
        sets.append(f"claims = {self.greatest}(0, claims - {released or p('released')})")
        return f"UPDATE tenants SET {', '.join(sets)} WHERE name = {p('name')}"

    def admit_update(self) -> str:
        """``UPDATE`` one tenant admitting one request that reserves ``tokens`` (parameters
        ``name``, ``tokens``) only if every limit allows it: ``claims`` below
        ``max_concurrent``, a request and ``tokens`` in the buckets (refilled to now); then one
        more claim (with ``max_concurrent``), one request and ``tokens`` taken, one more request
        in the totals. ``RETURNING`` the limits and the levels after it (`ADMISSION_COLUMNS`);
        no row: refused (or no such tenant: `admission_state` tells)."""
        p = self.param
        requests_now = self.bucket_now("requests_level", "requests_per_minute")
        tokens_now = self.bucket_now("tokens_level", "tokens_per_minute")
        allowed = (
            "(max_concurrent = 0 OR claims < max_concurrent)"
            f" AND (requests_per_minute = 0 OR {requests_now} >= 1)"
            f" AND (tokens_per_minute = 0 OR {tokens_now} >= {p('tokens')})"
        )
        sets = (
            "claims = claims + (CASE WHEN max_concurrent > 0 THEN 1 ELSE 0 END)",
            f"requests_level = {requests_now} - (CASE WHEN requests_per_minute > 0 THEN 1 ELSE 0 END)",
            f"tokens_level = {tokens_now} - (CASE WHEN tokens_per_minute > 0 THEN {p('tokens')} ELSE 0 END)",
            f"level_at = {self.greatest}(level_at, {self.now})",
            "requests_total = requests_total + 1",
        )
        return (
            f"UPDATE tenants SET {', '.join(sets)} WHERE name = {p('name')} AND {allowed} "
            f"RETURNING {', '.join(ADMISSION_COLUMNS)}"
        )

    def admission_state(self) -> str:
        """One tenant's limits, claims and bucket levels now (parameter ``name``), as
        `ADMISSION_COLUMNS`: why `admit_update` refused."""
        requests_now = self.bucket_now("requests_level", "requests_per_minute")
        tokens_now = self.bucket_now("tokens_level", "tokens_per_minute")
        return (
            "SELECT max_concurrent, claims, requests_per_minute, tokens_per_minute, "
            f"{requests_now} AS requests_level, {tokens_now} AS tokens_level "
            f"FROM tenants WHERE name = {self.param('name')}"
        )

    def claim_values(self) -> str:
        """The values of a new ``tenant_claims`` row, in `CLAIM_COLUMNS` order (parameters
        ``claim_id``, ``name``, ``replica_id``, ``lease``): its lease runs ``lease`` seconds from now."""
        p = self.param
        return f"{p('claim_id')}, {p('name')}, {p('replica_id')}, {self.now} + {p('lease')}"

    def claim_insert(self) -> str:
        """``INSERT`` one claim (`claim_values`' parameters)."""
        return f"INSERT INTO tenant_claims {CLAIM_COLUMNS} VALUES ({self.claim_values()})"

    def renew_claims(self) -> str:
        """Extend every claim of one replica (``replica_id``) to ``lease`` seconds from now."""
        p = self.param
        return f"UPDATE tenant_claims SET expires_at = {self.now} + {p('lease')} WHERE replica_id = {p('replica_id')}"

    def reclaim_expired(self) -> str:
        """Delete the other replicas' claims whose lease expired (their replica stopped renewing:
        it is gone), ``RETURNING`` each one's tenant (parameter ``replica_id``: this one)."""
        return (
            f"DELETE FROM tenant_claims WHERE expires_at < {self.now} "
            f"AND replica_id <> {self.param('replica_id')} RETURNING tenant"
        )

    def settings_update(self, changed: set[str]) -> str:
        """``UPDATE`` one tenant's settings (parameter ``name`` and one per column in
        ``changed``): both buckets re-based to now under their (possibly new) limit — a lowered
        limit caps the level, a limit set where there was none (0) starts full."""
        p = self.param
        sets = []
        for level, limit in BUCKETS:
            new = p(limit) if limit in changed else limit
            sets.append(
                f"{level} = (CASE WHEN {new} = 0 THEN 0 WHEN {limit} = 0 THEN {new} "
                f"ELSE {self.least}({new}, {self.bucket_now(level, limit)}) END)"
            )
        sets.append(f"level_at = {self.now}")
        sets += [f"{c} = {p(c)}" for c in sorted(changed)]
        return f"UPDATE tenants SET {', '.join(sets)} WHERE name = {p('name')}"

    def insert(self) -> str:
        """``INSERT`` a tenant with full buckets (parameters: the record's columns)."""
        p = self.param
        cols = ("name", "weight", "priority", "max_concurrent", "tokens_per_minute", "requests_per_minute")
        values = [p(c) for c in cols]
        return (
            f"INSERT INTO tenants ({', '.join(cols)}, tokens_level, requests_level, level_at, created_at) "
            f"VALUES ({', '.join(values)}, {p('tokens_per_minute')}, {p('requests_per_minute')}, "
            f"{self.now}, {p('created_at')})"
        )

    def record_by_name(self) -> str:
        """One tenant's row with its key count (parameter ``name``), for `record_of`."""
        return (
            "SELECT t.*, (SELECT COUNT(*) FROM tenant_keys k WHERE k.tenant = t.name) AS key_count"
            f" FROM tenants t WHERE t.name = {self.param('name')}"
        )

    def in_flight_upsert(self) -> str:
        """This replica's in-flight count of one tenant (``tenant``, ``replica_id``, ``in_flight``)."""
        p = self.param
        return (
            "INSERT INTO tenant_in_flight (tenant, replica_id, in_flight, seen_at) "
            f"VALUES ({p('tenant')}, {p('replica_id')}, {p('in_flight')}, {self.now}) "
            "ON CONFLICT (tenant, replica_id) DO UPDATE SET in_flight = excluded.in_flight, seen_at = excluded.seen_at"
        )

    def states(self) -> str:
        """Every tenant with its buckets as of now, key count and in-flight sum over the other
        replicas' fresh rows (parameters ``replica_id``, ``ttl``), by name."""
        p = self.param
        mine = f" AND f.replica_id <> {p('replica_id')}"
        return (
            "SELECT t.name, t.weight, t.priority, t.max_concurrent, t.tokens_per_minute, t.requests_per_minute, "
            "t.created_at, t.requests_total, t.tokens_total, t.rejected_total, "
            f"{self.bucket_now('t.tokens_level', 't.tokens_per_minute', 't.level_at')} AS tokens_now, "
            f"{self.bucket_now('t.requests_level', 't.requests_per_minute', 't.level_at')} AS requests_now, "
            "(SELECT COUNT(*) FROM tenant_keys k WHERE k.tenant = t.name) AS key_count, "
            "COALESCE((SELECT SUM(f.in_flight) FROM tenant_in_flight f WHERE f.tenant = t.name"
            f"{mine} AND f.seen_at >= {self.now} - {p('ttl')}), 0) AS others "
            "FROM tenants t ORDER BY t.name"
        )

    def prune_in_flight(self) -> str:
        """Delete in-flight rows older than ``ttl`` seconds (a dead replica's)."""
        return f"DELETE FROM tenant_in_flight WHERE seen_at < {self.now} - {self.param('ttl')}"


def record_of(row) -> TenantRecord:
    """The `TenantRecord` of a ``tenants`` row (by column name; ``key_count`` when selected)."""
    keys = row["key_count"] if "key_count" in row.keys() else 0
    return TenantRecord(
        name=str(row["name"]),
        weight=float(row["weight"]),
        priority=int(row["priority"]),
        max_concurrent=int(row["max_concurrent"]),
        tokens_per_minute=int(row["tokens_per_minute"]),
        requests_per_minute=int(row["requests_per_minute"]),
        key_count=int(keys),
        created_at=float(row["created_at"]),
    )


def state_of(row) -> TenantState:
    """The `TenantState` of a row of `Dialect.states`."""
    return TenantState(
        record=record_of(row),
        tokens_level=float(row["tokens_now"]),
        requests_level=float(row["requests_now"]),
        in_flight_others=int(row["others"]),
        requests_total=int(row["requests_total"]),
        tokens_total=int(row["tokens_total"]),
        rejected_total=int(row["rejected_total"]),
    )


def record_params(record: TenantRecord) -> dict[str, object]:
    """`Dialect.insert`'s parameters for ``record``."""
    return {
        "name": record.name,
        "weight": float(record.weight),
        "priority": int(record.priority),
        "max_concurrent": int(record.max_concurrent),
        "tokens_per_minute": int(record.tokens_per_minute),
        "requests_per_minute": int(record.requests_per_minute),
        "created_at": float(record.created_at),
    }


def admission_of(row, *, admitted: bool, claimed: bool = False) -> AdmissionClaim:
    """The `AdmissionClaim` of a row of `ADMISSION_COLUMNS` (`Dialect.admit_update` /
    `Dialect.admission_state`)."""
    return AdmissionClaim(
        admitted=admitted,
        claimed=claimed,
        max_concurrent=int(row["max_concurrent"]),
        claims=int(row["claims"]),
        requests_per_minute=int(row["requests_per_minute"]),
        tokens_per_minute=int(row["tokens_per_minute"]),
        requests_level=float(row["requests_level"]),
        tokens_level=float(row["tokens_level"]),
    )


def claim_counts(tenants) -> dict[str, int]:
    """``{tenant: claims}`` of the ``tenant`` column of deleted claim rows."""
    counts: dict[str, int] = {}
    for row in tenants:
        name = str(row[0])
        counts[name] = counts.get(name, 0) + 1
    return counts
