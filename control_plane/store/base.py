"""The one interface of the control plane's persistent state, whatever the database.

`AdapterStore` is opened from ``--database`` by `control_plane.store.open_store`, one per
control-plane process, as `control_plane.store.sqlite.SqliteStore` (one process) or
`control_plane.store.postgres.PostgresStore` (several replicas). It holds adapters
(`AdapterRecord`) and their bytes, names and aliases, the default set, removed adapters and
worker sightings (`WorkerSighting`); every read goes to the database. `BadRows` skips and logs
rows that do not parse; calls are bounded by `CALL_TIMEOUT_S` and raise
`control_plane.errors.DatabaseUnavailableError`; a schema newer than this build raises
`SchemaTooNewError`. ``tests/integration/test_store.py`` runs the same rules against both.

The rules every implementation keeps (ids, content addressing, names, bad rows):
docs/architecture.md, "The store"; outages: docs/operations.md, "Data dir, databases, replicas".
"""

from __future__ import annotations

import json
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog

from control_plane.errors import DataCorruptionError
from control_plane.store.tenant_records import AdmissionClaim, TenantRecord, TenantStates, UsageDelta

log = structlog.get_logger("loraplane.control_plane.store.base")

CALL_TIMEOUT_S = 2.0
"""The most one store call may take before it fails with `DatabaseUnavailableError`, seconds:
PostgreSQL's connect timeout, the wait for a pooled connection, and each statement (client-side
deadline and server-side ``statement_timeout``); SQLite's busy timeout after start-up."""


class SchemaTooNewError(RuntimeError):
    """The database was migrated by a newer build than this one; refuse to start."""


class _Row(Protocol):
    """A database row readable by column name."""

    def __getitem__(self, key: str, /) -> Any: ...


