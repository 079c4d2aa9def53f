"""Tenants and quotas without a server: the token bucket on an injected clock, key hashing and
lookup, the tenant of a request, name / key / setting checks, and the quota book over a real
SQLite store (admission, settling, refusals with their retry-after, other tenants untouched)."""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from control_plane.errors import (
    AlreadyExistsError,
    DatabaseUnavailableError,
    InvalidArgumentError,
    NotFoundError,
)
from control_plane.quotas import QuotaBook, QuotaExceededError, TokenBucket, retry_after
from control_plane.store import SqliteStore
from control_plane.store.tenant_records import TenantRecord, UsageDelta
from control_plane.tenant_admin import TenantAdmin, check_settings
from control_plane.tenants import (
    ANONYMOUS_TENANT,
    DEFAULT_TENANT,
    TenantDirectory,
    check_key,
    check_tenant_name,
    generate_key,
    key_hash,
    tenant_of,
)
from loraplane.adapter_scales import NO_ADAPTERS


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- the bucket ----------------------------------------------------------------------------


def test_token_bucket_refills_at_limit_per_minute_up_to_capacity():
    b = TokenBucket(600, 600, at=0.0)  # 10 tokens / s
    b.take(600, now=0.0)
    assert b.level(0.0) == 0.0
    assert b.level(1.5) == pytest.approx(15.0)
    assert b.wait_s(25, now=1.5) == pytest.approx(1.0)
    assert b.level(1000.0) == 600.0  # never past the capacity
    b.take(700, now=1000.0)  # several replicas overshot together: negative, refills from there
    assert b.level(1000.0) == -100.0 and b.level(1010.0) == pytest.approx(0.0)
    b.take(-10_000, now=1010.0)  # a give-back never overfills
    assert b.level(1010.0) == 600.0
    with pytest.raises(ValueError):
        TokenBucket(0, 0, at=0.0)


def test_retry_after_is_whole_seconds_rounded_up_at_least_one():
    assert [retry_after(w) for w in (0.0, 0.2, 1.0, 1.01, 59.5)] == [1, 1, 1, 2, 60]


# ---- keys, names, the tenant of a request --------------------------------------------------


def test_keys_are_stored_as_sha256_and_looked_up_by_it():
    key = generate_key()
    assert key.startswith("lp-") and len(key) == 3 + 43
    assert key_hash(key) == hashlib.sha256(key.encode()).hexdigest() and key not in key_hash(key)
    d = TenantDirectory(api_key="the-inference-key", admin_token="the-admin-token")
    d.set_keys({key_hash(key): "acme"})
    assert d.principal(f"Bearer {key}") == "acme"
    assert d.principal(f"bearer   {key}  ") == "acme"
    assert d.principal("Bearer the-inference-key") == DEFAULT_TENANT
    assert d.principal("Bearer the-admin-token") == DEFAULT_TENANT
    assert d.principal("Bearer lp-someone-else-entirely") is None
    assert d.principal(None) is None and d.principal(f"Basic {key}") is None
    assert d.accepts(key) and not d.accepts("the-inference-key")


def test_tenant_of_a_request_key_then_explicit_map_then_anonymous():
    assert tenant_of("acme", "shout") == "acme"
    assert tenant_of(DEFAULT_TENANT, "shout") == DEFAULT_TENANT
    assert tenant_of(None, "shout") == "adapter:shout"
    assert tenant_of(None, "3") == "adapter:3"
    assert tenant_of(None, None) == ANONYMOUS_TENANT
    d = TenantDirectory()
    d.set_records([TenantRecord("adapter:shout", tokens_per_minute=10, weight=2.0, priority=1)])
    limited, free = d.resolve(None, "shout"), d.resolve(None, "other")
    assert (limited.name, limited.weight, limited.priority, limited.record is not None) == (
        "adapter:shout",
        2.0,
        1,
        True,
    )
    assert (free.name, free.weight, free.priority, free.record) == ("adapter:other", 1.0, 0, None)


@pytest.mark.parametrize(
    ("name", "fault"),
    [("", "empty"), ("x" * 129, "129 characters"), ("a\tb", "non-printable"), (" acme", "blank")],
)
def test_bad_tenant_names_are_refused_naming_the_fault(name, fault):
    with pytest.raises(InvalidArgumentError, match=fault):
        check_tenant_name(name)


