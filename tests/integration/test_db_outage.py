"""Database outages and bad rows, with a real PostgreSQL, a real
control plane on loopback (gRPC and HTTP) and the scripted worker heartbeating it.

- PostgreSQL stopped (``pg_ctl stop``) and, separately, hung (the postmaster and every backend
  SIGSTOPped: TCP still connects, nothing answers): every call that needs the database fails
  within the promised 2 s (checked under 5 s) with gRPC UNAVAILABLE / HTTP 503 in OpenAI's
  shape with ``Retry-After``, naming the database; base-model generation (also for a tenant
  with quotas: admitted on the last levels, its usage written once the database is back),
  ``/health`` and ``/metrics``, which need no database, go on; the worker, heartbeating with holdings every
  0.5 s (dead after 1.5 s, less than one database call's 2 s bound: a heartbeat that waited
  on the database would show), is
  alive in every sample taken throughout and after the outage; once the database is back calls
  succeed again and the worker's sighting is written.
- One adapter row with a metadata column that does not parse (raw SQL), on SQLite: listing,
  ``/v1/models`` and generation skip it with a warning naming it; ``GetAdapter`` / ``adapters
  show`` of it say what is wrong (DATA_LOSS). The store-level rules, on both databases, are
  in ``test_store.py``.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
import structlog
from click.testing import CliRunner

from clients.cli.main import cli
from loraplane.v1 import common_pb2 as pb
from loraplane.v1 import control_plane_pb2, membership_pb2, worker_pb2_grpc
from tests.helpers.control_plane import MiB, rpc_error, upload
from worker.rpc.membership import MembershipBackoff, start_membership

SECRET = "db-outage-secret"
PROMISED_S = 2.0
CEILING_S = 5.0  # generous: the promise is 2 s
FAST = MembershipBackoff(connect_timeout_s=1.0, initial_s=0.05, max_s=0.2)


class HeartbeatingWorker:
    """The scripted worker (no model) registered with ``cp_addr``, heartbeating what it holds."""

    def __init__(self, cp_addr: str, worker_id: str = "w1") -> None:
        from tests.helpers.scripted_worker import ScriptedWorker

        self.servicer = ScriptedWorker(worker_id)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8), options=[("grpc.max_receive_message_length", 64 * MiB)]
        )
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.hello = membership_pb2.WorkerHello(
            worker_id=worker_id, addr=f"127.0.0.1:{port}", model="gemma3", n_slots=4
        )
        self.stop_event = threading.Event()
        self.thread = start_membership(
            cp_addr, self.hello, self.stop_event, backoff=FAST, secret=SECRET, holdings=self.holdings
        )
        assert self.thread.registered.wait(20), "worker did not register"

    def holdings(self) -> membership_pb2.WorkerHoldings:
        with self.servicer.lock:
            return membership_pb2.WorkerHoldings(
                adapters=[membership_pb2.HeldAdapter(id=i, sha256=h) for i, h in self.servicer.adapters.items()]
            )

    def close(self) -> None:
        self.stop_event.set()
        self.thread.join(5)
        self.server.stop(None)


class LivenessMonitor:
    """Samples ``ListWorkers`` (over gRPC) every 50 ms; records every sample in which the worker
    is not alive, or that failed."""

    def __init__(self, stub, worker_id: str) -> None:
        self.stub, self.worker_id = stub, worker_id
        self.gaps: list[str] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                workers = {w.worker_id: w.state for w in self.stub.ListWorkers(pb.Empty(), timeout=2).workers}
                state = workers.get(self.worker_id, "absent")
            except grpc.RpcError as exc:
                state = f"ListWorkers {exc.code().name}"
            self.samples += 1
            if state != "alive":
                self.gaps.append(f"{time.monotonic():.2f} {state}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def wait_for_totals(cp, tenant: str, requests: int, timeout_s: float = 5.0) -> bool:
    """Whether ``tenant``'s stored ``requests_total`` reaches ``requests`` within the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = {s.record.name: s for s in cp.state.store.sync_tenants({}, {}, 5.0)}
        if states[tenant].requests_total >= requests:
            return True
        time.sleep(0.1)
    return False


