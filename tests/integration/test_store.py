"""The store (`control_plane.store`) against both databases: a SQLite file and a real
PostgreSQL server (``postgres_server`` fixture, one per session, a fresh database per test).

Every rule of `control_plane.store.base` is checked on both: ids from 0, never reused, no gap
after a failed registration; one id per content, also under concurrent registration;
atomic registration (row and bytes or nothing); bytes readable back exactly; the default
set; the removals feed; worker sightings; migrations (versioned, concurrent start-up safe,
upgrade from version 1, refusing a newer schema).
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest

from control_plane.store import MIGRATIONS, AdapterStore, SchemaTooNewError, SqliteStore, open_store
from control_plane.store.postgres import BLOB_CHUNK_BYTES, PostgresStore, redact

BACKENDS = ["sqlite", "postgres"]


@pytest.fixture
def open_db(request, tmp_path: Path):
    """``open_db() -> AdapterStore``: a new store on one database per test (call it again for
    a second process's view of the same database)."""
    backend = request.param
    url = (
        f"sqlite:///{tmp_path / 'db.sqlite3'}"
        if backend == "sqlite"
        else request.getfixturevalue("postgres_server").create_database("store")
    )
    opened: list[AdapterStore] = []

    def open_one() -> AdapterStore:
        store = open_store(url, tmp_path / "data")
        opened.append(store)
        return store

    open_one.url = url  # type: ignore[attr-defined]
    open_one.backend = backend  # type: ignore[attr-defined]
    yield open_one
    for s in opened:
        s.close()


both = pytest.mark.parametrize("open_db", BACKENDS, indirect=True)


def blob(tmp_path: Path, name: str, size: int, seed: int = 0) -> tuple[Path, str]:
    """A file of ``size`` deterministic bytes and its sha256."""
    data = bytes((seed + i * 7) % 251 for i in range(size))
    path = tmp_path / name
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


def upload(store: AdapterStore, tmp_path: Path, name: str, size: int = 1000, seed: int = 0, **meta):
    path, sha = blob(tmp_path, name, size, seed)
    return store.insert(sha256=sha, name=name, metadata=meta, content=path, source=None)


@both
def test_ids_from_zero_dedup_never_reused_and_survive_reopen(open_db, tmp_path):
    store = open_db()
    # ids/bytes, replicas, source_format, pinned, aliases
    assert store.schema_version == len(MIGRATIONS) == 7
    a, created = upload(store, tmp_path, "a", seed=1)
    assert (a.id, created, a.name, a.default_scale) == (0, True, "a", 0.0)
    b, _ = upload(store, tmp_path, "b", seed=2)
    again, created = upload(store, tmp_path, "a-again", seed=1)  # same bytes as "a"
    assert (again, created) == (a, False) and again.name == "a"
    assert store.delete(b.id) == b and store.delete(b.id) is None
    c, _ = upload(store, tmp_path, "c", seed=3, k=[1])
    assert c.id == 2 and store.get(2).metadata == {"k": [1]}
    assert store.get_by_sha256(a.sha256) == a and store.get(b.id) is None
    reopened = open_db()
    assert [r.id for r in reopened.list()] == [0, 2]
    assert upload(reopened, tmp_path, "b2", seed=2)[0].id == 3  # b's content again: a new id


@both
def test_aliases_round_trip_and_name_edits_are_transactions(open_db, tmp_path):
    """`AdapterStore.set_names`: aliases are stored, read back by another connection (a second
    replica's view) and after reopening; an edit that raises changes nothing; an unknown id
    is None without calling the edit."""
    store = open_db()
    a, _ = upload(store, tmp_path, "a", seed=1)
    b, _ = upload(store, tmp_path, "b", seed=2)
    assert a.aliases == () and a.names == ("a",)

    def add(alias):
        return lambda rec, records: (rec.name, (*rec.aliases, alias))

    assert store.set_names(a.id, add("a2")).aliases == ("a2",)
    assert store.set_names(a.id, add("a3")).names == ("a", "a2", "a3")
    seen_by = []

    def refuse(rec, records):
        seen_by.append(sorted(r.id for r in records))
        raise ValueError("taken")

    with pytest.raises(ValueError, match="taken"):
        store.set_names(b.id, refuse)
    assert seen_by == [[a.id, b.id]] and store.get(b.id).aliases == ()
    assert store.set_names(99, refuse) is None and len(seen_by) == 1
    other = open_db()  # another process on the same database
    assert [(r.id, r.name, r.aliases) for r in other.list()] == [(a.id, "a", ("a2", "a3")), (b.id, "b", ())]
    # the name promoted from the oldest alias, as unloading the name does
    promoted = other.set_names(a.id, lambda rec, records: (rec.aliases[0], rec.aliases[1:]))
    assert (promoted.name, promoted.aliases) == ("a2", ("a3",))
    assert store.get_by_sha256(a.sha256).names == ("a2", "a3")


@both
def test_bytes_read_back_exactly_in_chunks(open_db, tmp_path):
    store = open_db()
    size = 2 * BLOB_CHUNK_BYTES + 12345
    rec, _ = upload(store, tmp_path, "big", size=size, seed=5)
    expected = blob(tmp_path, "expected", size, 5)[0].read_bytes()
    pieces = list(open_db().read_chunks(rec, 300_000))  # another connection / process view
    assert b"".join(pieces) == expected
    assert [len(p) for p in pieces] == [300_000] * 7 + [size - 7 * 300_000]


@both
def test_server_path_source(open_db, tmp_path):
    store = open_db()
    path, sha = blob(tmp_path, "on-server.gguf", 5000, 9)
    rec, created = store.insert(sha256=sha, name="srv", metadata={}, content=path, source=str(path))
    assert created and rec.path == str(path) and path.exists()
    if open_db.backend == "postgres":  # copied in: the file may go, every replica still reads it
        path.unlink()
    assert b"".join(store.read_chunks(rec, 1 << 20)) == blob(tmp_path, "x", 5000, 9)[0].read_bytes()


@both
def test_failed_registration_leaves_nothing_and_no_gap(open_db, tmp_path):
    store = open_db()
    upload(store, tmp_path, "first", seed=1)
    path, sha = blob(tmp_path, "doomed", 3 * BLOB_CHUNK_BYTES, 4)
    with pytest.raises(TypeError):  # metadata that cannot be stored fails after the bytes went in
        store.insert(sha256=sha, name="doomed", metadata={"bad": object()}, content=path, source=None)
    assert store.get_by_sha256(sha) is None and [r.id for r in store.list()] == [0]
    if open_db.backend == "postgres":
        with psycopg.connect(open_db.url) as conn:
            assert conn.execute("SELECT count(*) FROM adapter_blobs WHERE sha256 = %s", (sha,)).fetchone() == (0,)
    else:
        assert sorted(p.name for p in (tmp_path / "data" / "adapters").iterdir()) == [f"{store.list()[0].sha256}.gguf"]
    assert upload(store, tmp_path, "next", seed=6)[0].id == 1  # the counter rolled back


@both
def test_default_scales_and_removals_feed(open_db, tmp_path):
    store = open_db()
    ids = [upload(store, tmp_path, n, seed=i)[0].id for i, n in enumerate("abc")]
    assert ids == [0, 1, 2]
    store.set_default_scales({0: 0.5, 2: 1.0})
    other = open_db()  # a second replica reads the change at once
    assert other.default_set() == [(0, 0.5), (1, 0.0), (2, 1.0)]
    other.set_default_scales({1: 2.0}, others=None)
    assert store.default_set() == [(0, 0.5), (1, 2.0), (2, 1.0)]
    assert store.removed_ids() == set()
    store.delete(1)
    assert other.removed_ids() == {1} and other.default_set() == [(0, 0.5), (2, 1.0)]


@both
def test_worker_sightings(open_db):
    a, b = open_db(), open_db()
    a.record_worker(worker_id="w1", addr="10.0.0.1:50061", model="m.gguf", model_sha256="ab", n_slots=4)
    b.record_worker(worker_id="w2", addr="10.0.0.2:50061", model="m.gguf", model_sha256="ab", n_slots=8)
    seen = a.recent_workers(max_age_s=30)
    assert [(s.worker_id, s.addr, s.n_slots, s.replica_id) for s in seen] == [
        ("w1", "10.0.0.1:50061", 4, a.replica_id),
        ("w2", "10.0.0.2:50061", 8, b.replica_id),
    ]
    assert all(0 <= s.age_s < 30 for s in seen)
    b.record_worker(worker_id="w1", addr="10.0.0.9:50061", model="m.gguf", model_sha256="ab", n_slots=4)
    assert [(s.addr, s.replica_id) for s in a.recent_workers(30) if s.worker_id == "w1"] == [
        ("10.0.0.9:50061", b.replica_id)
    ]
    assert a.recent_workers(max_age_s=-1) == []


@both
def test_concurrent_registrations_distinct_and_same_content(open_db, tmp_path):
    a, b = open_db(), open_db()
    files = [blob(tmp_path, f"d{i}", 4000, seed=i) for i in range(20)]
    same = blob(tmp_path, "same", 4000, seed=99)

    def register(args):
        store, (path, sha) = args
        return store.insert(sha256=sha, name=path.name, metadata={}, content=path, source=str(path))

    jobs = [(a if i % 2 else b, f) for i, f in enumerate(files)] + [(a, same), (b, same)] * 4
    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(register, jobs))
    distinct = {r.sha256: r.id for r, _ in results}
    assert sorted(distinct.values()) == list(range(21))
    same_results = [(r.id, created) for r, created in results[20:]]
    assert len({i for i, _ in same_results}) == 1 and sum(c for _, c in same_results) == 1