def test_good_names_keys_and_settings_pass_bad_ones_name_the_fault():
    for name in ("acme", "default", "anonymous", "adapter:shout", "Ünïcode team 7", "x" * 128):
        assert check_tenant_name(name) == name
    assert check_key("k" * 16) == "k" * 16
    for bad, fault in (("short", "5 characters"), ("has blank in it!!", "without blanks"), ("ключ" * 5, "ASCII")):
        with pytest.raises(InvalidArgumentError, match=fault) as err:
            check_key(bad)
        assert bad not in str(err.value)  # a refusal never echoes the key
    assert check_settings({"weight": 2, "tokens_per_minute": 0}) == {"weight": 2.0, "tokens_per_minute": 0}
    for bad, fault in (
        ({"weight": 0}, "weight 0 is not"),
        ({"weight": float("nan")}, "weight nan"),
        ({"max_concurrent": -1}, "max_concurrent -1"),
        # priority 0 is a class, not "unlimited" (what the other settings' messages say of 0)
        ({"priority": 2**31}, r"^priority 2147483648 is not an integer in \[-2147483648, 2147483647\] \(0 is the"),
        ({"tokens_per_minute": True}, "tokens_per_minute True"),
        ({"colour": 1}, "unknown tenant setting 'colour'"),
    ):
        with pytest.raises(InvalidArgumentError, match=fault):
            check_settings(bad)


# ---- the quota book over a real SQLite store ------------------------------------------------


@pytest.fixture
def book(tmp_path: Path):
    store = SqliteStore(tmp_path / "db.sqlite3")
    clock = Clock()
    b = QuotaBook(store, TenantDirectory(), clock=clock)
    b.clock_ = clock  # type: ignore[attr-defined]
    yield b
    store.close()


def admit(book: QuotaBook, name: str, prompt: int = 10, max_tokens: int = 20):
    return book.admit(book.directory.resolve(name, None), max_tokens=max_tokens, prompt_tokens=prompt)


def pass_in_store(book: QuotaBook, name: str, seconds: float) -> None:
    """``seconds`` pass for tenant ``name``'s buckets in the store (their refill runs on the
    database's clock): its level's timestamp moves back."""
    conn = sqlite3.connect(book.store.db_path)  # type: ignore[attr-defined]
    with conn:
        conn.execute("UPDATE tenants SET level_at = level_at - ? WHERE name = ?", (seconds, name))
    conn.close()


def test_tokens_per_minute_refuses_with_retry_after_and_leaves_others_alone(book):
    admin = TenantAdmin(book.store, book)
    admin.add("heavy", {"tokens_per_minute": 120})  # 2 tokens / s
    admin.add("light", {"tokens_per_minute": 120})
    first = [admit(book, "heavy") for _ in range(4)]  # 4 × (10 + 20) = 120 reserved
    with pytest.raises(QuotaExceededError) as refused:
        admit(book, "heavy")
    err = refused.value
    assert (err.tenant, err.reason, err.retry_after_s) == ("heavy", "tokens_per_minute", 15)  # 30 tokens at 2/s
    assert "tenant 'heavy': over tokens_per_minute 120 (the request needs 30 tokens, 0 are left)" in str(err)
    admit(book, "light").settle(10, 20)  # another tenant: untouched
    first[0].settle(10, 2)  # finished early: 18 of its 30 go back, to the store at once
    first[0].settle(10, 2)  # settling twice changes nothing
    assert book.usage("heavy").tokens_available == pytest.approx(18.0, abs=0.5)
    with pytest.raises(QuotaExceededError) as again:
        admit(book, "heavy")
    assert again.value.retry_after_s == 6  # 12 more tokens at 2/s
    pass_in_store(book, "heavy", 6.0)  # the store refills by its own clock
    admit(book, "heavy")
    with pytest.raises(InvalidArgumentError, match="needs 130 tokens .* more than its tokens_per_minute 120"):
        admit(book, "heavy", prompt=10, max_tokens=120)
    # synced: the store holds the level, totals and refusals
    states = {s.record.name: s for s in book.sync() or []}
    heavy = states["heavy"]
    assert (heavy.requests_total, heavy.rejected_total, heavy.tokens_total) == (5, 2, 12)
    assert heavy.tokens_level == pytest.approx(0.0, abs=0.5)  # 120 - 4 × 30 + 18 + 12 refilled - 30