@dataclass(frozen=True)
class AdapterRecord:
    """One registered adapter as stored.

    Attributes:
        id: the control plane's id (registration order from 0, never reused).
        sha256: hex content hash of the GGUF file (unique; the key of its bytes).
        name: display name (``general.name`` unless overridden at registration).
        path: where the bytes are, for people: the SQLite store's file (an upload's copy under
            the data dir, or the server path it was registered from), or, in PostgreSQL,
            ``postgresql:adapter_blobs/<sha256>`` for an upload and the path it was copied
            from for a server path or start-up flag.
        metadata: what validation found (arch, alpha, ranks, targets, aLoRA tokens, ...),
            see `control_plane.registry.adapter_metadata`.
        default_scale: this adapter's scale in the global default set (0: detached).
        created_at: unix time of registration, seconds.
        source_format: "gguf", or "peft" for a PEFT folder converted at registration.
        pinned: never evicted from a worker's slot pool or host cache.
        aliases: other names it is served under, oldest first (`AdapterStore.set_names`).
    """

    id: int
    sha256: str
    name: str
    path: str
    metadata: dict[str, Any] = field(hash=False, compare=False)
    default_scale: float = 0.0
    created_at: float = 0.0
    source_format: str = "gguf"
    pinned: bool = False
    aliases: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Every name this adapter answers to: its name (when non-empty), then its aliases."""
        return ((self.name,) if self.name else ()) + self.aliases

    @classmethod
    def from_row(cls, row: _Row) -> AdapterRecord:
        """The record of one ``adapters`` table row, read by column name (an ``sqlite3.Row`` or
        a psycopg dict row: both stores share the schema of ``control_plane.store.migrations``).

        Raises:
            DataCorruptionError: a column does not parse (``metadata`` not a JSON object of the
                shape `adapter_metadata` writes, a non-numeric scale, ...), naming the row id
                and the column.
        """
        row_id = _row_id(row)
        column = "id"
        try:
            column = "metadata"
            metadata = _check_metadata(json.loads(row["metadata"]))
            column = "default_scale"
            default_scale = float(row["default_scale"])
            if not math.isfinite(default_scale) or default_scale < 0:
                raise ValueError(f"{default_scale} is not a finite non-negative number")
            column = "created_at"
            created_at = float(row["created_at"])
            fields = {}
            for column in ("sha256", "name", "path", "source_format"):
                value = row[column]
                if not isinstance(value, str):
                    raise ValueError(f"{type(value).__name__}, not text")
                fields[column] = value
            column = "pinned"
            pinned = row["pinned"]
            if pinned not in (0, 1, True, False):
                raise ValueError(f"{pinned!r} is not a flag")
            column = "aliases"
            aliases = json.loads(row["aliases"])
            if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
                raise ValueError("not a JSON list of non-empty strings")
            return cls(
                id=int(row["id"]),
                metadata=metadata,
                default_scale=default_scale,
                created_at=created_at,
                pinned=bool(pinned),
                aliases=tuple(aliases),
                **fields,
            )
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise DataCorruptionError(
                f"adapter {row_id}: its database row does not parse ({column}: {exc}); it is skipped by "
                "listing and routing: fix the row or unregister the adapter"
            ) from None


# What `control_plane.registry.adapter_metadata` writes: key → accepted JSON types. Keys may be
# missing (older rows); present ones must have these types (`control_plane.convert` reads them).
_METADATA_TYPES: dict[str, tuple[type, ...]] = {
    "general_name": (str,),
    "arch": (str,),
    "alpha": (int, float),
    "ranks": (list,),
    "target_tensors": (list,),
    "task_name": (str,),
    "prompt_prefix": (str,),
    "alora_invocation_tokens": (list,),
    "alora_invocation_text": (str,),
    "size_bytes": (int,),
    "n_nodes": (int,),
}
_METADATA_ITEM_TYPES: dict[str, type] = {"ranks": int, "target_tensors": str, "alora_invocation_tokens": int}


def _check_metadata(value: Any) -> dict[str, Any]:
    """``value`` when it is a JSON object whose known keys have the types they are written with.

    Raises:
        ValueError: naming the key at fault.
    """
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, not an object")
    for key, types in _METADATA_TYPES.items():
        if key not in value:
            continue
        item: Any = value[key]
        if isinstance(item, bool) or not isinstance(item, types):
            raise ValueError(f"key {key!r} is {type(item).__name__}, not {'/'.join(t.__name__ for t in types)}")
        inner = _METADATA_ITEM_TYPES.get(key)
        if inner is None:
            continue
        listed: list[Any] = value[key]
        if not all(isinstance(x, inner) and not isinstance(x, bool) for x in listed):
            raise ValueError(f"key {key!r} holds a non-{inner.__name__} item")
    return value


def _row_id(row: _Row) -> str:
    try:
        return str(int(row["id"]))
    except (ValueError, TypeError, KeyError, IndexError):
        return "(unreadable id)"


class BadRows:
    """Parses adapter rows for listing, skipping (and logging) the ones that do not parse.

    A warning ``adapter_row_skipped`` naming the row id and the reason is logged the first time
    a row is skipped and again at most every `REPEAT_S` seconds while it stays bad (listing
    runs on every request: one bad row must not flood the log).
    """

    REPEAT_S = 60.0

    def __init__(self, database: str) -> None:
        self.database = database
        self._lock = threading.Lock()
        self._logged: dict[str, float] = {}

    def records(self, rows: Iterable[_Row]) -> list[AdapterRecord]:
        """The records of ``rows`` that parse, in order."""
        out = []
        for row in rows:
            try:
                out.append(AdapterRecord.from_row(row))
            except DataCorruptionError as exc:
                self.skipped(_row_id(row), str(exc))
        return out

    def default_scales(self, rows: Iterable[_Row]) -> DefaultScales:
        """``[(id, default scale)]`` of ``rows`` (whole ``adapters`` rows): a row whose scale is
        non-zero must parse whole (a request with no adapter map will use it); a detached row
        needs only a readable id and scale (it is only checked against, never used)."""
        out = []
        for row in rows:
            try:
                scale = float(row["default_scale"])
                if scale != 0.0:
                    rec = AdapterRecord.from_row(row)
                    out.append((rec.id, rec.default_scale))
                else:
                    out.append((int(row["id"]), 0.0))
            except DataCorruptionError as exc:
                self.skipped(_row_id(row), str(exc))
            except (ValueError, TypeError) as exc:
                self.skipped(_row_id(row), f"default_scale: {exc}")
        return out

    def skipped(self, row_id: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._logged.get(row_id)
            if last is not None and now - last < self.REPEAT_S:
                return
            self._logged[row_id] = now
        log.warning("adapter_row_skipped", adapter_id=row_id, database=self.database, reason=reason)


NameEdit = Callable[["AdapterRecord", list["AdapterRecord"]], tuple[str, tuple[str, ...]]]
"""``edit(record, all_records) -> (name, aliases)`` of `AdapterStore.set_names`."""

DefaultScales = list[tuple[int, float]]
"""``[(adapter id, default scale)]`` by id (a module-level alias: the stores' ``list`` method
shadows the builtin inside their class bodies)."""


@dataclass(frozen=True)
class WorkerSighting:
    """A worker's last heartbeat as some replica recorded it.

    Attributes:
        worker_id / addr / model / model_sha256 / n_slots: the worker's ``WorkerHello``.
        replica_id: the replica that recorded the heartbeat (`AdapterStore.replica_id`).
        age_s: seconds since that heartbeat, measured by the database's clock (PostgreSQL)
            or this host's (SQLite), so replicas on skewed hosts agree.
    """

    worker_id: str
    addr: str
    model: str
    model_sha256: str
    n_slots: int
    replica_id: str
    age_s: float


Sightings = list[WorkerSighting]


class AdapterStore(ABC):
    """Adapters, their bytes, the default set, removals and worker sightings.

    Thread-safe: gRPC handlers call it from a thread pool.

    Attributes:
        replica_id: a random id of this process (worker sightings name who recorded them).
        description: the database for messages and logs, without credentials.
    """

    replica_id: str
    description: str

    # -- schema ---------------------------------------------------------------------------

    @property
    @abstractmethod
    def schema_version(self) -> int:
        """How many of `control_plane.store.migrations.MIGRATIONS` have been applied."""
        raise NotImplementedError

    # -- adapters: reads --------------------------------------------------------------------

    @abstractmethod
    def list(self) -> list[AdapterRecord]:
        """Every registered adapter, by id."""
        raise NotImplementedError

    @abstractmethod
    def get(self, adapter_id: int) -> AdapterRecord | None:
        """The adapter with this id, or None."""
        raise NotImplementedError

    @abstractmethod
    def get_by_sha256(self, sha256: str) -> AdapterRecord | None:
        """The adapter with this content hash, or None."""
        raise NotImplementedError

    @abstractmethod
    def default_set(self) -> DefaultScales:
        """``[(id, scale)]`` over every registered adapter, by id (0: detached)."""
        raise NotImplementedError

    @abstractmethod
    def read_chunks(self, record: AdapterRecord, chunk_size: int) -> Iterator[bytes]:
        """The adapter's bytes, in pieces of at most ``chunk_size`` bytes.

        Raises:
            OSError: the bytes are gone (a SQLite server-path file deleted under us).
            UnavailableError: the database is unreachable.
        """
        raise NotImplementedError

    # -- adapters: writes ----------------------------------------------------------------------

    @abstractmethod
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
        """Register ``content`` (a validated GGUF whose sha256 is ``sha256``): ``(record, created)``.

        Args:
            content: the file holding the bytes.
            source_format: what the GGUF was made from ("gguf", or "peft"), stored as is.
            source: None when ``content`` is an upload's temporary file (the store may move
                it; the caller deletes whatever is left); else the server path ``content`` was
                registered from (it stays where it is).

        Content already registered (same sha256) returns the existing record and
        ``created=False``; nothing changes. Atomic: a crash leaves the whole adapter
        (row and bytes) or nothing.
        """
        raise NotImplementedError

    @abstractmethod
    def delete(self, adapter_id: int, *, only_if_nameless: bool = False) -> AdapterRecord | None:
        """Remove an adapter, its default-set entry and its bytes (if the store owns them),
        and record the removal (`removed_ids`); the removed record, or None when the id is
        unknown. The counter is untouched, so the id is never handed out again.

        ``only_if_nameless``: remove it only if it has no name and no aliases as of this
        transaction (None otherwise, nothing changes): a name given to it meanwhile (an alias
        load racing an unload, `AdapterRegistry.unload_name`) keeps it."""
        raise NotImplementedError

    @abstractmethod
    def set_default_scales(self, scales: Mapping[int, float], *, others: float | None = 0.0) -> None:
        """Set the default scale of the ids in ``scales``, all in one transaction.

        ``others``: the scale every adapter not named gets; None leaves them as they are.
        Callers check the ids exist first (unknown ids are silently ignored here).
        """
        raise NotImplementedError

    @abstractmethod
    def set_pinned(self, adapter_id: int, pinned: bool) -> AdapterRecord | None:
        """Set an adapter's pin flag; the updated record, or None when the id is unknown."""
        raise NotImplementedError

    @abstractmethod
    def set_names(self, adapter_id: int, edit: NameEdit) -> AdapterRecord | None:
        """Change an adapter's name and aliases in one transaction that serialises name
        changes (SQLite's write lock; PostgreSQL: every ``adapters`` row locked ``FOR UPDATE``).

        ``edit(record, all_records)`` returns the new ``(name, aliases)``; it sees every record
        that parses as of the transaction, so it can refuse a name another adapter holds by
        raising (the transaction rolls back and the error propagates). The updated record, or
        None when the id is unknown (``edit`` is not called).
        """
        raise NotImplementedError

    @abstractmethod
    def removed_ids(self) -> set[int]:
        """Ids unregistered (through any replica) in the last `REMOVALS_KEPT_S` seconds."""
        raise NotImplementedError

    # -- worker sightings ----------------------------------------------------------------------

    @abstractmethod
    def record_worker(
        self, *, worker_id: str, addr: str, model: str, model_sha256: str, n_slots: int, age_s: float = 0.0
    ) -> None:
        """A worker registered with or heartbeated this replica ``age_s`` seconds ago (0: now;
        `control_plane.replicas` writes sightings from a thread of its own, a little later)."""
        raise NotImplementedError

    @abstractmethod
    def recent_workers(self, max_age_s: float) -> Sightings:
        """Workers whose last recorded heartbeat is at most ``max_age_s`` old; sightings older
        than `SIGHTINGS_KEPT_S` are deleted on the way."""
        raise NotImplementedError

    # -- tenants -----------------------------------------------------------------------------

    @abstractmethod
    def add_tenant(self, record: TenantRecord, key_sha256: str) -> TenantRecord:
        """Add a tenant with one API key (its sha256, hex); its buckets start full.

        Raises:
            AlreadyExistsError: the name is taken, or the key already maps to a tenant.
        """
        raise NotImplementedError

    @abstractmethod
    def update_tenant(self, name: str, changes: Mapping[str, float | int]) -> TenantRecord | None:
        """Change some of `TENANT_SETTINGS` (others keep their value); the updated record, or
        None when there is no such tenant. A bucket whose limit changes keeps its level, at
        most the new limit (full when the limit was 0, unlimited, before)."""
        raise NotImplementedError

    @abstractmethod
    def remove_tenant(self, name: str) -> bool:
        """Remove a tenant, its keys and its in-flight rows; False when there is none."""
        raise NotImplementedError

    @abstractmethod
    def tenant_keys(self) -> dict[str, str]:
        """``{key sha256: tenant name}`` over every stored key."""
        raise NotImplementedError

    @abstractmethod
    def sync_tenants(
        self,
        deltas: Mapping[str, UsageDelta],
        in_flight: Mapping[str, int],
        in_flight_ttl_s: float,
        *,
        released: Collection[str] = (),
        claim_lease_s: float = 0.0,
    ) -> TenantStates:
        """One replica's quota sync, in one transaction: delete the claims ``released`` (ids
        whose `settle_tenant_request` failed), extend this replica's other claims to
        ``claim_lease_s`` from now and delete the other replicas' expired ones (0: neither),
        apply ``deltas`` and the claims deleted (one ``UPDATE`` per tenant, in name order, the
        buckets refilled from the database's clock first; unknown names are ignored), write
        this replica's in-flight counts (a count of 0 deletes its row), and return every
        tenant's state (by name) with ``in_flight_others`` summed over the other replicas'
        rows younger than ``in_flight_ttl_s``."""
        raise NotImplementedError

    @abstractmethod
    def admit_tenant_request(self, name: str, *, claim_id: str, tokens: float, lease_s: float) -> AdmissionClaim | None:
        """Admit one request of tenant ``name`` reserving ``tokens``, or refuse it, in one
        statement against the tenant's row (`control_plane.store.tenant_sql`): with
        ``max_concurrent`` the admission writes claim ``claim_id`` (this replica's, its lease
        ``lease_s`` from now). A refusal reads the row's state back (a second call). None: no
        such tenant."""
        raise NotImplementedError

    @abstractmethod
    def settle_tenant_request(self, name: str, claim_id: str | None, delta: UsageDelta) -> None:
        """A request admitted by `admit_tenant_request` ended: apply ``delta`` to tenant
        ``name`` (the tokens given back, the totals) and release claim ``claim_id`` (None: it
        has none), in one transaction; ``claims`` goes down only if the claim was still there
        (not reclaimed after its lease)."""
        raise NotImplementedError

    @abstractmethod
    def close(self) -> None:
        """Release connections (and the pool)."""
        raise NotImplementedError


REMOVALS_KEPT_S = 24 * 3600.0
"""Removal records older than this are pruned: replicas poll them every heartbeat interval,
and a replica started later reconciles each worker with the registry when it adopts it."""

SIGHTINGS_KEPT_S = 3600.0
"""Worker sightings older than this are pruned (the worker is long dead)."""
