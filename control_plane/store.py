"""SQLite persistence of the adapter registry and the global default adapter set.

Owned by the control-plane process; one `AdapterStore` per data dir. Stdlib ``sqlite3`` in WAL
mode, one connection guarded by a lock (gRPC handlers run on a thread pool).

Ids (CONTRACT.md): non-negative, assigned from 0 in registration order, never reused, stable
across restarts. SQLite's AUTOINCREMENT starts at 1 and the rowid rules reuse ids after the
highest row is deleted, so ids come from an explicit one-row counter table instead,
incremented in the same transaction as the insert.

The default set is the ``default_scale`` column: every registered adapter has an entry, 0
meaning detached (llama-server's global list works the same way). Removing an adapter removes
its entry with the row.

Schema changes go in `MIGRATIONS` (append only); `schema_version` records how many ran.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DB_FILENAME = "loraplane.sqlite3"

# Append-only: entry i upgrades the schema from version i to i + 1.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE id_counter (
               singleton INTEGER PRIMARY KEY CHECK (singleton = 0),
               next_id INTEGER NOT NULL
           )""",
        "INSERT INTO id_counter (singleton, next_id) VALUES (0, 0)",
        """CREATE TABLE adapters (
               id INTEGER PRIMARY KEY CHECK (id >= 0),
               sha256 TEXT NOT NULL UNIQUE,
               name TEXT NOT NULL,
               path TEXT NOT NULL,
               metadata TEXT NOT NULL,
               default_scale REAL NOT NULL DEFAULT 0,
               created_at REAL NOT NULL
           )""",
    ),
    # 1 → 2: the format the adapter was registered from ("gguf", or "peft" when a PEFT folder
    # was converted on the fly); rows from before the column existed were all GGUF files.
    (
        "ALTER TABLE adapters ADD COLUMN source_format TEXT NOT NULL DEFAULT 'gguf'",
    ),
)


@dataclass(frozen=True)
class AdapterRecord:
    """One registered adapter as stored.

    Attributes:
        id: the control plane's id (registration order from 0, never reused).
        sha256: hex content hash of the GGUF file (unique).
        name: display name (``general.name`` unless overridden at registration).
        path: where the control plane reads the file (data-dir copy or server path).
        metadata: what validation found (arch, alpha, ranks, targets, aLoRA tokens, ...),
            see `control_plane.registry.adapter_metadata`.
        default_scale: this adapter's scale in the global default set (0: detached).
        created_at: unix time of registration.
        source_format: "gguf", or "peft" for a PEFT folder converted at registration.
    """

    id: int
    sha256: str
    name: str
    path: str
    metadata: dict[str, Any] = field(hash=False, compare=False)
    default_scale: float = 0.0
    created_at: float = 0.0
    source_format: str = "gguf"


class AdapterStore:
    """The adapters table, the id counter and the default set of one data dir."""

    def __init__(self, db_path: str | Path) -> None:
        self.db_path = Path(db_path)
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # isolation_level=None: we issue BEGIN/COMMIT ourselves so each operation is one
        # explicit transaction.
        self._conn = sqlite3.connect(str(self.db_path), check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._migrate()

    # -- schema -------------------------------------------------------------------------

    def _migrate(self) -> None:
        with self._lock:
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                c.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
                row = c.execute("SELECT version FROM schema_version").fetchone()
                if row is None:
                    c.execute("INSERT INTO schema_version (version) VALUES (0)")
                    version = 0
                else:
                    version = int(row["version"])
                if version > len(MIGRATIONS):
                    raise RuntimeError(
                        f"{self.db_path}: schema version {version} is newer than this build "
                        f"knows ({len(MIGRATIONS)}); refusing to open"
                    )
                for statements in MIGRATIONS[version:]:
                    for sql in statements:
                        c.execute(sql)
                c.execute("UPDATE schema_version SET version = ?", (len(MIGRATIONS),))
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise

    @property
    def schema_version(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT version FROM schema_version").fetchone()[0])

    # -- reads --------------------------------------------------------------------------

    def list(self) -> list[AdapterRecord]:
        """Every registered adapter, by id."""
        with self._lock:
            rows = self._conn.execute("SELECT * FROM adapters ORDER BY id").fetchall()
        return [_record(r) for r in rows]

    def get(self, adapter_id: int) -> AdapterRecord | None:
        with self._lock:
            row = self._conn.execute("SELECT * FROM adapters WHERE id = ?", (adapter_id,)).fetchone()
        return _record(row) if row is not None else None

    def get_by_sha256(self, sha256: str) -> AdapterRecord | None:
        with self._lock:
            row = self._conn.execute("SELECT * FROM adapters WHERE sha256 = ?", (sha256,)).fetchone()
        return _record(row) if row is not None else None

    def default_set(self) -> list[tuple[int, float]]:
        """``[(id, scale)]`` over every registered adapter, by id (0: detached)."""
        with self._lock:
            rows = self._conn.execute("SELECT id, default_scale FROM adapters ORDER BY id").fetchall()
        return [(int(r["id"]), float(r["default_scale"])) for r in rows]

    # -- writes -------------------------------------------------------------------------

    def insert(self, *, sha256: str, name: str, path: str, metadata: dict[str, Any],
               default_scale: float = 0.0, source_format: str = "gguf") -> tuple[AdapterRecord, bool]:
        """Register content; ``(record, created)``.

        Content already registered (same sha256) returns the existing record and
        ``created=False``; nothing changes.
        """
        with self._lock:
            c = self._conn
            c.execute("BEGIN IMMEDIATE")
            try:
                row = c.execute("SELECT * FROM adapters WHERE sha256 = ?", (sha256,)).fetchone()
                if row is not None:
                    c.execute("COMMIT")
                    return _record(row), False
                new_id = int(c.execute("SELECT next_id FROM id_counter").fetchone()[0])
                c.execute("UPDATE id_counter SET next_id = ?", (new_id + 1,))
                c.execute(
                    "INSERT INTO adapters (id, sha256, name, path, metadata, default_scale, created_at,"
                    " source_format) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (new_id, sha256, name, path, json.dumps(metadata, sort_keys=True),
                     float(default_scale), time.time(), source_format),
                )
                row = c.execute("SELECT * FROM adapters WHERE id = ?", (new_id,)).fetchone()
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
        return _record(row), True

    def delete(self, adapter_id: int) -> bool:
        """Remove an adapter (and its default-set entry); False when the id is unknown.

        The counter is untouched, so the id is never handed out again.
        """
        with self._lock:
            cur = self._conn.execute("DELETE FROM adapters WHERE id = ?", (adapter_id,))
            return cur.rowcount > 0

    def set_default_scales(self, scales: dict[int, float], *, others: float | None = 0.0) -> None:
        """Set the default scale of the ids in ``scales``, all in one transaction.

        ``others``: the scale every adapter not named gets; None leaves them as they are.
        Callers check the ids exist first (unknown ids are silently ignored here).
        """
        with self._lock:
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

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _record(row: sqlite3.Row) -> AdapterRecord:
    return AdapterRecord(
        id=int(row["id"]),
        sha256=str(row["sha256"]),
        name=str(row["name"]),
        path=str(row["path"]),
        metadata=json.loads(row["metadata"]),
        default_scale=float(row["default_scale"]),
        created_at=float(row["created_at"]),
        source_format=str(row["source_format"]),
    )