def test_max_concurrent_and_requests_per_minute(book):
    admin = TenantAdmin(book.store, book)
    admin.add("c", {"max_concurrent": 2})
    admin.add("r", {"requests_per_minute": 2})
    a, b = admit(book, "c"), admit(book, "c")
    with pytest.raises(QuotaExceededError) as busy:
        admit(book, "c")
    assert (busy.value.reason, busy.value.retry_after_s) == ("max_concurrent", 1)
    a.settle(10, 20)
    admit(book, "c")
    b.settle(0, 0)
    admit(book, "r")
    admit(book, "r")
    with pytest.raises(QuotaExceededError) as rpm:
        admit(book, "r")
    assert (rpm.value.reason, rpm.value.retry_after_s) == ("requests_per_minute", 30)
    admit(book, "nobody")  # no row: no limits
    admin.add("weighted", {"weight": 3})  # a row without limits: its usage is still accounted
    admit(book, "weighted").settle(3, 4)
    (weighted,) = [s for s in book.sync() or [] if s.record.name == "weighted"]
    assert (weighted.requests_total, weighted.tokens_total, weighted.record.weight) == (1, 7, 3.0)
    assert book.local_in_flight() == {"c": 1, "r": 2, "nobody": 1}


def test_admin_errors_and_limits_changed_at_once(book):
    admin = TenantAdmin(book.store, book)
    view, key = admin.add("acme", {"tokens_per_minute": 60}, api_key="k" * 20)
    assert key == "k" * 20 and view.record.key_count == 1 and view.usage.tokens_available == 60.0
    assert book.directory.tenant_of_key("k" * 20) == "acme"  # refreshed at once, not in a second
    with pytest.raises(AlreadyExistsError, match="tenant 'acme' already exists"):
        admin.add("acme", {})
    with pytest.raises(AlreadyExistsError, match="already belongs to a tenant"):
        admin.add("acme-2", {}, api_key="k" * 20)
    with pytest.raises(NotFoundError, match="tenant 'ghost' not found; tenants: acme"):
        admin.update("ghost", {"weight": 2})
    assert admin.update("acme", {"tokens_per_minute": 30}).usage.tokens_available == 30.0  # capped to the new limit
    assert admin.update("acme", {"tokens_per_minute": 0}).record.tokens_per_minute == 0
    admit(book, "acme", prompt=1000, max_tokens=1000)  # unlimited now
    admin.remove("acme")
    assert book.directory.tenant_of_key("k" * 20) is None and book.directory.record("acme") is None
    with pytest.raises(NotFoundError, match="no tenants are configured"):
        admin.remove("acme")
    for i in range(20):  # a refusal names 16 of them (it listed every tenant)
        admin.add(f"t{i:02d}", {})
    with pytest.raises(NotFoundError, match=r"not found; tenants: t00, t01, .*, t15, … and 4 more$"):
        admin.remove("ghost")


def test_no_new_tenant_may_be_named_other_the_metrics_overflow_label(book):
    admin = TenantAdmin(book.store, book)
    with pytest.raises(InvalidArgumentError, match="tenant name 'other' is reserved: the metrics' tenant label"):
        admin.add("other", {})
    assert book.directory.record("other") is None
    # a row from before the rule can still be changed and removed
    book.store.add_tenant(TenantRecord(name="other"), key_hash("k" * 20))
    book.refresh()
    assert admin.update("other", {"weight": 2}).record.weight == 2.0
    admin.remove("other")


def test_server_credentials_are_never_a_tenant_key(tmp_path: Path):
    store = SqliteStore(tmp_path / "db.sqlite3")
    directory = TenantDirectory(api_key="inference-key-123", admin_token="admin-token-12345")
    book = QuotaBook(store, directory)
    admin = TenantAdmin(store, book)
    for key in ("inference-key-123", "admin-token-12345"):
        with pytest.raises(AlreadyExistsError, match="control plane's --api-key or admin token"):
            admin.add("thief", {}, api_key=key)
    assert [r.name for r in directory.records()] == []
    # a row holding the key anyway (added through a replica with other flags) takes nothing over
    directory.set_keys({key_hash("inference-key-123"): "thief", key_hash("admin-token-12345"): "thief"})
    assert directory.principal("Bearer inference-key-123") == DEFAULT_TENANT
    assert directory.principal("Bearer admin-token-12345") == DEFAULT_TENANT
    store.close()


