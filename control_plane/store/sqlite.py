"""SQLite implementation of `AdapterStore`: the embedded default, one control-plane process.

`SqliteStore` uses the stdlib ``sqlite3`` in WAL mode, one connection guarded by a lock (gRPC
handlers run on a thread pool), at ``sqlite:///PATH`` (default ``<data-dir>/loraplane.sqlite3``,
`DB_FILENAME`). Ids come from a one-row counter table; uploaded bytes are files under the blob
directory; a database that stays locked or cannot be read or written raises
`DatabaseUnavailableError` naming the file. Opening waits up to `OPEN_RETRY_S` for a concurrent
first open.

Ids, where the bytes live, crash recovery and bounded waits: docs/architecture.md, "The store".
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import structlog

from control_plane.errors import AlreadyExistsError, DatabaseUnavailableError, DataCorruptionError
from control_plane.store.base import (
    CALL_TIMEOUT_S,
    REMOVALS_KEPT_S,
    SIGHTINGS_KEPT_S,
    AdapterRecord,
    AdapterStore,
    BadRows,
    DefaultScales,
    NameEdit,
    SchemaTooNewError,
    Sightings,
    WorkerSighting,
)
from control_plane.store.migrations import MIGRATIONS, SCHEMA_VERSION_DDL
from control_plane.store.tenant_records import AdmissionClaim, TenantRecord, TenantStates, UsageDelta
from control_plane.store.tenant_sql import (
    Dialect,
    admission_of,
    claim_counts,
    record_of,
    record_params,
    state_of,
)

log = structlog.get_logger("loraplane.control_plane.store.sqlite")

DB_FILENAME = "loraplane.sqlite3"
SQL = Dialect(param=lambda name: f":{name}", now=":now", least="MIN", greatest="MAX")


OPEN_RETRY_S = 30.0
"""How long opening the database retries a lock conflict SQLite reports at once (seconds)."""


def _retry_locked(fn, limit_s: float):
    """``fn()``, retried every 50 ms while SQLite reports the database locked or busy, for at
    most ``limit_s`` seconds; then the last error is raised."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            return fn()
        except sqlite3.OperationalError as exc:
            msg = str(exc).lower()
            if ("locked" not in msg and "busy" not in msg) or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


T = TypeVar("T")


def _unavailable(fn: Callable[..., T]) -> Callable[..., T]:
    """Turn SQLite's operational failures into `DatabaseUnavailableError` (see the module
    docstring)."""

    @functools.wraps(fn)
    def wrapper(self: SqliteStore, *args: Any, **kwargs: Any) -> T:
        try:
            return fn(self, *args, **kwargs)
        except sqlite3.OperationalError as exc:
            raise DatabaseUnavailableError(self.description, str(exc)) from exc

    return wrapper


