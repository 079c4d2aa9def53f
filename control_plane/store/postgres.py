"""PostgreSQL implementation of `AdapterStore`: several control-plane replicas, one database.

``postgresql://USER:PASSWORD@HOST:PORT/DB`` (any libpq URL or keyword string; the password
can also come from ``PGPASSWORD`` / ``~/.pgpass``). psycopg 3 with a `psycopg_pool.ConnectionPool`
(connections checked before use, so a database failover costs one failed call per broken
connection, not a stuck pool); every method is one transaction on one pooled connection.

Adapter bytes live in the database, table ``adapter_blobs(sha256, seq, data BYTEA)``, in
pieces of `BLOB_CHUNK_BYTES` (1 MiB): every replica reads them with no shared volume, a
registration commits the row and the bytes in one transaction (all or nothing), and a
``pg_dump`` backs up adapters with their metadata. Pieces keep each value far below
``bytea``'s 1 GB limit and let a worker's fetch stream without holding the file in memory.
Server paths and start-up files are copied in too: a path on one replica's disk means
nothing to another.

Registration order (`insert`), for concurrent replicas:

1. the pieces are inserted ``ON CONFLICT DO NOTHING`` (a concurrent registration of the
   same content waits on the primary key until the other commits or rolls back);
2. ``UPDATE id_counter … RETURNING`` takes the counter row's lock: id assignment is
   serialised across replicas for the rest of this short transaction, and its number is
   unique and increasing;
3. with the lock held, the sha256 is looked up again (READ COMMITTED: a new snapshot sees
   registrations committed meanwhile); if it is there, the transaction rolls back (counter
   and pieces with it) and the existing record is returned — same content, one id;
4. the row is inserted and everything commits.

A failed registration rolls the counter back with it, so it leaves no gap: ids have holes
only where adapters were unregistered.

Errors: a connection or server failure (``psycopg.OperationalError``, pool timeout) becomes
`UnavailableError` naming the database (gRPC UNAVAILABLE; clients retry on another replica).
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import structlog
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from control_plane.errors import UnavailableError
from control_plane.store.base import (
    REMOVALS_KEPT_S,
    SIGHTINGS_KEPT_S,
    AdapterRecord,
    AdapterStore,
    DefaultScales,
    SchemaTooNewError,
    Sightings,
    WorkerSighting,
)
from control_plane.store.migrations import MIGRATION_LOCK_KEY, MIGRATIONS, SCHEMA_VERSION_DDL

log = structlog.get_logger("loraplane.control_plane.store.postgres")

BLOB_CHUNK_BYTES = 1 << 20
"""Size of one ``adapter_blobs`` piece (the last piece of a file may be shorter)."""

DEFAULT_POOL_SIZE = 10
CONNECT_TIMEOUT_S = 10
"""libpq ``connect_timeout`` and the pool's wait for a free connection, seconds."""

T = TypeVar("T")