def test_tokens_reserved_are_capped_by_the_context_a_worker_stops_at(book):
    """A chat request without max_tokens (the HTTP front sends 2^31 - 1: until the context is
    full) reserves what the context leaves after the prompt, not 2^31 tokens."""
    from control_plane.router import Router
    from loraplane.v1 import common_pb2

    admin = TenantAdmin(book.store, book)
    admin.add("acme", {"tokens_per_minute": 300})
    acme = book.directory.resolve("acme", None)
    held = book.admit(acme, max_tokens=2**31 - 1, prompt_tokens=10, context_tokens=256)
    assert book.usage("acme").tokens_available == 44.0  # 300 - 256
    held.settle(10, 246)
    assert book.admit(acme, max_tokens=0, prompt_tokens=10, context_tokens=lambda: 256).reserved == 26  # 10 + 16
    with pytest.raises(InvalidArgumentError, match=r"needs 400 tokens \(400 prompt \+ 0 output tokens"):
        book.admit(acme, max_tokens=5, prompt_tokens=400, context_tokens=256)  # never fits anywhere
    with pytest.raises(InvalidArgumentError, match="tokens_per_minute 300; shorten the prompt"):
        book.admit(acme, max_tokens=5, prompt_tokens=400, context_tokens=256)

    class Registry:
        def resolve(self, asked):
            return NO_ADAPTERS

    class Pool:
        def max_n_ctx(self):
            return 256

    admin.update("acme", {"tokens_per_minute": 200})
    router = Router(Registry(), Pool(), tenants=book.directory, quotas=book)  # type: ignore[arg-type]
    request = common_pb2.GenerateRequest(tokens=common_pb2.TokenIds(ids=list(range(10))))
    request.sampling.max_tokens = 2**31 - 1
    with pytest.raises(InvalidArgumentError, match=r"needs 256 tokens \(10 prompt \+ 246 output tokens the context"):
        next(router.generate(request, None, principal="acme"))  # type: ignore[arg-type]


def test_store_sync_applies_deltas_and_counts_other_replicas_in_flight(tmp_path: Path):
    """Two stores on one SQLite file stand for two replicas' views of the shared rows."""
    a, b = SqliteStore(tmp_path / "db.sqlite3"), SqliteStore(tmp_path / "db.sqlite3")
    try:
        a.add_tenant(TenantRecord("t", tokens_per_minute=600, requests_per_minute=60), key_hash("k" * 16))
        (s,) = a.sync_tenants({"t": UsageDelta(tokens=100, requests=1, requests_total=1)}, {"t": 3}, 5.0)
        assert (s.tokens_level, s.requests_level, s.in_flight_others) == (
            pytest.approx(500, abs=1),
            pytest.approx(59, abs=0.1),
            0,
        )
        (s,) = b.sync_tenants({"t": UsageDelta(tokens=-1000)}, {"t": 1}, 5.0)  # a give-back never overfills
        assert (s.tokens_level, s.in_flight_others, s.requests_total) == (600.0, 3, 1)
        (s,) = a.sync_tenants({}, {"t": 0}, 5.0)  # a count of 0 deletes the row
        assert s.in_flight_others == 1
        assert b.sync_tenants({}, {}, 5.0)[0].in_flight_others == 0
        assert b.sync_tenants({"ghost": UsageDelta(tokens=5)}, {}, 5.0)[0].record.name == "t"  # unknown: ignored
    finally:
        a.close()
        b.close()


class Down:
    """A store whose database is unreachable: every call fails."""

    def __getattr__(self, name: str):
        def unavailable(*args, **kwargs):
            raise DatabaseUnavailableError("sqlite:///db", "disk I/O error")

        return unavailable


def claims_in(path: Path, name: str) -> tuple[int, int]:
    """``(tenants.claims, claim rows)`` of tenant ``name`` in the SQLite file at ``path``."""
    conn = sqlite3.connect(path)
    try:
        (count,) = conn.execute("SELECT claims FROM tenants WHERE name = ?", (name,)).fetchone()
        (rows,) = conn.execute("SELECT COUNT(*) FROM tenant_claims WHERE tenant = ?", (name,)).fetchone()
    finally:
        conn.close()
    return count, rows