@both
def test_migrations_concurrent_start_and_too_new(open_db):
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def start():
        barrier.wait()
        try:
            open_db()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    store = open_db()
    assert store.schema_version == len(MIGRATIONS)
    if open_db.backend == "postgres":
        with psycopg.connect(open_db.url, autocommit=True) as conn:
            assert conn.execute("SELECT version FROM schema_version").fetchall() == [(len(MIGRATIONS),)]
            conn.execute("UPDATE schema_version SET version = 99")
        with pytest.raises(SchemaTooNewError, match="schema version 99"):
            PostgresStore(open_db.url)
    else:
        path = open_db.url[len("sqlite:///") :]
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE schema_version SET version = 99")
        with pytest.raises(SchemaTooNewError, match="schema version 99"):
            SqliteStore(path)


def test_sqlite_version_1_data_dir_upgrades_in_place(tmp_path):
    """A data dir written before the PostgreSQL work (schema 1) opens and keeps its rows."""
    db = tmp_path / "old.sqlite3"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO schema_version VALUES (1)")
        for sql in MIGRATIONS[0].sqlite:
            conn.execute(sql)
        conn.execute("INSERT INTO adapters VALUES (0, 'aa', 'old', '/x.gguf', '{}', 0.5, 1.0)")
        conn.execute("UPDATE id_counter SET next_id = 1")
    store = SqliteStore(db, tmp_path / "blobs")
    assert store.schema_version == len(MIGRATIONS) == 7
    assert [(r.id, r.name, r.default_scale, r.pinned, r.aliases) for r in store.list()] == [
        (0, "old", 0.5, False, ())  # migration 5's default: no aliases
    ]
    assert store.get(0).source_format == "gguf"  # migration 3's default for rows from before
    assert store.set_pinned(0, True).pinned is True and store.get(0).pinned is True  # migration 4's column
    assert store.set_pinned(7, True) is None
    store.close()