def timed(call):
    """``(seconds, result or the exception raised)``."""
    t0 = time.monotonic()
    try:
        out = call()
    except Exception as exc:  # noqa: BLE001 - the probes assert on it
        out = exc
    return time.monotonic() - t0, out


@pytest.fixture
def private_postgres():
    """A PostgreSQL server of this test's own (it is stopped and frozen, so not the shared one)."""
    from tests.helpers.postgres_server import PostgresUnavailable, start_postgres

    try:
        server = start_postgres()
    except PostgresUnavailable as exc:
        pytest.fail(f"PostgreSQL is needed for this test and could not be started: {exc}", pytrace=False)
    yield server
    server.stop()


def _outage_probes(
    cp, http: httpx.Client, base_name: str, adapter_id: int, fixtures_dir: Path, tenant_key: str
) -> dict:
    """Every kind of call that reads the store, concurrently; ``{name: (seconds, outcome)}``."""
    with_adapter = pb.GenerateRequest(
        text="hi", adapters=pb.AdapterMap(entries=[pb.AdapterScale(id=adapter_id, scale=1.0)])
    )
    probes = {
        "grpc ListAdapters": lambda: cp.stub.ListAdapters(pb.Empty(), timeout=30),
        "grpc GetAdapter": lambda: cp.stub.GetAdapter(pb.AdapterRef(id=adapter_id), timeout=30),
        "grpc GetDefaultAdapters": lambda: cp.stub.GetDefaultAdapters(pb.Empty(), timeout=30),
        "grpc Generate(default set)": lambda: list(cp.stub.Generate(pb.GenerateRequest(text="hi"), timeout=30)),
        "grpc Generate(adapter)": lambda: list(cp.stub.Generate(with_adapter, timeout=30)),
        "http models": lambda: http.get("/v1/models"),
        "http completions(adapter)": lambda: http.post(
            "/v1/completions", json={"model": f"adapter:{adapter_id}", "prompt": "hi", "max_tokens": 2}
        ),
        "http completions(name)": lambda: http.post(
            "/v1/completions", json={"model": "sea", "prompt": "hi", "max_tokens": 2}
        ),
        "http load": lambda: http.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "shout", "lora_path": str(fixtures_dir / "adapters" / "shout.gguf")},
        ),
        "http unload": lambda: http.post("/v1/unload_lora_adapter", json={"lora_name": "sea"}),
        # need no database: the base model alone, health and metrics
        "http health": lambda: http.get("/health"),
        "http metrics": lambda: http.get("/metrics"),
        "http completions(base)": lambda: http.post(
            "/v1/completions", json={"model": base_name, "prompt": "hi", "max_tokens": 2}
        ),
        "grpc Generate(no adapters)": lambda: list(
            cp.stub.Generate(pb.GenerateRequest(text="hi", adapters=pb.AdapterMap()), timeout=30)
        ),
        # a tenant with quotas: admitted on the last levels (fail-open) once its admission in the
        # database failed (or the quota sync noticed the outage first)
        "grpc Generate(tenant, no adapters)": lambda: list(
            cp.stub.Generate(
                pb.GenerateRequest(text="hi", adapters=pb.AdapterMap()),
                metadata=(("authorization", f"Bearer {tenant_key}"),),
                timeout=30,
            )
        ),
    }
    with ThreadPoolExecutor(len(probes)) as ex:
        running = {name: ex.submit(timed, fn) for name, fn in probes.items()}
        return {name: f.result() for name, f in running.items()}


SERVED_THROUGHOUT = (
    "http completions(base)",
    "grpc Generate(no adapters)",
    "grpc Generate(tenant, no adapters)",
    "http health",
    "http metrics",
)