def test_two_books_on_one_database_share_every_limit_at_once_and_fail_open_alone(tmp_path: Path):
    """Replicas A and B (two stores on one SQLite file) admit through the database: B refuses the
    tenant the moment A holds its max_concurrent and admits it the moment one of A's requests
    ends, and A's tokens are gone for B with no sync in between; another tenant passes on both.
    With the database unreachable, A decides on its last levels (fail open), keeps its usage
    and the claim it could not release, and writes both with its first sync after; a settle
    that must not block (the client gone) is written by the sync too."""
    db = tmp_path / "db.sqlite3"
    store_a, store_b = SqliteStore(db), SqliteStore(db)
    a, b = QuotaBook(store_a, TenantDirectory()), QuotaBook(store_b, TenantDirectory())
    try:
        TenantAdmin(store_a, a).add("t", {"tokens_per_minute": 100, "max_concurrent": 3})
        TenantAdmin(store_a, a).add("u", {"tokens_per_minute": 100})
        b.refresh()
        held = [admit(a, "t", prompt=10, max_tokens=20) for _ in range(3)]  # 90 of 100 tokens, 3 claims
        with pytest.raises(QuotaExceededError) as busy:
            admit(b, "t", prompt=5, max_tokens=5)
        assert (busy.value.reason, busy.value.retry_after_s) == ("max_concurrent", 1)
        assert "tenant 't': 3 requests in flight, max_concurrent 3" in str(busy.value)
        held[0].settle(10, 20)  # all its reservation used; its claim released at once
        mine = admit(b, "t", prompt=5, max_tokens=5)  # 100 of 100 tokens
        held[1].settle(10, 20)
        with pytest.raises(QuotaExceededError) as over:
            admit(b, "t", prompt=5, max_tokens=5)
        assert over.value.reason == "tokens_per_minute"
        assert "(the request needs 10 tokens, 0 are left)" in str(over.value)
        admit(b, "u").settle(10, 20)
        assert claims_in(db, "t") == (2, 2)  # held[2] and mine

        a.sync()
        a.store = Down()  # type: ignore[assignment]
        assert a.sync() is None
        with pytest.raises(DatabaseUnavailableError):
            a.sync(raise_unavailable=True)
        alone = admit(a, "u", prompt=10, max_tokens=20)  # 70 left as A last read them
        alone.settle(10, 5)
        held[2].settle(10, 20)  # its claim cannot be released now
        assert claims_in(db, "t") == (2, 2)
        a.store = store_a
        assert a.sync() is not None
        assert claims_in(db, "t") == (1, 1)  # released by the sync
        states = {s.record.name: s for s in b.sync() or []}
        assert (states["u"].requests_total, states["u"].tokens_total) == (2, 45)
        assert (states["t"].requests_total, states["t"].rejected_total, states["t"].tokens_total) == (4, 2, 90)
        mine.settle(5, 5, wait=False)  # its client gone: a thread that must not block hands it to the sync
        assert claims_in(db, "t") == (1, 1)
        b.sync()
        assert claims_in(db, "t") == (0, 0)
    finally:
        store_a.close()
        store_b.close()


def test_a_dead_replicas_claims_are_reclaimed_after_the_lease_a_live_ones_never(tmp_path: Path):
    """Replica A takes the tenant's only concurrency claim and dies (never settles, never syncs):
    B refuses the tenant until A's lease expires, then one sync of B reclaims it and B admits.
    B's own claim, renewed by its syncs, outlives many leases."""
    lease = 0.15
    db = tmp_path / "db.sqlite3"
    store_a, store_b = SqliteStore(db), SqliteStore(db)
    a = QuotaBook(store_a, TenantDirectory(), claim_lease_s=lease)
    b = QuotaBook(store_b, TenantDirectory(), claim_lease_s=lease)
    try:
        TenantAdmin(store_a, a).add("t", {"max_concurrent": 1})
        b.refresh()
        admit(a, "t")  # A dies holding it
        b.sync()
        with pytest.raises(QuotaExceededError, match="1 requests in flight, max_concurrent 1"):
            admit(b, "t")
        time.sleep(lease * 1.5)
        b.sync()  # reclaims A's expired claim
        assert claims_in(db, "t") == (0, 0)
        mine = admit(b, "t")
        for _ in range(4):  # two leases: B's claim is renewed by each sync
            time.sleep(lease / 2)
            b.sync()
            a.sync()  # a replica alive again reclaims only expired claims
        assert claims_in(db, "t") == (1, 1)
        with pytest.raises(QuotaExceededError):
            admit(a, "t")
        mine.settle(0, 0)
        admit(a, "t")
    finally:
        store_a.close()
        store_b.close()