def test_sqlite_orphan_upload_copies_are_removed_at_open(tmp_path):
    """A crash between moving an upload into place and committing its row leaves a file no
    row names: the next open deletes it (and stale partial uploads)."""
    store = SqliteStore(tmp_path / "db.sqlite3", tmp_path / "blobs")
    kept, _ = upload(store, tmp_path, "kept", seed=1)
    store.close()
    (tmp_path / "blobs" / f"{'f' * 64}.gguf").write_bytes(b"orphan")
    (tmp_path / "blobs" / ".upload-1.part").write_bytes(b"partial")
    SqliteStore(tmp_path / "db.sqlite3", tmp_path / "blobs").close()
    assert sorted(p.name for p in (tmp_path / "blobs").iterdir()) == [f"{kept.sha256}.gguf"]


def test_open_store_urls_and_redaction(tmp_path):
    with pytest.raises(ValueError, match="unsupported URL scheme 'mysql'"):
        open_store("mysql://x/y", tmp_path)
    with pytest.raises(ValueError, match="no file path"):
        open_store("sqlite:///", tmp_path)
    store = open_store(None, tmp_path / "d")
    assert store.description == f"sqlite:///{tmp_path / 'd' / 'loraplane.sqlite3'}"
    store.close()
    assert redact("postgresql://bob:s3cret@db.example:5433/loraplane") == "postgresql://bob@db.example:5433/loraplane"


# slow: psycopg waits out its connect attempts (about 10 s)
@pytest.mark.slow
def test_postgres_unreachable_is_unavailable(tmp_path):
    from control_plane.errors import UnavailableError
    from tests.helpers.postgres_server import free_port

    port = free_port()  # nothing listens there
    with pytest.raises(UnavailableError, match=rf"postgresql://nobody@127.0.0.1:{port}/x: cannot connect"):
        PostgresStore(f"postgresql://nobody:pw@127.0.0.1:{port}/x?connect_timeout=1")