class SqliteStore(AdapterStore):
    """The registry in one SQLite file; uploaded bytes as files in ``blob_dir``.

    Args:
        db_path: the database file (created with its parent directory).
        blob_dir: where uploads are kept as ``<sha256>.gguf`` (default: ``adapters/`` beside
            the database file).

    Raises:
        SchemaTooNewError: the file was migrated by a newer build.
    """

    def __init__(self, db_path: str | Path, blob_dir: str | Path | None = None) -> None:
        self.db_path = Path(db_path)
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self.blob_dir = Path(blob_dir) if blob_dir is not None else self.db_path.parent / "adapters"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.replica_id = uuid.uuid4().hex[:12]
        self.description = f"sqlite:///{self.db_path}"
        self._lock = threading.Lock()
        # isolation_level=None: we issue BEGIN/COMMIT ourselves so each operation is one
        # explicit transaction.
        # The busy timeout is set before anything else: switching to WAL takes the database's
        # write lock, and two processes starting at once must wait for it, not fail "locked".
        self._conn = sqlite3.connect(str(self.db_path), check_same_thread=False, isolation_level=None, timeout=30.0)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA busy_timeout=30000")
        # Some lock conflicts of a concurrent first open (the switch to WAL, the first schema
        # read while another connection converts the file) return SQLITE_BUSY at once instead
        # of calling the busy handler, so opening retries them within the same 30 s.
        _retry_locked(lambda: self._conn.execute("PRAGMA journal_mode=WAL"), OPEN_RETRY_S)
        self._conn.execute("PRAGMA synchronous=NORMAL")
        _retry_locked(self._migrate, OPEN_RETRY_S)
        self._remove_orphans()
        # From now on a call waits at most CALL_TIMEOUT_S for another process's lock.
        self._conn.execute(f"PRAGMA busy_timeout={int(CALL_TIMEOUT_S * 1000)}")
        self._bad_rows = BadRows(self.description)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """This store's lock (one connection, many handler threads), waited for at most
        `CALL_TIMEOUT_S`.

        Raises:
            DatabaseUnavailableError: the lock stayed taken (a call stuck on SQLite's own lock).
        """
        if not self._lock.acquire(timeout=CALL_TIMEOUT_S):
            raise DatabaseUnavailableError(
                self.description, f"busy: another call held it for over {CALL_TIMEOUT_S:g} s"
            )
        try:
            yield
        finally:
            self._lock.release()

    # -- schema -------------------------------------------------------------------------

    def _migrate(self) -> None:
        with self._lock:
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                c.execute(SCHEMA_VERSION_DDL)
                row = c.execute("SELECT version FROM schema_version").fetchone()
                if row is None:
                    c.execute("INSERT INTO schema_version (version) VALUES (0)")
                    version = 0
                else:
                    version = int(row["version"])
                if version > len(MIGRATIONS):
                    raise SchemaTooNewError(
                        f"{self.db_path}: schema version {version} is newer than this build "
                        f"knows ({len(MIGRATIONS)}); refusing to open"
                    )
                for migration in MIGRATIONS[version:]:
                    for sql in migration.sqlite:
                        c.execute(sql)
                c.execute("UPDATE schema_version SET version = ?", (len(MIGRATIONS),))
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
            if version < len(MIGRATIONS):
                log.info("schema_migrated", database=self.description, from_version=version, to_version=len(MIGRATIONS))

    def _remove_orphans(self) -> None:
        """Delete upload copies no row names (a crash between the move and the commit) and
        stale partial uploads; warn about rows whose file is gone."""
        with self._lock:
            paths = {str(r["path"]) for r in self._conn.execute("SELECT path FROM adapters")}
        for p in self.blob_dir.iterdir():
            if p.name.endswith(".part") or (p.suffix == ".gguf" and str(p) not in paths):
                log.warning("orphan_adapter_file_removed", path=str(p))
                p.unlink(missing_ok=True)
        for path in sorted(paths):
            if not Path(path).is_file():
                log.warning("adapter_file_missing", path=path)

    @property
    @_unavailable
    def schema_version(self) -> int:
        with self._locked():
            return int(self._conn.execute("SELECT version FROM schema_version").fetchone()[0])

    # -- reads --------------------------------------------------------------------------

    @_unavailable
    def list(self) -> list[AdapterRecord]:
        with self._locked():
            rows = self._conn.execute("SELECT * FROM adapters ORDER BY id").fetchall()
        return self._bad_rows.records(rows)

    @_unavailable
    def get(self, adapter_id: int) -> AdapterRecord | None:
        with self._locked():
            row = self._conn.execute("SELECT * FROM adapters WHERE id = ?", (adapter_id,)).fetchone()
        return AdapterRecord.from_row(row) if row is not None else None

    @_unavailable
    def get_by_sha256(self, sha256: str) -> AdapterRecord | None:
        with self._locked():
            row = self._conn.execute("SELECT * FROM adapters WHERE sha256 = ?", (sha256,)).fetchone()
        return AdapterRecord.from_row(row) if row is not None else None

    @_unavailable
    def default_set(self) -> DefaultScales:
        with self._locked():
            rows = self._conn.execute("SELECT * FROM adapters ORDER BY id").fetchall()
        return self._bad_rows.default_scales(rows)

    def read_chunks(self, record: AdapterRecord, chunk_size: int) -> Iterator[bytes]:
        with open(record.path, "rb") as fh:
            yield from iter(lambda: fh.read(chunk_size), b"")

    # -- writes -------------------------------------------------------------------------

    @_unavailable
    def insert(
        self,
        *,
        sha256: str,
        name: str,
        metadata: Mapping[str, Any],
        content: Path,
        source: str | None,
        source_format: str = "gguf",
    ) -> tuple[AdapterRecord, bool]:
        final = self.blob_dir / f"{sha256}.gguf"
        with self._locked():
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            moved = False
            try:
                row = c.execute("SELECT * FROM adapters WHERE sha256 = ?", (sha256,)).fetchone()
                if row is not None:
                    c.execute("COMMIT")
                    return AdapterRecord.from_row(row), False
                if source is None:
                    os.replace(content, final)
                    moved = True
                new_id = int(c.execute("SELECT next_id FROM id_counter").fetchone()[0])
                c.execute("UPDATE id_counter SET next_id = ?", (new_id + 1,))
                c.execute(
                    "INSERT INTO adapters (id, sha256, name, path, metadata, default_scale, created_at,"
                    " source_format) VALUES (?, ?, ?, ?, ?, 0, ?, ?)",
                    (
                        new_id,
                        sha256,
                        name,
                        str(final) if source is None else source,
                        json.dumps(dict(metadata), sort_keys=True),
                        time.time(),
                        source_format,
                    ),
                )
                row = c.execute("SELECT * FROM adapters WHERE id = ?", (new_id,)).fetchone()
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                if moved:
                    final.unlink(missing_ok=True)
                raise
        return AdapterRecord.from_row(row), True

    @_unavailable
    def delete(self, adapter_id: int, *, only_if_nameless: bool = False) -> AdapterRecord | None:
        with self._locked():
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                row = c.execute("SELECT * FROM adapters WHERE id = ?", (adapter_id,)).fetchone()
                if row is None or (only_if_nameless and AdapterRecord.from_row(row).names):
                    c.execute("COMMIT")
                    return None
                c.execute("DELETE FROM adapters WHERE id = ?", (adapter_id,))
                now = time.time()
                c.execute(
                    "INSERT OR REPLACE INTO removed_adapters (adapter_id, sha256, removed_at) VALUES (?, ?, ?)",
                    (adapter_id, row["sha256"], now),
                )
                c.execute("DELETE FROM removed_adapters WHERE removed_at < ?", (now - REMOVALS_KEPT_S,))
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
        rec = _removed_record(row)
        owned = Path(rec.path)
        if owned.parent.resolve() == self.blob_dir.resolve():
            owned.unlink(missing_ok=True)
        return rec

    @_unavailable
    def set_default_scales(self, scales: Mapping[int, float], *, others: float | None = 0.0) -> None:
        with self._locked():
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                if others is not None:
                    c.execute("UPDATE adapters SET default_scale = ?", (float(others),))
                c.executemany(
                    "UPDATE adapters SET default_scale = ? WHERE id = ?",
                    [(float(s), int(i)) for i, s in scales.items()],
                )
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise

    @_unavailable
    def set_pinned(self, adapter_id: int, pinned: bool) -> AdapterRecord | None:
        with self._locked():
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                c.execute("UPDATE adapters SET pinned = ? WHERE id = ?", (1 if pinned else 0, adapter_id))
                row = c.execute("SELECT * FROM adapters WHERE id = ?", (adapter_id,)).fetchone()
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
        return AdapterRecord.from_row(row) if row is not None else None

    @_unavailable
    def set_names(self, adapter_id: int, edit: NameEdit) -> AdapterRecord | None:
        with self._locked():
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                records = self._bad_rows.records(c.execute("SELECT * FROM adapters ORDER BY id").fetchall())
                target = next((r for r in records if r.id == adapter_id), None)
                if target is None:
                    c.execute("COMMIT")
                    return None
                name, aliases = edit(target, records)
                c.execute(
                    "UPDATE adapters SET name = ?, aliases = ? WHERE id = ?",
                    (name, json.dumps(list(aliases)), adapter_id),
                )
                row = c.execute("SELECT * FROM adapters WHERE id = ?", (adapter_id,)).fetchone()
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
        return AdapterRecord.from_row(row)

    @_unavailable
    def removed_ids(self) -> set[int]:
        with self._locked():
            rows = self._conn.execute("SELECT adapter_id FROM removed_adapters").fetchall()
        return {int(r[0]) for r in rows}

    # -- worker sightings -------------------------------------------------------------------

    @_unavailable
    def record_worker(
        self, *, worker_id: str, addr: str, model: str, model_sha256: str, n_slots: int, age_s: float = 0.0
    ) -> None:
        with self._locked():
            self._conn.execute(
                "INSERT INTO worker_sightings (worker_id, addr, model, model_sha256, n_slots, replica_id, seen_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (worker_id) DO UPDATE SET addr = excluded.addr,"
                " model = excluded.model, model_sha256 = excluded.model_sha256, n_slots = excluded.n_slots,"
                " replica_id = excluded.replica_id, seen_at = excluded.seen_at",
                (worker_id, addr, model, model_sha256, int(n_slots), self.replica_id, time.time() - max(0.0, age_s)),
            )

    @_unavailable
    def recent_workers(self, max_age_s: float) -> Sightings:
        now = time.time()
        with self._locked():
            # a read unless there is something to prune: a write would wait (holding our lock)
            # whenever another process holds SQLite's write lock
            cutoff = now - SIGHTINGS_KEPT_S
            if self._conn.execute("SELECT 1 FROM worker_sightings WHERE seen_at < ? LIMIT 1", (cutoff,)).fetchone():
                self._conn.execute("DELETE FROM worker_sightings WHERE seen_at < ?", (cutoff,))
            rows = self._conn.execute(
                "SELECT * FROM worker_sightings WHERE seen_at >= ? ORDER BY worker_id", (now - max_age_s,)
            ).fetchall()
        return [
            WorkerSighting(
                str(r["worker_id"]),
                str(r["addr"]),
                str(r["model"]),
                str(r["model_sha256"]),
                int(r["n_slots"]),
                str(r["replica_id"]),
                max(0.0, now - float(r["seen_at"])),
            )
            for r in rows
        ]

    # -- tenants ---------------------------------------------------------------------------

    @contextmanager
    def _write(self, *, wait: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction (``BEGIN IMMEDIATE``) under this store's lock; ``wait=False``:
        fail at once (``database is locked``) instead of waiting for another process's write
        lock, so this store's lock is not held meanwhile (the quota sync retries next tick)."""
        with self._locked():
            c = self._conn
            if not wait:
                c.execute("PRAGMA busy_timeout=0")
            try:
                c.execute("BEGIN IMMEDIATE")
            finally:
                if not wait:
                    c.execute(f"PRAGMA busy_timeout={int(CALL_TIMEOUT_S * 1000)}")
            try:
                yield c
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise

    @_unavailable
    def add_tenant(self, record: TenantRecord, key_sha256: str) -> TenantRecord:
        now = time.time()
        with self._write() as c:
            if c.execute("SELECT 1 FROM tenants WHERE name = ?", (record.name,)).fetchone():
                raise AlreadyExistsError(f"tenant '{record.name}' already exists")
            if c.execute("SELECT 1 FROM tenant_keys WHERE key_sha256 = ?", (key_sha256,)).fetchone():
                raise AlreadyExistsError("this API key already belongs to a tenant; give another (or none)")
            c.execute(SQL.insert(), {**record_params(record), "created_at": now, "now": now})
            c.execute(
                "INSERT INTO tenant_keys (key_sha256, tenant, created_at) VALUES (?, ?, ?)",
                (key_sha256, record.name, now),
            )
            row = c.execute("SELECT *, 1 AS key_count FROM tenants WHERE name = ?", (record.name,)).fetchone()
        return record_of(row)

    @_unavailable
    def update_tenant(self, name: str, changes: Mapping[str, float | int]) -> TenantRecord | None:
        with self._write() as c:
            if changes:
                c.execute(SQL.settings_update(set(changes)), {**changes, "name": name, "now": time.time()})
            row = c.execute(SQL.record_by_name(), {"name": name}).fetchone()
        return record_of(row) if row is not None else None

    @_unavailable
    def remove_tenant(self, name: str) -> bool:
        with self._write() as c:
            gone = c.execute("DELETE FROM tenants WHERE name = ?", (name,)).rowcount > 0
            c.execute("DELETE FROM tenant_keys WHERE tenant = ?", (name,))
            c.execute("DELETE FROM tenant_in_flight WHERE tenant = ?", (name,))
            c.execute("DELETE FROM tenant_claims WHERE tenant = ?", (name,))
        return gone

    @_unavailable
    def tenant_keys(self) -> dict[str, str]:
        with self._locked():
            rows = self._conn.execute("SELECT key_sha256, tenant FROM tenant_keys").fetchall()
        return {str(r[0]): str(r[1]) for r in rows}

    @_unavailable
    def sync_tenants(
        self,
        deltas: Mapping[str, UsageDelta],
        in_flight: Mapping[str, int],
        in_flight_ttl_s: float,
        *,
        released: Collection[str] = (),
        claim_lease_s: float = 0.0,
    ) -> TenantStates:
        now = time.time()
        states = {"now": now, "replica_id": self.replica_id, "ttl": in_flight_ttl_s}
        if not deltas and not in_flight and not released and not self._claims_to_sync(now, claim_lease_s):
            with self._locked():  # a read: no write lock taken
                rows = self._conn.execute(SQL.states(), states).fetchall()
            return [state_of(r) for r in rows]
        with self._write(wait=False) as c:
            gone = [c.execute(RELEASE, (claim_id,)).fetchall() for claim_id in released]
            freed = claim_counts(row for rows in gone for row in rows)
            if claim_lease_s:
                lease = {"now": now, "replica_id": self.replica_id, "lease": claim_lease_s}
                c.execute(SQL.renew_claims(), lease)
                for name, n in claim_counts(c.execute(SQL.reclaim_expired(), lease).fetchall()).items():
                    freed[name] = freed.get(name, 0) + n
            for name in sorted(set(deltas) | set(freed)):
                c.execute(SQL.sync_update(), _sync_params(name, deltas.get(name), freed.get(name, 0), now))
            for name, n in in_flight.items():
                if n > 0:
                    c.execute(
                        SQL.in_flight_upsert(),
                        {"tenant": name, "replica_id": self.replica_id, "in_flight": n, "now": now},
                    )
                else:
                    c.execute(
                        "DELETE FROM tenant_in_flight WHERE tenant = ? AND replica_id = ?", (name, self.replica_id)
                    )
            c.execute(SQL.prune_in_flight(), {"now": now, "ttl": in_flight_ttl_s})
            rows = c.execute(SQL.states(), states).fetchall()
        return [state_of(r) for r in rows]

    def _claims_to_sync(self, now: float, lease_s: float) -> bool:
        """Whether a sync has claims to renew (this replica holds some) or to reclaim (another
        replica's lease expired): the read-only sync otherwise takes no write lock."""
        if not lease_s:
            return False
        with self._locked():
            row = self._conn.execute(
                "SELECT 1 FROM tenant_claims WHERE replica_id = ? OR expires_at < ? LIMIT 1", (self.replica_id, now)
            ).fetchone()
        return row is not None

    @_unavailable
    def admit_tenant_request(self, name: str, *, claim_id: str, tokens: float, lease_s: float) -> AdmissionClaim | None:
        now = time.time()
        with self._write() as c:
            rows = c.execute(SQL.admit_update(), {"name": name, "tokens": float(tokens), "now": now}).fetchall()
            if rows:
                row = rows[0]
                claimed = int(row["max_concurrent"]) > 0
                if claimed:
                    claim = {"claim_id": claim_id, "name": name, "replica_id": self.replica_id, "lease": lease_s}
                    c.execute(SQL.claim_insert(), {**claim, "now": now})
                return admission_of(row, admitted=True, claimed=claimed)
            state = c.execute(SQL.admission_state(), {"name": name, "now": now}).fetchone()
        return None if state is None else admission_of(state, admitted=False)

    @_unavailable
    def settle_tenant_request(self, name: str, claim_id: str | None, delta: UsageDelta) -> None:
        now = time.time()
        with self._write() as c:
            released = len(c.execute(RELEASE, (claim_id,)).fetchall()) if claim_id is not None else 0
            c.execute(SQL.sync_update(), _sync_params(name, delta, released, now))

    def close(self) -> None:
        with self._lock:
            self._conn.close()


RELEASE = "DELETE FROM tenant_claims WHERE claim_id = ? RETURNING tenant"


def _sync_params(name: str, d: UsageDelta | None, released: int, now: float) -> dict[str, object]:
    """`Dialect.sync_update`'s parameters: tenant ``name``, its deltas (None: none), the claims
    just deleted."""
    d = d or UsageDelta()
    return {
        "name": name,
        "now": now,
        "tokens": float(d.tokens),
        "requests": float(d.requests),
        "requests_total": int(d.requests_total),
        "tokens_total": int(d.tokens_total),
        "rejected_total": int(d.rejected_total),
        "released": int(released),
    }


def _removed_record(row: sqlite3.Row) -> AdapterRecord:
    """The record of a row just deleted; a row that does not parse (a bad row being removed)
    gives its id, sha256, name and path as stored and defaults for the rest."""
    try:
        return AdapterRecord.from_row(row)
    except DataCorruptionError:
        return AdapterRecord(
            id=int(row["id"]), sha256=str(row["sha256"]), name=str(row["name"]), path=str(row["path"]), metadata={}
        )