def test_a_simultaneous_burst_through_two_replicas_never_passes_a_limit(tmp_path: Path):
    """32 threads admit at once through two stores on one SQLite file: max_concurrent 2 admits
    exactly 2 (they are held), requests_per_minute 10 exactly 10."""
    db = tmp_path / "db.sqlite3"
    stores = [SqliteStore(db), SqliteStore(db)]
    books = [QuotaBook(s, TenantDirectory()) for s in stores]
    try:
        admin = TenantAdmin(stores[0], books[0])
        admin.add("conc", {"max_concurrent": 2})
        admin.add("rpm", {"requests_per_minute": 10})
        books[1].refresh()
        for name, allowed in (("conc", 2), ("rpm", 10)):
            start = threading.Barrier(32)

            def one(i: int, name: str = name, start: threading.Barrier = start):
                start.wait()
                try:
                    return admit(books[i % 2], name)
                except QuotaExceededError as exc:
                    assert exc.reason in ("max_concurrent", "requests_per_minute")
                    return None

            with ThreadPoolExecutor(32) as ex:
                admitted = [x for x in ex.map(one, range(32)) if x is not None]
            assert len(admitted) == allowed, name
        assert claims_in(db, "conc") == (2, 2)
    finally:
        for s in stores:
            s.close()


# ---- the HTTP front: tenant keys, refusals ------------------------------------------------------


def test_http_tenant_key_names_the_tenant_and_never_opens_admin_routes():
    from control_plane.http.app import HttpDeps, create_app
    from tests.helpers.http_fakes import FakeAnnouncer, FakeRecord, FakeRegistry, FakeRouter, FakeTokenizer, call_app
    from tests.helpers.http_fakes import finished as finished_event
    from tests.helpers.http_fakes import started as started_event

    directory = TenantDirectory(api_key="inference-key-123")
    directory.set_keys({key_hash("tenant-key-12345678"): "acme"})
    router = FakeRouter()
    deps = HttpDeps(
        registry=FakeRegistry([FakeRecord(0, "shout")]),
        router=router,
        announcer=FakeAnnouncer(),
        base_name="base",
        base_root="/models/base.gguf",
        tokenizer=FakeTokenizer(),
        chat_template=None,
        admin_token=None,
        api_key="inference-key-123",
        tenants=directory,
    )
    app = create_app(deps)

    def post(path: str, key: str, body=None):
        router.script = [started_event(5), finished_event("", "stop")]
        return call_app(app, "POST", path, body or {"prompt": "hi"}, {"authorization": f"Bearer {key}"})

    assert post("/v1/completions", "tenant-key-12345678").status == 200
    assert post("/v1/completions", "inference-key-123").status == 200
    assert router.principals == ["acme", DEFAULT_TENANT]
    assert post("/v1/completions", "lp-unknown-key-0000").status == 401
    for path in ("/v1/tenants", "/v1/load_lora_adapter"):  # admin: the tenant key is refused
        refused = post(path, "tenant-key-12345678", {"name": "x", "lora_name": "x", "lora_path": "/x"})
        assert (refused.status, refused.json()["error"]["code"]) == (401, "invalid_api_key"), path
    listing = call_app(app, "GET", "/v1/tenants", None, {"authorization": "Bearer inference-key-123"})
    assert listing.status == 503  # passed the key check; this front serves no tenant admin


def test_quota_refusal_is_openai_rate_limit_429_with_retry_after():
    from control_plane.http.errors import from_control_plane

    err = from_control_plane(QuotaExceededError("acme", "tokens_per_minute", "over tokens_per_minute 100", 7))
    assert (err.status, err.type, err.code, err.headers) == (
        429,
        "rate_limit_error",
        "rate_limit_exceeded",
        {"Retry-After": "7"},
    )
    assert err.message == "tenant 'acme': over tokens_per_minute 100; retry after 7 s"


