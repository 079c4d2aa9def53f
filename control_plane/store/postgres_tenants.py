"""The tenant tables on PostgreSQL: `PostgresStore`'s tenant methods (`AdapterStore`'s tenants
section, documented there) run here, on its pooled connections and within its deadlines.

Lock order, the same in every writer so that replicas never deadlock each other: claim rows
(``tenant_claims``) before tenant rows, and several tenant rows in name order. An admission
(`ADMIT`) locks one tenant row and inserts a new claim row; a settle deletes one claim, then
updates its tenant; a sync deletes claims (released, expired), renews this replica's, then
updates tenants in name order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from contextlib import AbstractContextManager
from typing import Any

import psycopg
from psycopg.rows import dict_row

from control_plane.errors import AlreadyExistsError
from control_plane.store.tenant_records import AdmissionClaim, TenantRecord, TenantStates, UsageDelta
from control_plane.store.tenant_sql import (
    CLAIM_COLUMNS,
    Dialect,
    admission_of,
    claim_counts,
    record_of,
    record_params,
    state_of,
)

SQL = Dialect(
    param=lambda name: f"%({name})s",
    now="EXTRACT(EPOCH FROM now())::float8",  # the transaction's start: one instant per sync
    least="LEAST",
    greatest="GREATEST",
)

Connections = Callable[[], AbstractContextManager[tuple[psycopg.Connection[Any], Callable[[], None]]]]
"""`PostgresStore._connection`: a pooled connection for one call, within the call's deadline."""