def _check_failed_fast(results: dict, database: str) -> None:
    for name, (seconds, out) in results.items():
        assert seconds < CEILING_S, f"{name} took {seconds:.2f}s (promised {PROMISED_S:g}s)"
        if name in SERVED_THROUGHOUT:
            ok = out.status_code == 200 if name.startswith("http") else out[-1].HasField("finished")
            assert ok, f"{name}: {out}"
        elif name.startswith("grpc"):
            assert isinstance(out, grpc.RpcError), f"{name}: {out!r}"
            assert out.code() == grpc.StatusCode.UNAVAILABLE, f"{name}: {out.code()} {out.details()}"
            assert out.details().startswith(f"database unavailable ({database}: "), out.details()
            assert out.details().endswith("retry later")
        else:
            assert out.status_code == 503, f"{name}: {out.status_code} {out.text}"
            assert out.headers["retry-after"] == "2", f"{name}: {dict(out.headers)}"
            err = out.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "service_unavailable"
            assert err["message"].startswith(f"database unavailable ({database}: "), err


@pytest.mark.slow
def test_postgres_stopped_and_hung_fail_fast_and_workers_stay_live(
    private_postgres, start_control_plane, fixtures_dir, base_model_path
):
    from control_plane.store.postgres import redact

    url = private_postgres.create_database("outage")
    cp = start_control_plane(
        database=url,
        http_addr="127.0.0.1:0",
        worker_secret=SECRET,
        heartbeat_interval_s=0.5,
        dead_after_missed=3,
        adapter_dirs=(str(fixtures_dir / "adapters"),),
    )
    sea = upload(cp.stub, fixtures_dir / "adapters" / "sea.gguf", name="sea")
    limits = control_plane_pb2.TenantLimits(tokens_per_minute=100_000, max_concurrent=10)
    tenant_key = cp.stub.AddTenant(control_plane_pb2.AddTenantRequest(name="t", limits=limits)).api_key
    worker = HeartbeatingWorker(cp.addr)
    monitor = LivenessMonitor(cp.stub, "w1")
    base_name = base_model_path.stem
    http = httpx.Client(base_url=f"http://127.0.0.1:{cp.state.http_port}", timeout=30)
    try:
        list(
            cp.stub.Generate(
                pb.GenerateRequest(text="hi", adapters=pb.AdapterMap(entries=[pb.AdapterScale(id=sea.id, scale=1.0)])),
                timeout=10,
            )
        )  # the worker holds sea now
        assert sea.id in worker.servicer.adapters
        for outage in ("stopped", "hung"):
            frozen: list[int] = []
            if outage == "stopped":
                private_postgres.halt()
            else:
                frozen = private_postgres.freeze()
            try:
                _check_failed_fast(_outage_probes(cp, http, base_name, sea.id, fixtures_dir, tenant_key), redact(url))
                time.sleep(2.0)  # > dead-after (1.5 s) more of outage with the worker heartbeating
            finally:
                if outage == "stopped":
                    private_postgres.resume_after_halt()
                else:
                    private_postgres.thaw(frozen)
            t0 = time.monotonic()
            while True:  # back within a couple of seconds (the pool reconnects on demand)
                seconds, out = timed(lambda: cp.stub.ListAdapters(pb.Empty(), timeout=30))
                if not isinstance(out, Exception):
                    break
                assert time.monotonic() - t0 < 15, f"still failing after the {outage} database came back: {out}"
                time.sleep(0.1)
            assert [a.id for a in out.adapters] == [sea.id]
            assert http.get("/v1/models").status_code == 200
            time.sleep(2.0)  # right after the database came back, too
        # the sightings written after the outage: other replicas see the worker again
        assert [s.worker_id for s in cp.state.store.recent_workers(5.0)] == ["w1"]
        # the tenant requests admitted during the outages reached the database once it was back
        assert wait_for_totals(cp, "t", 2)  # one per outage
    finally:
        monitor.stop()
        http.close()
        worker.close()
    assert monitor.samples > 50
    assert monitor.gaps == [], f"the worker was not live in {len(monitor.gaps)} samples: {monitor.gaps[:10]}"


