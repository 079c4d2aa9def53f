"""Persistence of the control plane: one interface (`AdapterStore`), two databases.

``open_store(url, data_dir)`` picks the implementation from ``--database``:

- ``sqlite:///PATH`` (or none: ``<data-dir>/loraplane.sqlite3``) → `SqliteStore`;
- ``postgresql://…`` / ``postgres://…`` → `PostgresStore` (imported only then, so a SQLite
  deployment does not need psycopg at import time).

See `control_plane.store.base` for the rules both keep and `control_plane.store.migrations`
for the schema.
"""

from __future__ import annotations

from pathlib import Path

from control_plane.store.base import AdapterRecord, AdapterStore, SchemaTooNewError, WorkerSighting
from control_plane.store.migrations import MIGRATIONS
from control_plane.store.sqlite import DB_FILENAME, SqliteStore

__all__ = [
    "DB_FILENAME",
    "MIGRATIONS",
    "AdapterRecord",
    "AdapterStore",
    "SchemaTooNewError",
    "SqliteStore",
    "WorkerSighting",
    "default_database_url",
    "open_store",
]

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def default_database_url(data_dir: str | Path) -> str:
    """``sqlite:///<data-dir>/loraplane.sqlite3`` (an absolute path gives four slashes)."""
    return f"sqlite:///{Path(data_dir) / DB_FILENAME}"


def open_store(url: str | None, data_dir: str | Path, *, pool_size: int | None = None) -> AdapterStore:
    """Open (and migrate) the store ``url`` names; None means the SQLite default under ``data_dir``.

    Uploaded adapter files of the SQLite store go to ``<data-dir>/adapters/``.

    Raises:
        ValueError: an unsupported scheme or an empty SQLite path.
        UnavailableError: PostgreSQL cannot be reached.
        SchemaTooNewError: a newer build migrated the database.
    """
    url = url or default_database_url(data_dir)
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///") :]
        if not path:
            raise ValueError(f"--database {url!r}: no file path after sqlite:///")
        return SqliteStore(path, Path(data_dir) / "adapters")
    if url.startswith(POSTGRES_SCHEMES):
        from control_plane.store.postgres import DEFAULT_POOL_SIZE, PostgresStore

        return PostgresStore(url, pool_size=pool_size or DEFAULT_POOL_SIZE)
    scheme = url.split(":", 1)[0] if ":" in url else url
    raise ValueError(
        f"--database: unsupported URL scheme {scheme!r} in {url[:40]!r}; "
        "use sqlite:///PATH or postgresql://USER@HOST:PORT/DB"
    )