@both
def test_a_row_that_does_not_parse_is_skipped_logged_and_named(open_db, tmp_path):
    """Rows edited behind the store's back (raw SQL): listing and the default set skip them
    with a warning naming the row; asking for one by id says what does not parse; removing it
    works."""
    import structlog

    from control_plane.errors import DataCorruptionError

    store = open_db()
    a, b, c = (upload(store, tmp_path, n, seed=i, arch="gemma3")[0] for i, n in enumerate("abc"))
    store.set_default_scales({c.id: 0.5})
    edits = [("{not json", b.id), ('{"ranks": "x"}', c.id)]
    if open_db.backend == "postgres":
        with psycopg.connect(open_db.url, autocommit=True) as conn:
            for meta, i in edits:
                conn.execute("UPDATE adapters SET metadata = %s WHERE id = %s", (meta, i))
    else:
        with sqlite3.connect(open_db.url[len("sqlite:///") :]) as conn:
            for meta, i in edits:
                conn.execute("UPDATE adapters SET metadata = ? WHERE id = ?", (meta, i))
            conn.execute("UPDATE adapters SET default_scale = 'abc' WHERE id = ?", (a.id,))  # SQLite stores it
    with structlog.testing.capture_logs() as logs:
        listed = store.list()
        again = store.list()  # logged once, not per call
    expected = [] if open_db.backend == "sqlite" else [a.id]
    assert [r.id for r in listed] == [r.id for r in again] == expected
    warned = {e["adapter_id"]: e["reason"] for e in logs if e["event"] == "adapter_row_skipped"}
    assert len([e for e in logs if e["event"] == "adapter_row_skipped"]) == len(warned)
    assert "not json" not in str(warned)  # the reason, not the content
    assert warned[str(b.id)].startswith(f"adapter {b.id}: its database row does not parse (metadata: ")
    assert "key 'ranks' is str, not list" in warned[str(c.id)]
    if open_db.backend == "sqlite":
        assert "default_scale" in warned[str(a.id)]
    # b (detached) can be checked against; c (in the default set) cannot be used, so it is left out
    assert store.default_set() == ([] if open_db.backend == "sqlite" else [(a.id, 0.0)]) + [(b.id, 0.0)]
    for lookup in (lambda: store.get(b.id), lambda: store.get_by_sha256(b.sha256)):
        with pytest.raises(DataCorruptionError, match=rf"^adapter {b.id}: its database row does not parse"):
            lookup()
    removed = store.delete(b.id)
    assert (removed.id, removed.sha256) == (b.id, b.sha256)
    assert store.get(b.id) is None and b.id in store.removed_ids()


@pytest.mark.parametrize("open_db", ["sqlite", pytest.param("postgres", marks=pytest.mark.slow)], indirect=True)
def test_tenants_crud_hashed_keys_and_sync_between_two_replicas(open_db):
    """Tenants on both databases: unique names and keys (only the sha256 is stored), settings
    updates re-basing the buckets, removal with keys and in-flight rows; two stores on one
    database (two replicas) share bucket levels and each other's in-flight counts."""
    from control_plane.errors import AlreadyExistsError
    from control_plane.store.tenant_records import TenantRecord, UsageDelta

    a, b = open_db(), open_db()
    key = hashlib.sha256(b"k" * 16).hexdigest()
    rec = a.add_tenant(TenantRecord("acme", weight=2.0, priority=-1, tokens_per_minute=600, max_concurrent=5), key)
    assert (rec.name, rec.weight, rec.priority, rec.tokens_per_minute, rec.max_concurrent, rec.key_count) == (
        "acme",
        2.0,
        -1,
        600,
        5,
        1,
    )
    with pytest.raises(AlreadyExistsError, match="tenant 'acme' already exists"):
        b.add_tenant(TenantRecord("acme"), hashlib.sha256(b"other").hexdigest())
    with pytest.raises(AlreadyExistsError, match="already belongs to a tenant"):
        b.add_tenant(TenantRecord("beta"), key)
    assert b.tenant_keys() == {key: "acme"}  # the hash, never the key
    (s,) = a.sync_tenants({"acme": UsageDelta(tokens=100, requests_total=1)}, {"acme": 2}, 5.0)
    assert s.tokens_level == pytest.approx(500, abs=1) and s.in_flight_others == 0
    (s,) = b.sync_tenants({"acme": UsageDelta(tokens=50, tokens_total=30, rejected_total=1)}, {"acme": 1}, 5.0)
    assert s.tokens_level == pytest.approx(450, abs=1) and s.in_flight_others == 2
    assert (s.requests_total, s.tokens_total, s.rejected_total) == (1, 30, 1)
    updated = b.update_tenant("acme", {"tokens_per_minute": 300, "weight": 0.5})
    assert updated is not None and (updated.tokens_per_minute, updated.weight, updated.key_count) == (300, 0.5, 1)
    (s,) = a.sync_tenants({}, {"acme": 0}, 5.0)
    assert s.tokens_level == pytest.approx(300, abs=1) and s.in_flight_others == 1  # capped; A's row gone
    assert a.update_tenant("ghost", {"weight": 3.0}) is None
    assert a.remove_tenant("acme") and not a.remove_tenant("acme")
    assert b.tenant_keys() == {} and b.sync_tenants({}, {}, 5.0) == []