@pytest.mark.slow
def test_sqlite_locked_fails_fast_as_unavailable(start_control_plane, tmp_path):
    cp = start_control_plane()
    db = Path(cp.config.data_dir) / "loraplane.sqlite3"
    other = sqlite3.connect(db, isolation_level=None)  # e.g. an operator's sqlite3 shell, mid-write
    try:
        other.execute("BEGIN IMMEDIATE")
        t0 = time.monotonic()
        err = rpc_error(lambda: cp.stub.SetDefaultAdapters(pb.AdapterMap(), timeout=30))
        assert time.monotonic() - t0 < CEILING_S
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert err.details() == f"database unavailable (sqlite:///{db}: database is locked); retry later"
        cp.stub.ListAdapters(pb.Empty(), timeout=5)  # reads go on (WAL)
    finally:
        other.execute("ROLLBACK")
        other.close()
    cp.stub.SetDefaultAdapters(pb.AdapterMap(), timeout=5)


def test_a_bad_adapter_row_is_skipped_and_named(start_control_plane, fixtures_dir, base_model_path):
    cp = start_control_plane(http_addr="127.0.0.1:0", worker_secret=SECRET, heartbeat_interval_s=0.2)
    sea = upload(cp.stub, fixtures_dir / "adapters" / "sea.gguf", name="sea")
    bad = upload(cp.stub, fixtures_dir / "adapters" / "shout.gguf", name="shout")
    cp.stub.SetDefaultAdapters(pb.AdapterMap(entries=[pb.AdapterScale(id=sea.id, scale=1.0)]), timeout=5)
    with sqlite3.connect(Path(cp.config.data_dir) / "loraplane.sqlite3") as conn:  # behind our back
        conn.execute("UPDATE adapters SET metadata = '{not json' WHERE id = ?", (bad.id,))
    with structlog.testing.capture_logs() as logs:  # logged once a minute per row, at its first read
        worker = HeartbeatingWorker(cp.addr)
        assert [a.id for a in cp.stub.ListAdapters(pb.Empty(), timeout=5).adapters] == [sea.id]
    http = httpx.Client(base_url=f"http://127.0.0.1:{cp.state.http_port}", timeout=30)
    try:
        skipped = [e for e in logs if e["event"] == "adapter_row_skipped"]
        assert skipped and skipped[0]["adapter_id"] == str(bad.id) and skipped[0]["log_level"] == "warning"
        assert "metadata" in skipped[0]["reason"]
        events = list(cp.stub.Generate(pb.GenerateRequest(text="hi"), timeout=10))  # default set: sea
        assert events[-1].HasField("finished") and worker.servicer.submitted[-1].adapters.entries[0].id == sea.id
        models = http.get("/v1/models")
        assert models.status_code == 200
        assert [m["id"] for m in models.json()["data"]] == [base_model_path.stem, "sea"]
        ok = http.post("/v1/completions", json={"model": "sea", "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        err = rpc_error(lambda: cp.stub.GetAdapter(pb.AdapterRef(id=bad.id), timeout=5))
        assert err.code() == grpc.StatusCode.DATA_LOSS
        assert err.details().startswith(f"adapter {bad.id}: its database row does not parse (metadata: ")
        shown = CliRunner().invoke(cli, ["adapters", "show", str(bad.id), "--addr", cp.addr])
        assert shown.exit_code == 1 and f"adapter {bad.id}: its database row does not parse" in shown.output
        cp.stub.UnregisterAdapter(pb.AdapterRef(id=bad.id), timeout=10)  # the operator's way out
        assert [a.id for a in cp.stub.ListAdapters(pb.Empty(), timeout=5).adapters] == [sea.id]
    finally:
        http.close()
        worker.close()