def redact(url: str) -> str:
    """The URL without its password, for logs and messages."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgresql://(unparseable URL)"
    host, port, db = params.get("host", ""), params.get("port", ""), params.get("dbname", "")
    user = str(params.get("user", ""))
    return f"postgresql://{user + '@' if user else ''}{host}{':' + str(port) if port else ''}/{db}"


def _unavailable(fn: Callable[..., T]) -> Callable[..., T]:
    """Turn database failures into `UnavailableError` (see the module docstring)."""

    @functools.wraps(fn)
    def wrapper(self: PostgresStore, *args: Any, **kwargs: Any) -> T:
        try:
            return fn(self, *args, **kwargs)
        except (psycopg.OperationalError, PoolTimeout) as exc:
            raise UnavailableError(f"database {self.description} unavailable: {exc}") from exc

    return wrapper


class PostgresStore(AdapterStore):
    """The registry, the adapter bytes, removals and worker sightings in PostgreSQL.

    Args:
        url: libpq connection URL (``postgresql://…``).
        pool_size: most connections this replica opens.

    Raises:
        UnavailableError: the database cannot be reached within `CONNECT_TIMEOUT_S`.
        SchemaTooNewError: a newer build migrated the database.
    """

    def __init__(self, url: str, *, pool_size: int = DEFAULT_POOL_SIZE) -> None:
        self.replica_id = uuid.uuid4().hex[:12]
        self.description = redact(url)
        conninfo = make_conninfo(
            url, connect_timeout=CONNECT_TIMEOUT_S, application_name=f"loraplane-control-plane-{self.replica_id}"
        )
        self._pool = ConnectionPool(
            conninfo,
            min_size=1,
            max_size=pool_size,
            open=False,
            timeout=CONNECT_TIMEOUT_S,
            check=ConnectionPool.check_connection,
            kwargs={"autocommit": True},
            name=f"loraplane-{self.replica_id}",
        )
        try:
            self._pool.open(wait=True, timeout=CONNECT_TIMEOUT_S)
        except PoolTimeout as exc:
            self._pool.close()
            raise UnavailableError(
                f"database {self.description}: cannot connect within {CONNECT_TIMEOUT_S}s: {exc}"
            ) from exc
        try:
            self._migrate()
        except BaseException:
            self._pool.close()
            raise

    # -- schema -------------------------------------------------------------------------

    def _migrate(self) -> None:
        with self._pool.connection() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
            conn.execute(SCHEMA_VERSION_DDL)
            row = conn.execute("SELECT version FROM schema_version").fetchone()
            if row is None:
                conn.execute("INSERT INTO schema_version (version) VALUES (0)")
                version = 0
            else:
                version = int(row[0])
            if version > len(MIGRATIONS):
                raise SchemaTooNewError(
                    f"{self.description}: schema version {version} is newer than this build "
                    f"knows ({len(MIGRATIONS)}); refusing to open"
                )
            for migration in MIGRATIONS[version:]:
                for sql in migration.postgres:
                    conn.execute(sql)
            conn.execute("UPDATE schema_version SET version = %s", (len(MIGRATIONS),))
        if version < len(MIGRATIONS):
            log.info("schema_migrated", database=self.description, from_version=version, to_version=len(MIGRATIONS))

    @property
    @_unavailable
    def schema_version(self) -> int:
        with self._pool.connection() as conn:
            row = conn.execute("SELECT version FROM schema_version").fetchone()
        assert row is not None  # written by _migrate
        return int(row[0])

    # -- reads --------------------------------------------------------------------------

    @_unavailable
    def list(self) -> list[AdapterRecord]:
        with self._pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            return [AdapterRecord.from_row(r) for r in cur.execute("SELECT * FROM adapters ORDER BY id")]

    @_unavailable
    def get(self, adapter_id: int) -> AdapterRecord | None:
        with self._pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute("SELECT * FROM adapters WHERE id = %s", (adapter_id,)).fetchone()
        return AdapterRecord.from_row(row) if row is not None else None

    @_unavailable
    def get_by_sha256(self, sha256: str) -> AdapterRecord | None:
        with self._pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute("SELECT * FROM adapters WHERE sha256 = %s", (sha256,)).fetchone()
        return AdapterRecord.from_row(row) if row is not None else None

    @_unavailable
    def default_set(self) -> DefaultScales:
        with self._pool.connection() as conn:
            rows = conn.execute("SELECT id, default_scale FROM adapters ORDER BY id").fetchall()
        return [(int(i), float(s)) for i, s in rows]

    def read_chunks(self, record: AdapterRecord, chunk_size: int) -> Iterator[bytes]:
        """One query per stored piece, so no connection is held while the caller (a gRPC
        upload to a worker) consumes them; pieces are re-cut to ``chunk_size``.

        Raises:
            OSError: the bytes are gone (the adapter was unregistered meanwhile).
        """
        buffer = b""
        seq = 0
        while True:
            piece = self._piece(record.sha256, seq)
            if piece is None:
                if seq == 0:
                    raise FileNotFoundError(
                        f"adapter {record.id}: no bytes for sha256 {record.sha256} in {self.description}"
                    )
                break
            buffer += piece
            seq += 1
            while len(buffer) >= chunk_size:
                yield buffer[:chunk_size]
                buffer = buffer[chunk_size:]
        if buffer:
            yield buffer

    @_unavailable
    def _piece(self, sha256: str, seq: int) -> bytes | None:
        with self._pool.connection() as conn:
            row = conn.execute(
                "SELECT data FROM adapter_blobs WHERE sha256 = %s AND seq = %s", (sha256, seq)
            ).fetchone()
        return bytes(row[0]) if row is not None else None

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
        existing = self.get_by_sha256(sha256)  # fast path: no bytes written for a duplicate
        if existing is not None:
            return existing, False
        path = f"postgresql:adapter_blobs/{sha256}" if source is None else source
        try:
            with self._pool.connection() as conn, conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
                with open(content, "rb") as fh:
                    for seq, piece in enumerate(iter(lambda: fh.read(BLOB_CHUNK_BYTES), b"")):
                        cur.execute(
                            "INSERT INTO adapter_blobs (sha256, seq, data) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                            (sha256, seq, piece),
                        )
                row = cur.execute(
                    "UPDATE id_counter SET next_id = next_id + 1 WHERE singleton = 0 RETURNING next_id - 1 AS id"
                ).fetchone()
                assert row is not None  # the counter row is created by the first migration
                new_id = int(row["id"])
                dup = cur.execute("SELECT * FROM adapters WHERE sha256 = %s", (sha256,)).fetchone()
                if dup is not None:
                    raise _AlreadyRegistered(AdapterRecord.from_row(dup))
                created = cur.execute(
                    "INSERT INTO adapters (id, sha256, name, path, metadata, default_scale, created_at,"
                    " source_format) VALUES (%s, %s, %s, %s, %s, 0, %s, %s) RETURNING *",
                    (
                        new_id,
                        sha256,
                        name,
                        path,
                        json.dumps(dict(metadata), sort_keys=True),
                        time.time(),
                        source_format,
                    ),
                ).fetchone()
        except _AlreadyRegistered as dup_exc:
            return dup_exc.record, False
        assert created is not None
        return AdapterRecord.from_row(created), True

    @_unavailable
    def delete(self, adapter_id: int) -> AdapterRecord | None:
        with self._pool.connection() as conn, conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute("DELETE FROM adapters WHERE id = %s RETURNING *", (adapter_id,)).fetchone()
            if row is None:
                return None
            cur.execute("DELETE FROM adapter_blobs WHERE sha256 = %s", (row["sha256"],))
            now = time.time()
            cur.execute(
                "INSERT INTO removed_adapters (adapter_id, sha256, removed_at) VALUES (%s, %s, %s)"
                " ON CONFLICT (adapter_id) DO NOTHING",
                (adapter_id, row["sha256"], now),
            )
            cur.execute("DELETE FROM removed_adapters WHERE removed_at < %s", (now - REMOVALS_KEPT_S,))
        return AdapterRecord.from_row(row)

    @_unavailable
    def set_default_scales(self, scales: Mapping[int, float], *, others: float | None = 0.0) -> None:
        with self._pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
            if others is not None:
                cur.execute("UPDATE adapters SET default_scale = %s", (float(others),))
            cur.executemany(
                "UPDATE adapters SET default_scale = %s WHERE id = %s", [(float(s), int(i)) for i, s in scales.items()]
            )

    @_unavailable
    def set_pinned(self, adapter_id: int, pinned: bool) -> AdapterRecord | None:
        with self._pool.connection() as conn, conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            cur.execute("UPDATE adapters SET pinned = %s WHERE id = %s", (bool(pinned), adapter_id))
            row = cur.execute("SELECT * FROM adapters WHERE id = %s", (adapter_id,)).fetchone()
        return AdapterRecord.from_row(row) if row is not None else None

    @_unavailable
    def removed_ids(self) -> set[int]:
        with self._pool.connection() as conn:
            return {int(r[0]) for r in conn.execute("SELECT adapter_id FROM removed_adapters")}

    # -- worker sightings -------------------------------------------------------------------

    @_unavailable
    def record_worker(self, *, worker_id: str, addr: str, model: str, model_sha256: str, n_slots: int) -> None:
        with self._pool.connection() as conn:
            conn.execute(
                "INSERT INTO worker_sightings (worker_id, addr, model, model_sha256, n_slots, replica_id, seen_at)"
                " VALUES (%s, %s, %s, %s, %s, %s, EXTRACT(EPOCH FROM clock_timestamp()))"
                " ON CONFLICT (worker_id) DO UPDATE SET addr = excluded.addr, model = excluded.model,"
                " model_sha256 = excluded.model_sha256, n_slots = excluded.n_slots,"
                " replica_id = excluded.replica_id, seen_at = excluded.seen_at",
                (worker_id, addr, model, model_sha256, int(n_slots), self.replica_id),
            )

    @_unavailable
    def recent_workers(self, max_age_s: float) -> Sightings:
        with self._pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            cur.execute(
                "DELETE FROM worker_sightings WHERE seen_at < EXTRACT(EPOCH FROM clock_timestamp()) - %s",
                (SIGHTINGS_KEPT_S,),
            )
            rows = cur.execute(
                "SELECT *, EXTRACT(EPOCH FROM clock_timestamp()) - seen_at AS age_s FROM worker_sightings"
                " WHERE seen_at >= EXTRACT(EPOCH FROM clock_timestamp()) - %s ORDER BY worker_id",
                (max_age_s,),
            ).fetchall()
        return [
            WorkerSighting(
                r["worker_id"],
                r["addr"],
                r["model"],
                r["model_sha256"],
                int(r["n_slots"]),
                r["replica_id"],
                max(0.0, float(r["age_s"])),
            )
            for r in rows
        ]

    def close(self) -> None:
        self._pool.close()


class _AlreadyRegistered(Exception):
    """Raised inside `PostgresStore.insert`'s transaction to roll it back."""

    def __init__(self, record: AdapterRecord) -> None:
        super().__init__(record.sha256)
        self.record = record
