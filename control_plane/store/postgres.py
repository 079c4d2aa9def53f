"""PostgreSQL implementation of `AdapterStore`: several control-plane replicas, one database.

`PostgresStore` opens a psycopg 3 `psycopg_pool.ConnectionPool` from a libpq URL or keyword
string; every method is one transaction on one pooled connection. Adapter bytes live in the
database (``adapter_blobs``, pieces of `BLOB_CHUNK_BYTES`); `PostgresStore.insert` registers
with the id counter's lock held. Each call is bounded: `CONNECT_TIMEOUT_S`, `RECONNECT_TIMEOUT_S`,
one `CALL_TIMEOUT_S` deadline enforced on the client by `_Watchdog` and on the server by
`STATEMENT_TIMEOUT_S`; migrations get `MIGRATE_TIMEOUT_S`. Failures become
`DatabaseUnavailableError` naming the database without its password (`redact`).

The registration order across replicas and the bounded waits: docs/architecture.md,
"The store".
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import structlog
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from control_plane.errors import DatabaseUnavailableError, DataCorruptionError
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
from control_plane.store.migrations import MIGRATION_LOCK_KEY, MIGRATIONS, SCHEMA_VERSION_DDL
from control_plane.store.postgres_tenants import PostgresTenants
from control_plane.store.tenant_records import AdmissionClaim, TenantRecord, TenantStates, UsageDelta

log = structlog.get_logger("loraplane.control_plane.store.postgres")

BLOB_CHUNK_BYTES = 1 << 20
"""Size of one ``adapter_blobs`` piece (the last piece of a file may be shorter)."""

DEFAULT_POOL_SIZE = 10
CONNECT_TIMEOUT_S = 2
"""libpq ``connect_timeout`` of every new connection, seconds (psycopg's minimum)."""
OPEN_TIMEOUT_S = 10.0
"""How long start-up waits for the first connection (the database may be starting too)."""
STATEMENT_TIMEOUT_S = CALL_TIMEOUT_S
"""Server-side ``statement_timeout`` and ``lock_timeout`` of every connection, seconds."""
RECONNECT_TIMEOUT_S = 2.0
"""psycopg_pool's ``reconnect_timeout``: a failing background re-connection gives up after
this long, and the next call that needs a connection starts a new one at once."""
MIGRATE_TIMEOUT_S = 60.0
"""Deadline of the start-up migration (it may wait for another replica's)."""

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


def short_reason(exc: BaseException) -> str:
    """The gist of a psycopg error for a message: ``connection refused``, ``connection timeout
    expired``, ``server closed the connection unexpectedly``, ... (libpq's first line, without
    the host preamble it repeats)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = text.removeprefix("connection failed: ")
    if " failed: " in text:
        text = text.rsplit(" failed: ", 1)[1]
    return text[:1].lower() + text[1:]


def _unavailable(fn: Callable[..., T]) -> Callable[..., T]:
    """Turn database failures into `DatabaseUnavailableError` (see the module docstring)."""

    @functools.wraps(fn)
    def wrapper(self: PostgresStore, *args: Any, **kwargs: Any) -> T:
        try:
            return fn(self, *args, **kwargs)
        except PoolTimeout as exc:
            raise DatabaseUnavailableError(self.description, self._no_connection_reason()) from exc
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailableError(self.description, short_reason(exc)) from exc

    return wrapper


class _Watchdog:
    """Client-side deadlines for blocking psycopg calls: one daemon thread that, when an armed
    deadline passes, shuts down the socket of that call's connection. The blocked call then
    fails at once (``OperationalError``: the server closed the connection) and the pool
    discards the connection. Shutting a socket down wakes a thread blocked on it, unlike
    closing its descriptor; psycopg has no client-side statement timeout of its own.
    """

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, psycopg.Connection[Any]]] = {}
        self._fired: set[int] = set()
        self._tokens = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def watching(self, conn: psycopg.Connection[Any], deadline: float) -> Iterator[Callable[[float], None]]:
        """Guard the block with ``deadline`` (``time.monotonic()``); yields ``rearm(deadline)``.

        Raises:
            DeadlinePassed: the deadline fired and the block failed because of it (a block that
                finished anyway keeps its result; the pool's check discards the connection).
        """
        with self._cond:
            token = next(self._tokens)
            self._armed[token] = (deadline, conn)
            self._cond.notify()

        def rearm(new_deadline: float) -> None:
            with self._cond:
                if token in self._armed:
                    self._armed[token] = (new_deadline, conn)
                    self._cond.notify()

        failed: BaseException | None = None
        try:
            yield rearm
        except BaseException as exc:
            failed = exc
            raise
        finally:
            with self._cond:
                self._armed.pop(token, None)
                fired = token in self._fired
                self._fired.discard(token)
            if fired and isinstance(failed, psycopg.Error):
                raise DeadlinePassed() from failed

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                due = [t for t, (d, _) in self._armed.items() if d <= now]
                for token in due:
                    _, conn = self._armed.pop(token)
                    self._fired.add(token)
                    _shutdown(conn)
                soonest = min((d for d, _ in self._armed.values()), default=None)
                self._cond.wait(None if soonest is None else max(0.0, soonest - now))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


class DeadlinePassed(Exception):
    """A store call's deadline passed (`_Watchdog`); mapped to `DatabaseUnavailableError`."""


def _shutdown(conn: psycopg.Connection[Any]) -> None:
    """Shut down ``conn``'s socket (both directions), leaving the descriptor to psycopg."""
    try:
        if conn.closed:
            return
        fd = conn.pgconn.socket
        sock = socket.socket(fileno=os.dup(fd))
    except (psycopg.Error, OSError):
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


class _Failures:
    """The last connection failure this store saw (a refused or timed-out connect, a liveness
    check that failed), so a call that found no connection can say why."""

    def __init__(self) -> None:
        self.last: tuple[float, str] | None = None

    def note(self, reason: str) -> None:
        self.last = (time.monotonic(), reason)

    def clear(self) -> None:
        self.last = None


def _recording_connection_class(failures: _Failures) -> type[psycopg.Connection[Any]]:
    """A `psycopg.Connection` whose ``connect`` notes its failures in ``failures`` (the pool
    connects in its own threads and reports nothing to a waiting caller)."""

    class RecordingConnection(psycopg.Connection[Any]):
        @classmethod
        def connect(cls, conninfo: str = "", **kwargs: Any) -> RecordingConnection:
            try:
                conn = super().connect(conninfo, **kwargs)
            except psycopg.Error as exc:
                failures.note(short_reason(exc))
                raise
            failures.clear()
            return conn

    return RecordingConnection


class PostgresStore(AdapterStore):
    """The registry, the adapter bytes, removals and worker sightings in PostgreSQL.

    Args:
        url: libpq connection URL (``postgresql://…``).
        pool_size: most connections this replica opens.

    Raises:
        DatabaseUnavailableError: the database cannot be reached within `OPEN_TIMEOUT_S`.
        SchemaTooNewError: a newer build migrated the database.
    """

    def __init__(self, url: str, *, pool_size: int = DEFAULT_POOL_SIZE) -> None:
        self.replica_id = uuid.uuid4().hex[:12]
        self.description = redact(url)
        self._max_size = pool_size
        self._tls = threading.local()  # the deadline of the call this thread is making
        self._failures = _Failures()
        self._watchdog = _Watchdog(f"loraplane-{self.replica_id}")
        self._bad_rows = BadRows(self.description)
        conninfo = make_conninfo(
            url, connect_timeout=CONNECT_TIMEOUT_S, application_name=f"loraplane-control-plane-{self.replica_id}"
        )
        self._pool: ConnectionPool[Any] = ConnectionPool(
            conninfo,
            connection_class=_recording_connection_class(self._failures),
            min_size=1,
            max_size=pool_size,
            open=False,
            timeout=CALL_TIMEOUT_S,
            reconnect_timeout=RECONNECT_TIMEOUT_S,
            check=self._check,
            configure=self._configure,
            kwargs={"autocommit": True},
            name=f"loraplane-{self.replica_id}",
        )
        try:
            self._pool.open(wait=True, timeout=OPEN_TIMEOUT_S)
        except PoolTimeout as exc:
            self.close()
            reason = self._failures.last[1] if self._failures.last else str(exc)
            raise DatabaseUnavailableError(
                self.description, f"cannot connect within {OPEN_TIMEOUT_S:g} s: {reason}"
            ) from exc
        self._tenants = PostgresTenants(self._connection, self.replica_id)
        try:
            self._migrate()
        except BaseException:
            self.close()
            raise

    # -- connections, deadlines ---------------------------------------------------------

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        """Every new connection: the server-side statement and lock timeouts (set per session,
        not in the startup packet, so poolers that refuse ``options`` still work)."""
        ms = str(int(STATEMENT_TIMEOUT_S * 1000))
        with self._watchdog.watching(conn, time.monotonic() + CALL_TIMEOUT_S):
            conn.execute(
                "SELECT set_config('statement_timeout', %s, false), set_config('lock_timeout', %s, false)", (ms, ms)
            )

    def _check(self, conn: psycopg.Connection[Any]) -> None:
        """The pool's liveness check of a connection before it is handed out, bounded by the
        calling thread's deadline (raises when it fails: the pool then discards it)."""
        deadline = getattr(self._tls, "deadline", None) or time.monotonic() + CALL_TIMEOUT_S
        try:
            with self._watchdog.watching(conn, deadline):
                ConnectionPool.check_connection(conn)
        except DeadlinePassed:
            self._failures.note(f"no answer within {CALL_TIMEOUT_S:g} s")
            raise
        except psycopg.Error as exc:
            self._failures.note(short_reason(exc))
            raise
        self._failures.clear()

    @contextmanager
    def _connection(
        self, timeout_s: float = CALL_TIMEOUT_S
    ) -> Iterator[tuple[psycopg.Connection[Any], Callable[[], None]]]:
        """A pooled connection for one call, and ``rearm()`` (a fresh ``timeout_s`` for the
        next statement of a long call). Everything inside — the wait for a connection, its
        check, every statement — ends by the deadline.

        Raises:
            DatabaseUnavailableError: no connection within the deadline, the deadline passed,
                or the connection failed.
        """
        deadline = time.monotonic() + timeout_s
        self._tls.deadline = deadline
        try:
            with self._pool.connection(timeout=timeout_s) as conn:
                self._tls.deadline = None
                with self._watchdog.watching(conn, deadline) as rearm:
                    yield conn, lambda: rearm(time.monotonic() + timeout_s)
        except DeadlinePassed as exc:
            self._failures.note(f"no answer within {timeout_s:g} s")
            raise DatabaseUnavailableError(self.description, f"no answer within {timeout_s:g} s") from exc
        except PoolTimeout as exc:
            raise DatabaseUnavailableError(self.description, self._no_connection_reason()) from exc
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailableError(self.description, short_reason(exc)) from exc
        finally:
            self._tls.deadline = None

    def _no_connection_reason(self) -> str:
        last = self._failures.last
        if last is not None and time.monotonic() - last[0] < 60.0:
            return last[1]
        return f"no connection free within {CALL_TIMEOUT_S:g} s (all {self._max_size} in use)"

    # -- schema -------------------------------------------------------------------------

    def _migrate(self) -> None:
        with self._connection(MIGRATE_TIMEOUT_S) as (conn, _), conn.transaction():
            ms = str(int(MIGRATE_TIMEOUT_S * 1000))  # may wait for another replica's migration
            conn.execute(
                "SELECT set_config('statement_timeout', %s, true), set_config('lock_timeout', %s, true)", (ms, ms)
            )
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
        with self._connection() as (conn, _):
            row = conn.execute("SELECT version FROM schema_version").fetchone()
        assert row is not None  # written by _migrate
        return int(row[0])

    # -- reads --------------------------------------------------------------------------

    @_unavailable
    def list(self) -> list[AdapterRecord]:
        with self._connection() as (conn, _), conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute("SELECT * FROM adapters ORDER BY id").fetchall()
        return self._bad_rows.records(rows)

    @_unavailable
    def get(self, adapter_id: int) -> AdapterRecord | None:
        with self._connection() as (conn, _), conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute("SELECT * FROM adapters WHERE id = %s", (adapter_id,)).fetchone()
        return AdapterRecord.from_row(row) if row is not None else None

    @_unavailable
    def get_by_sha256(self, sha256: str) -> AdapterRecord | None:
        with self._connection() as (conn, _), conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute("SELECT * FROM adapters WHERE sha256 = %s", (sha256,)).fetchone()
        return AdapterRecord.from_row(row) if row is not None else None

    @_unavailable
    def default_set(self) -> DefaultScales:
        with self._connection() as (conn, _), conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute("SELECT * FROM adapters ORDER BY id").fetchall()
        return self._bad_rows.default_scales(rows)

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
        with self._connection() as (conn, _):
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
            with self._connection() as (conn, rearm), conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
                with open(content, "rb") as fh:
                    for seq, piece in enumerate(iter(lambda: fh.read(BLOB_CHUNK_BYTES), b"")):
                        rearm()  # each piece gets the whole per-call deadline
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
                rearm()  # the commit too
        except _AlreadyRegistered as dup_exc:
            return dup_exc.record, False
        assert created is not None
        return AdapterRecord.from_row(created), True

    @_unavailable
    def delete(self, adapter_id: int, *, only_if_nameless: bool = False) -> AdapterRecord | None:
        with self._connection() as (conn, _), conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            if only_if_nameless:  # under READ COMMITTED a racing name change is waited for, then seen
                row = cur.execute(
                    "DELETE FROM adapters WHERE id = %s AND name = '' AND aliases = '[]' RETURNING *", (adapter_id,)
                ).fetchone()
            else:
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
        return _removed_record(row)

    @_unavailable
    def set_default_scales(self, scales: Mapping[int, float], *, others: float | None = 0.0) -> None:
        with self._connection() as (conn, _), conn.transaction(), conn.cursor() as cur:
            if others is not None:
                cur.execute("UPDATE adapters SET default_scale = %s", (float(others),))
            cur.executemany(
                "UPDATE adapters SET default_scale = %s WHERE id = %s", [(float(s), int(i)) for i, s in scales.items()]
            )

    @_unavailable
    def set_pinned(self, adapter_id: int, pinned: bool) -> AdapterRecord | None:
        with self._connection() as (conn, _), conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            cur.execute("UPDATE adapters SET pinned = %s WHERE id = %s", (bool(pinned), adapter_id))
            row = cur.execute("SELECT * FROM adapters WHERE id = %s", (adapter_id,)).fetchone()
        return AdapterRecord.from_row(row) if row is not None else None

    @_unavailable
    def set_names(self, adapter_id: int, edit: NameEdit) -> AdapterRecord | None:
        with self._connection() as (conn, _), conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute("SELECT * FROM adapters ORDER BY id FOR UPDATE").fetchall()
            records = self._bad_rows.records(rows)
            target = next((r for r in records if r.id == adapter_id), None)
            if target is None:
                return None
            name, aliases = edit(target, records)
            row = cur.execute(
                "UPDATE adapters SET name = %s, aliases = %s WHERE id = %s RETURNING *",
                (name, json.dumps(list(aliases)), adapter_id),
            ).fetchone()
        assert row is not None  # the row is locked by this transaction
        return AdapterRecord.from_row(row)

    @_unavailable
    def removed_ids(self) -> set[int]:
        with self._connection() as (conn, _):
            return {int(r[0]) for r in conn.execute("SELECT adapter_id FROM removed_adapters")}

    # -- worker sightings -------------------------------------------------------------------

    @_unavailable
    def record_worker(
        self, *, worker_id: str, addr: str, model: str, model_sha256: str, n_slots: int, age_s: float = 0.0
    ) -> None:
        with self._connection() as (conn, _):
            conn.execute(
                "INSERT INTO worker_sightings (worker_id, addr, model, model_sha256, n_slots, replica_id, seen_at)"
                " VALUES (%s, %s, %s, %s, %s, %s, EXTRACT(EPOCH FROM clock_timestamp()) - %s)"
                " ON CONFLICT (worker_id) DO UPDATE SET addr = excluded.addr, model = excluded.model,"
                " model_sha256 = excluded.model_sha256, n_slots = excluded.n_slots,"
                " replica_id = excluded.replica_id, seen_at = excluded.seen_at",
                (worker_id, addr, model, model_sha256, int(n_slots), self.replica_id, max(0.0, float(age_s))),
            )

    @_unavailable
    def recent_workers(self, max_age_s: float) -> Sightings:
        with self._connection() as (conn, _), conn.cursor(row_factory=dict_row) as cur:
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

    # -- tenants (`control_plane.store.postgres_tenants`) -----------------------------

    @_unavailable
    def add_tenant(self, record: TenantRecord, key_sha256: str) -> TenantRecord:
        return self._tenants.add(record, key_sha256)

    @_unavailable
    def update_tenant(self, name: str, changes: Mapping[str, float | int]) -> TenantRecord | None:
        return self._tenants.update(name, changes)

    @_unavailable
    def remove_tenant(self, name: str) -> bool:
        return self._tenants.remove(name)

    @_unavailable
    def tenant_keys(self) -> dict[str, str]:
        return self._tenants.keys()

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
        return self._tenants.sync(deltas, in_flight, in_flight_ttl_s, released=released, claim_lease_s=claim_lease_s)

    @_unavailable
    def admit_tenant_request(self, name: str, *, claim_id: str, tokens: float, lease_s: float) -> AdmissionClaim | None:
        return self._tenants.admit(name, claim_id=claim_id, tokens=tokens, lease_s=lease_s)

    @_unavailable
    def settle_tenant_request(self, name: str, claim_id: str | None, delta: UsageDelta) -> None:
        self._tenants.settle(name, claim_id, delta)

    def close(self) -> None:
        self._pool.close()
        self._watchdog.close()


class _AlreadyRegistered(Exception):
    """Raised inside `PostgresStore.insert`'s transaction to roll it back."""

    def __init__(self, record: AdapterRecord) -> None:
        super().__init__(record.sha256)
        self.record = record


def _removed_record(row: Mapping[str, Any]) -> AdapterRecord:
    """The record of a row just deleted; a row that does not parse (a bad row being removed)
    gives its id, sha256, name and path as stored and defaults for the rest."""
    try:
        return AdapterRecord.from_row(row)
    except DataCorruptionError:
        return AdapterRecord(
            id=int(row["id"]), sha256=str(row["sha256"]), name=str(row["name"]), path=str(row["path"]), metadata={}
        )