@pytest.mark.parametrize("open_db", ["sqlite", pytest.param("postgres", marks=pytest.mark.slow)], indirect=True)
def test_tenant_admission_claims_settling_and_leases(open_db):
    """Admission in the store on both databases: one call takes a request from every limit or
    refuses with the row's state; a claim is released once (a second settle, or a settle after
    the lease was reclaimed, changes nothing); a replica's sync renews its own claims and
    deletes the others' expired ones; 16 threads on two replicas at once never pass a limit."""
    from control_plane.store.tenant_records import TenantRecord, UsageDelta

    a, b = open_db(), open_db()
    a.add_tenant(
        TenantRecord("acme", max_concurrent=2, requests_per_minute=60, tokens_per_minute=100),
        hashlib.sha256(b"acme").hexdigest(),
    )
    assert a.admit_tenant_request("ghost", claim_id="g", tokens=1, lease_s=5.0) is None
    first = a.admit_tenant_request("acme", claim_id="c1", tokens=40, lease_s=5.0)
    assert first is not None and (first.admitted, first.claimed, first.claims, first.max_concurrent) == (
        True,
        True,
        1,
        2,
    )
    assert (first.tokens_level, first.requests_level) == (pytest.approx(60, abs=0.5), pytest.approx(59, abs=0.1))
    second = b.admit_tenant_request("acme", claim_id="c2", tokens=40, lease_s=0.2)  # a short lease
    assert second is not None and (second.admitted, second.claims) == (True, 2)
    busy = a.admit_tenant_request("acme", claim_id="c3", tokens=10, lease_s=5.0)
    assert busy is not None and (busy.admitted, busy.claimed, busy.claims) == (False, False, 2)
    assert busy.tokens_level == pytest.approx(20, abs=0.5)  # the refusal took nothing
    a.settle_tenant_request("acme", "c1", UsageDelta(tokens=-30, tokens_total=10))  # 30 of its 40 back
    a.settle_tenant_request("acme", "c1", UsageDelta())  # again: released once only
    short = a.admit_tenant_request("acme", claim_id="c3", tokens=60, lease_s=5.0)  # 50 left
    assert short is not None and (short.admitted, short.claims) == (False, 1)
    assert short.tokens_level == pytest.approx(50, abs=0.5)
    third = a.admit_tenant_request("acme", claim_id="c3", tokens=50, lease_s=5.0)
    assert third is not None and (third.admitted, third.claims) == (True, 2)

    time.sleep(0.3)  # B's claim c2 expires: the next sync of A deletes it
    (state,) = a.sync_tenants({}, {}, 5.0, claim_lease_s=5.0)
    assert (state.requests_total, state.tokens_total) == (3, 10)
    b.settle_tenant_request("acme", "c2", UsageDelta(tokens_total=5))  # reclaimed already: no double release
    assert a.admit_tenant_request("acme", claim_id="c4", tokens=0, lease_s=5.0).admitted  # type: ignore[union-attr]
    assert not a.admit_tenant_request("acme", claim_id="c5", tokens=0, lease_s=5.0).admitted  # type: ignore[union-attr]
    a.sync_tenants({}, {}, 5.0, released=["c3", "c4"], claim_lease_s=5.0)  # settles that failed, retried
    assert b.admit_tenant_request("acme", claim_id="c5", tokens=0, lease_s=5.0).claims == 1  # type: ignore[union-attr]

    a.add_tenant(TenantRecord("burst", max_concurrent=3, requests_per_minute=5), hashlib.sha256(b"b").hexdigest())
    start = threading.Barrier(16)

    def one(i: int) -> bool:
        start.wait()
        got = (a, b)[i % 2].admit_tenant_request("burst", claim_id=f"burst-{i}", tokens=0, lease_s=5.0)
        return got is not None and got.admitted

    with ThreadPoolExecutor(16) as ex:
        assert sum(ex.map(one, range(16))) == 3  # max_concurrent
    for i in range(16):
        a.settle_tenant_request("burst", f"burst-{i}", UsageDelta())
    start = threading.Barrier(16)
    with ThreadPoolExecutor(16) as ex:
        assert sum(ex.map(one, range(16))) == 2  # the 5 requests a minute, 3 taken already
