"""Versioned schema migrations, one list for both databases.

`MIGRATIONS[i]` upgrades the schema from version ``i`` to ``i + 1``; the list is append-only
(never edit an entry that has shipped). Each entry carries the same change spelled for
SQLite and for PostgreSQL, where their types differ (``BLOB``/``BYTEA``, ``REAL``/``DOUBLE
PRECISION``, ``INTEGER``/``BIGINT``); the tables, columns, keys and constraints are the same.

``schema_version`` (one row) records how many entries ran. Each store applies the missing
entries at start-up, all in one transaction:

- SQLite: under ``BEGIN IMMEDIATE`` (the database's write lock), so a second process
  opening the same file waits.
- PostgreSQL: under ``pg_advisory_xact_lock(MIGRATION_LOCK_KEY)``, so two replicas starting
  at once serialise: the second waits, then finds the schema current and does nothing.
  PostgreSQL DDL is transactional, so a replica that dies mid-migration leaves the old
  schema, not half of the new one.

A database at a version newer than this build knows is refused (`SchemaTooNewError`): a
rolling update must not let an old replica write to a schema it does not understand.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Migration:
    """One schema step: what it is for, and its statements in each SQL dialect."""

    description: str
    sqlite: tuple[str, ...]
    postgres: tuple[str, ...]


MIGRATION_LOCK_KEY = 0x6C6F7261706C616E  # "loraplan": the PostgreSQL advisory lock of migrations

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        "adapters, the id counter (ids from 0, never reused) and the default set",
        sqlite=(
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
        postgres=(
            """CREATE TABLE id_counter (
                   singleton INTEGER PRIMARY KEY CHECK (singleton = 0),
                   next_id BIGINT NOT NULL
               )""",
            "INSERT INTO id_counter (singleton, next_id) VALUES (0, 0)",
            """CREATE TABLE adapters (
                   id BIGINT PRIMARY KEY CHECK (id >= 0),
                   sha256 TEXT NOT NULL UNIQUE,
                   name TEXT NOT NULL,
                   path TEXT NOT NULL,
                   metadata TEXT NOT NULL,
                   default_scale DOUBLE PRECISION NOT NULL DEFAULT 0,
                   created_at DOUBLE PRECISION NOT NULL
               )""",
        ),
    ),
    Migration(
        "adapter bytes by content (PostgreSQL), removals feed, worker sightings (replicas)",
        sqlite=(
            """CREATE TABLE adapter_blobs (
                   sha256 TEXT NOT NULL,
                   seq INTEGER NOT NULL CHECK (seq >= 0),
                   data BLOB NOT NULL,
                   PRIMARY KEY (sha256, seq)
               )""",
            """CREATE TABLE removed_adapters (
                   adapter_id INTEGER PRIMARY KEY,
                   sha256 TEXT NOT NULL,
                   removed_at REAL NOT NULL
               )""",
            """CREATE TABLE worker_sightings (
                   worker_id TEXT PRIMARY KEY,
                   addr TEXT NOT NULL,
                   model TEXT NOT NULL,
                   model_sha256 TEXT NOT NULL,
                   n_slots INTEGER NOT NULL,
                   replica_id TEXT NOT NULL,
                   seen_at REAL NOT NULL
               )""",
        ),
        postgres=(
            """CREATE TABLE adapter_blobs (
                   sha256 TEXT NOT NULL,
                   seq INTEGER NOT NULL CHECK (seq >= 0),
                   data BYTEA NOT NULL,
                   PRIMARY KEY (sha256, seq)
               )""",
            """CREATE TABLE removed_adapters (
                   adapter_id BIGINT PRIMARY KEY,
                   sha256 TEXT NOT NULL,
                   removed_at DOUBLE PRECISION NOT NULL
               )""",
            """CREATE TABLE worker_sightings (
                   worker_id TEXT PRIMARY KEY,
                   addr TEXT NOT NULL,
                   model TEXT NOT NULL,
                   model_sha256 TEXT NOT NULL,
                   n_slots INTEGER NOT NULL,
                   replica_id TEXT NOT NULL,
                   seen_at DOUBLE PRECISION NOT NULL
               )""",
        ),
    ),
    Migration(
        "the format an adapter was registered from: 'gguf', or 'peft' (a PEFT folder converted "
        "on the fly); rows from before were all GGUF files",
        sqlite=("ALTER TABLE adapters ADD COLUMN source_format TEXT NOT NULL DEFAULT 'gguf'",),
        postgres=("ALTER TABLE adapters ADD COLUMN source_format TEXT NOT NULL DEFAULT 'gguf'",),
    ),
    Migration(
        "adapter pin flag: pinned adapters are never evicted from workers' pools",
        sqlite=("ALTER TABLE adapters ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0",),
        postgres=("ALTER TABLE adapters ADD COLUMN pinned BOOLEAN NOT NULL DEFAULT FALSE",),
    ),
    Migration(
        "adapter aliases: other names an adapter is served under (a JSON list of strings), "
        "added when known content is loaded again under a new name",
        sqlite=("ALTER TABLE adapters ADD COLUMN aliases TEXT NOT NULL DEFAULT '[]'",),
        postgres=("ALTER TABLE adapters ADD COLUMN aliases TEXT NOT NULL DEFAULT '[]'",),
    ),
    Migration(
        "tenants: limits, token and request buckets (levels as of level_at, the database's "
        "clock), totals; their API keys by sha256; in-flight requests per (tenant, replica)",
        sqlite=(
            """CREATE TABLE tenants (
                   name TEXT PRIMARY KEY,
                   weight REAL NOT NULL DEFAULT 1 CHECK (weight > 0),
                   priority INTEGER NOT NULL DEFAULT 0,
                   max_concurrent INTEGER NOT NULL DEFAULT 0 CHECK (max_concurrent >= 0),
                   tokens_per_minute INTEGER NOT NULL DEFAULT 0 CHECK (tokens_per_minute >= 0),
                   requests_per_minute INTEGER NOT NULL DEFAULT 0 CHECK (requests_per_minute >= 0),
                   tokens_level REAL NOT NULL DEFAULT 0,
                   requests_level REAL NOT NULL DEFAULT 0,
                   level_at REAL NOT NULL,
                   requests_total INTEGER NOT NULL DEFAULT 0,
                   tokens_total INTEGER NOT NULL DEFAULT 0,
                   rejected_total INTEGER NOT NULL DEFAULT 0,
                   created_at REAL NOT NULL
               )""",
            """CREATE TABLE tenant_keys (
                   key_sha256 TEXT PRIMARY KEY,
                   tenant TEXT NOT NULL,
                   created_at REAL NOT NULL
               )""",
            "CREATE INDEX tenant_keys_by_tenant ON tenant_keys (tenant)",
            """CREATE TABLE tenant_in_flight (
                   tenant TEXT NOT NULL,
                   replica_id TEXT NOT NULL,
                   in_flight INTEGER NOT NULL,
                   seen_at REAL NOT NULL,
                   PRIMARY KEY (tenant, replica_id)
               )""",
        ),
        postgres=(
            """CREATE TABLE tenants (
                   name TEXT PRIMARY KEY,
                   weight DOUBLE PRECISION NOT NULL DEFAULT 1 CHECK (weight > 0),
                   priority INTEGER NOT NULL DEFAULT 0,
                   max_concurrent BIGINT NOT NULL DEFAULT 0 CHECK (max_concurrent >= 0),
                   tokens_per_minute BIGINT NOT NULL DEFAULT 0 CHECK (tokens_per_minute >= 0),
                   requests_per_minute BIGINT NOT NULL DEFAULT 0 CHECK (requests_per_minute >= 0),
                   tokens_level DOUBLE PRECISION NOT NULL DEFAULT 0,
                   requests_level DOUBLE PRECISION NOT NULL DEFAULT 0,
                   level_at DOUBLE PRECISION NOT NULL,
                   requests_total BIGINT NOT NULL DEFAULT 0,
                   tokens_total BIGINT NOT NULL DEFAULT 0,
                   rejected_total BIGINT NOT NULL DEFAULT 0,
                   created_at DOUBLE PRECISION NOT NULL
               )""",
            """CREATE TABLE tenant_keys (
                   key_sha256 TEXT PRIMARY KEY,
                   tenant TEXT NOT NULL,
                   created_at DOUBLE PRECISION NOT NULL
               )""",
            "CREATE INDEX tenant_keys_by_tenant ON tenant_keys (tenant)",
            """CREATE TABLE tenant_in_flight (
                   tenant TEXT NOT NULL,
                   replica_id TEXT NOT NULL,
                   in_flight INTEGER NOT NULL,
                   seen_at DOUBLE PRECISION NOT NULL,
                   PRIMARY KEY (tenant, replica_id)
               )""",
        ),
    ),
    Migration(
        "tenant concurrency claims: one row per admitted request of a tenant with max_concurrent "
        "(its replica, its lease's expiry on the database's clock), and their count on the "
        "tenant's row, so admission is one guarded UPDATE across replicas",
        sqlite=(
            "ALTER TABLE tenants ADD COLUMN claims INTEGER NOT NULL DEFAULT 0 CHECK (claims >= 0)",
            """CREATE TABLE tenant_claims (
                   claim_id TEXT PRIMARY KEY,
                   tenant TEXT NOT NULL,
                   replica_id TEXT NOT NULL,
                   expires_at REAL NOT NULL
               )""",
            "CREATE INDEX tenant_claims_by_replica ON tenant_claims (replica_id)",
            "CREATE INDEX tenant_claims_by_expiry ON tenant_claims (expires_at)",
            "CREATE INDEX tenant_claims_by_tenant ON tenant_claims (tenant)",
        ),
        postgres=(
            "ALTER TABLE tenants ADD COLUMN claims BIGINT NOT NULL DEFAULT 0 CHECK (claims >= 0)",
            """CREATE TABLE tenant_claims (
                   claim_id TEXT PRIMARY KEY,
                   tenant TEXT NOT NULL,
                   replica_id TEXT NOT NULL,
                   expires_at DOUBLE PRECISION NOT NULL
               )""",
            "CREATE INDEX tenant_claims_by_replica ON tenant_claims (replica_id)",
            "CREATE INDEX tenant_claims_by_expiry ON tenant_claims (expires_at)",
            "CREATE INDEX tenant_claims_by_tenant ON tenant_claims (tenant)",
        ),
    ),
)

SCHEMA_VERSION_DDL = "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)"