def test_tenant_metrics_count_by_outcome_and_keep_the_label_cap(book):
    """Counters and gauges by tenant, parsed back from the exposition; with a cap of 1 the second
    tenant counts under "other" and has no limit series (limits do not add up)."""
    from prometheus_client.parser import text_string_to_metric_families

    from control_plane.metrics import ControlPlaneMetrics

    m = ControlPlaneMetrics(model_name="base", adapters=dict, pool_state=lambda: (0, 0, 0), adapter_label_cap=1)
    book.metrics, m.quotas = m, book
    admin = TenantAdmin(book.store, book)
    admin.add("a", {"tokens_per_minute": 60, "max_concurrent": 1})
    admin.add("b", {"requests_per_minute": 5})
    held = admit(book, "a")
    with pytest.raises(QuotaExceededError):
        admit(book, "a")
    admit(book, "b").settle(3, 4)
    held.settle(10, 2)
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(m.exposition()[0].decode())
        for s in fam.samples
        if s.name.startswith("loraplane_tenant") and not s.name.endswith("_created")
    }
    assert got[("loraplane_tenant_requests_total", (("outcome", "admitted"), ("tenant", "a")))] == 1
    assert got[("loraplane_tenant_requests_total", (("outcome", "max_concurrent"), ("tenant", "a")))] == 1
    assert got[("loraplane_tenant_requests_total", (("outcome", "admitted"), ("tenant", "other")))] == 1
    assert got[("loraplane_tenant_tokens_total", (("kind", "prompt"), ("tenant", "a")))] == 10
    assert got[("loraplane_tenant_tokens_total", (("kind", "output"), ("tenant", "other")))] == 4
    assert got[("loraplane_tenant_limit", (("limit", "tokens_per_minute"), ("tenant", "a")))] == 60
    assert got[("loraplane_tenant_bucket_level", (("bucket", "tokens"), ("tenant", "a")))] == 48  # 60 - 12 used
    assert not any(dict(labels).get("tenant") == "other" for name, labels in got if name == "loraplane_tenant_limit")
    assert got[("loraplane_tenant_quota_sync_failures_total", ())] == 0
    # both settled: tenant a (a row, under the cap) reads 0 in flight instead of vanishing
    assert got[("loraplane_tenant_requests_in_flight", (("tenant", "a"),))] == 0


def test_http_tenant_routes_add_list_remove_with_openai_errors(book):
    from control_plane.http.app import HttpDeps, create_app
    from tests.helpers.http_fakes import FakeAnnouncer, FakeRegistry, FakeRouter, call_app

    deps = HttpDeps(
        registry=FakeRegistry([]),
        router=FakeRouter(),
        announcer=FakeAnnouncer(),
        base_name="base",
        base_root="/models/base.gguf",
        tokenizer=None,
        chat_template=None,
        admin_token="admin-token-1",
        tenants=book.directory,
        tenant_admin=TenantAdmin(book.store, book),
    )
    app = create_app(deps)
    auth = {"authorization": "Bearer admin-token-1"}
    added = call_app(app, "POST", "/v1/tenants", {"name": "acme", "max_concurrent": 2}, auth)
    body = added.json()
    assert added.status == 200 and body["api_key"].startswith("lp-")
    assert (body["name"], body["max_concurrent"], body["usage"]["in_flight"]) == ("acme", 2, 0)
    again = call_app(app, "POST", "/v1/tenants", {"name": "acme"}, auth)
    assert (again.status, again.json()["error"]["code"]) == (409, "already_exists")
    bad = call_app(app, "POST", "/v1/tenants", {"name": "b", "weight": -1}, auth)
    assert bad.status == 400 and "weight -1" in bad.json()["error"]["message"]
    for field, value in (("max_concurrent", True), ("weight", "2"), ("tokens_per_minute", 5.0), ("api_key", 12)):
        loose = call_app(app, "POST", "/v1/tenants", {"name": "b", field: value}, auth)  # no silent coercion
        assert (loose.status, loose.json()["error"]["param"]) == (400, field), (field, value)
    weighted = call_app(app, "POST", "/v1/tenants", {"name": "w", "weight": 2}, auth)  # an integer weight passes
    assert (weighted.status, weighted.json()["weight"]) == (200, 2.0)
    assert call_app(app, "DELETE", "/v1/tenants/w", None, auth).status == 200
    assert call_app(app, "GET", "/v1/tenants", None, {"authorization": "Bearer wrong"}).status == 401
    listed = call_app(app, "GET", "/v1/tenants", None, auth).json()["tenants"]
    assert [(t["name"], t["key_count"]) for t in listed] == [("acme", 1)]
    assert call_app(app, "DELETE", "/v1/tenants/acme", None, auth).json() == {"name": "acme", "removed": True}
    gone = call_app(app, "DELETE", "/v1/tenants/acme", None, auth)
    assert gone.status == 404 and "no tenants are configured" in gone.json()["error"]["message"]