class PostgresTenants:
    """The tenant tables through ``connection`` (errors propagate as psycopg raises them: the
    store's methods turn them into `DatabaseUnavailableError`).

    Args:
        connection: the store's connection factory.
        replica_id: this replica's id (its claims and in-flight rows).
    """

    def __init__(self, connection: Connections, replica_id: str) -> None:
        self._connection = connection
        self.replica_id = replica_id

    def add(self, record: TenantRecord, key_sha256: str) -> TenantRecord:
        try:
            with self._connection() as (conn, _), conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
                cur.execute(SQL.insert(), {**record_params(record), "created_at": time.time()})
                cur.execute(
                    "INSERT INTO tenant_keys (key_sha256, tenant, created_at) VALUES (%s, %s, %s)",
                    (key_sha256, record.name, time.time()),
                )
                row = cur.execute("SELECT *, 1 AS key_count FROM tenants WHERE name = %s", (record.name,)).fetchone()
        except psycopg.errors.UniqueViolation as exc:
            table = getattr(exc.diag, "table_name", "") or ""
            if table == "tenant_keys":
                raise AlreadyExistsError("this API key already belongs to a tenant; give another (or none)") from None
            raise AlreadyExistsError(f"tenant '{record.name}' already exists") from None
        assert row is not None
        return record_of(row)

    def update(self, name: str, changes: Mapping[str, float | int]) -> TenantRecord | None:
        with self._connection() as (conn, _), conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            if changes:
                cur.execute(SQL.settings_update(set(changes)), {**changes, "name": name})
            row = cur.execute(SQL.record_by_name(), {"name": name}).fetchone()
        return record_of(row) if row is not None else None

    def remove(self, name: str) -> bool:
        with self._connection() as (conn, _), conn.transaction(), conn.cursor() as cur:
            gone = cur.execute("DELETE FROM tenants WHERE name = %s", (name,)).rowcount > 0
            cur.execute("DELETE FROM tenant_keys WHERE tenant = %s", (name,))
            cur.execute("DELETE FROM tenant_in_flight WHERE tenant = %s", (name,))
            cur.execute("DELETE FROM tenant_claims WHERE tenant = %s", (name,))
        return gone

    def keys(self) -> dict[str, str]:
        with self._connection() as (conn, _):
            return {str(r[0]): str(r[1]) for r in conn.execute("SELECT key_sha256, tenant FROM tenant_keys")}

    def sync(
        self,
        deltas: Mapping[str, UsageDelta],
        in_flight: Mapping[str, int],
        in_flight_ttl_s: float,
        *,
        released: Collection[str] = (),
        claim_lease_s: float = 0.0,
    ) -> TenantStates:
        params = {"replica_id": self.replica_id, "ttl": float(in_flight_ttl_s)}
        with self._connection() as (conn, _), conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            # Claim rows first, then tenant rows in name order, as every other writer of both
            # (a settle, an admission) takes them: no lock cycle between replicas.
            freed: dict[str, int] = {}
            if released:
                freed = claim_counts(
                    (r["tenant"],) for r in cur.execute(RELEASE_MANY, {"ids": list(released)}).fetchall()
                )
            if claim_lease_s:
                lease = {"replica_id": self.replica_id, "lease": float(claim_lease_s)}
                cur.execute(SQL.renew_claims(), lease)
                for name, n in claim_counts((r["tenant"],) for r in cur.execute(SQL.reclaim_expired(), lease)).items():
                    freed[name] = freed.get(name, 0) + n
            for name in sorted(set(deltas) | set(freed)):  # one order on every replica: no deadlock
                cur.execute(SQL.sync_update(), _sync_params(name, deltas.get(name), freed.get(name, 0)))
            for name, n in sorted(in_flight.items()):
                if n > 0:
                    cur.execute(SQL.in_flight_upsert(), {"tenant": name, "replica_id": self.replica_id, "in_flight": n})
                else:
                    cur.execute(
                        "DELETE FROM tenant_in_flight WHERE tenant = %s AND replica_id = %s", (name, self.replica_id)
                    )
            if deltas or in_flight:
                cur.execute(SQL.prune_in_flight(), params)
            rows = cur.execute(SQL.states(), params).fetchall()
        return [state_of(r) for r in rows]

    def admit(self, name: str, *, claim_id: str, tokens: float, lease_s: float) -> AdmissionClaim | None:
        params = {
            "name": name,
            "tokens": float(tokens),
            "claim_id": claim_id,
            "replica_id": self.replica_id,
            "lease": float(lease_s),
        }
        with self._connection() as (conn, _), conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute(ADMIT, params).fetchone()  # one statement, one round trip
            if row is not None:
                return admission_of(row, admitted=True, claimed=bool(row["claimed"]))
            state = cur.execute(SQL.admission_state(), {"name": name}).fetchone()
        return None if state is None else admission_of(state, admitted=False)

    def settle(self, name: str, claim_id: str | None, delta: UsageDelta) -> None:
        with self._connection() as (conn, _), conn.cursor() as cur:
            if claim_id is None:
                cur.execute(SQL.sync_update(), _sync_params(name, delta, 0))
            else:  # one statement: the claim row goes, and the count with it only if it was there
                cur.execute(
                    f"WITH gone AS ({RELEASE_ONE}) {SQL.sync_update('(SELECT COUNT(*) FROM gone)')}",
                    {**_sync_params(name, delta, 0), "claim_id": claim_id},
                )


RELEASE_ONE = "DELETE FROM tenant_claims WHERE claim_id = %(claim_id)s RETURNING tenant"
RELEASE_MANY = "DELETE FROM tenant_claims WHERE claim_id = ANY(%(ids)s) RETURNING tenant"
ADMIT = (
    f"WITH admitted AS ({SQL.admit_update()}), "
    f"claimed AS (INSERT INTO tenant_claims {CLAIM_COLUMNS} "
    f"SELECT {SQL.claim_values()} FROM admitted WHERE admitted.max_concurrent > 0 RETURNING claim_id) "
    "SELECT admitted.*, (SELECT COUNT(*) FROM claimed) AS claimed FROM admitted"
)
"""One admission in one statement (`AdapterStore.admit_tenant_request`): the guarded ``UPDATE``
of the tenant's row and, when it admitted a tenant with ``max_concurrent``, its claim row."""


def _sync_params(name: str, d: UsageDelta | None, released: int) -> dict[str, object]:
    """`Dialect.sync_update`'s parameters: tenant ``name``, its deltas (None: none), the claims
    just deleted."""
    d = d or UsageDelta()
    return {
        "name": name,
        "tokens": float(d.tokens),
        "requests": float(d.requests),
        "requests_total": int(d.requests_total),
        "tokens_total": int(d.tokens_total),
        "rejected_total": int(d.rejected_total),
        "released": int(released),
    }
