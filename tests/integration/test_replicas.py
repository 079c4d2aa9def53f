"""Two control-plane replicas on one real PostgreSQL, real processes on loopback.

One module-scoped cluster (started once, ~1 min): PostgreSQL (``postgres_server``), control
planes A and B as ``loraplane control-plane --database postgresql://…`` subprocesses started
at the same moment (concurrent migrations), and one real worker subprocess registered with
both (``--control-plane A,B``). Tests run in file order; the last one kills A.

- a registration through A is served through B; a default set written through B is read
  through A;
- a worker that knows only A (one address, as behind a Service) is adopted by B, and an
  unregistration through B reaches every worker holding the adapter;
- 2 replicas × 20 concurrent registrations of distinct adapters → 40 distinct ids; the same
  content on both at once → one id;
- tenant quotas hold across the replicas: a tenant out of tokens through A is refused
  through B within 1 s; a stream in flight through A counts against max_concurrent on B; a
  simultaneous burst of 32 requests through both never has more than max_concurrent in flight
  nor admits more than requests_per_minute (+10 %);
- ``kill -9`` A during a burst of registrations and generations: every acknowledged
  registration is present, none is half-registered (bytes hash to their sha256), clients
  given both addresses finish on B, a stream broken by A's death ends with UNAVAILABLE, the
  worker keeps serving, and the concurrency claim A held is reclaimed after its lease.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner

from clients.cli.main import cli
from clients.client import LoraplaneClient
from clients.errors import LoraplaneError
from loraplane.env import ENV_WORKER_SECRET
from loraplane.process import stop_process
from loraplane.v1 import common_pb2, worker_pb2_grpc
from loraplane.worker_secret import with_secret
from tests.helpers.control_plane import write_adapter
from tests.helpers.live_servers import WORKER_SECRET, wait_until
from tests.helpers.postgres_server import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The weather today is"
HEARTBEAT_S = 0.5
READY_TIMEOUT_S = 600


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "PYTHONUNBUFFERED": "1",
        ENV_WORKER_SECRET: WORKER_SECRET,  # both control planes and the worker
    }


def spawn_control_plane(addr: str, url: str, data_dir: Path, adapter_dir: Path, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "clients.cli",
        "control-plane",
        "--addr",
        addr,
        "--database",
        url,
        "--data-dir",
        str(data_dir),
        "--adapter-dir",
        str(adapter_dir),
        "--heartbeat-interval",
        str(HEARTBEAT_S),
        "--log-level",
        "warning",
    ]
    with open(log, "ab") as fh:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=_env(), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )


class Cluster:
    def __init__(self, root: Path, url: str, adapter_dir: Path) -> None:
        self.root, self.url, self.adapter_dir = root, url, adapter_dir
        self.a_addr, self.b_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self.a = spawn_control_plane(self.a_addr, url, root / "a", adapter_dir, root / "a.log")
        self.b = spawn_control_plane(self.b_addr, url, root / "b", adapter_dir, root / "b.log")
        self.procs = [self.a, self.b]
        self.lp_a = LoraplaneClient(self.a_addr, timeout=300, connect_timeout=READY_TIMEOUT_S, wait_for_server=True)
        self.lp_b = LoraplaneClient(self.b_addr, timeout=300, connect_timeout=READY_TIMEOUT_S, wait_for_server=True)
        self.lp_b.list_adapters()
        self.lp_a.list_adapters()
        self.worker_id = "w-replicas"
        with open(root / "worker.log", "ab") as fh:
            self.worker = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "clients.cli",
                    "worker",
                    "--control-plane",
                    f"{self.a_addr},{self.b_addr}",
                    "--addr",
                    "127.0.0.1:0",
                    "--worker-id",
                    self.worker_id,
                    "--slots",
                    "4",
                    "--device",
                    "cpu",
                    "--n-ctx",
                    "512",
                ],
                cwd=ROOT,
                env=_env(),
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.procs.append(self.worker)
        for lp in (self.lp_a, self.lp_b):
            assert wait_until(lambda lp=lp: self.alive(lp, self.worker_id), timeout=READY_TIMEOUT_S), self.logs()

    def alive(self, lp: LoraplaneClient, worker_id: str) -> bool:
        return any(w.worker_id == worker_id and w.alive for w in lp.list_workers())

    def logs(self) -> str:
        return "\n".join(
            f"== {p.name}\n{p.read_bytes()[-3000:].decode(errors='replace')}" for p in sorted(self.root.glob("*.log"))
        )

    def announce(self, adapter_id: int, sha256: str) -> None:
        """Tell the real worker about an adapter directly (header-only ``LoadAdapter``)."""
        (info,) = [w for w in self.lp_b.list_workers() if w.worker_id == self.worker_id]
        import grpc

        with grpc.insecure_channel(info.addr) as ch:
            worker_pb2_grpc.WorkerStub(with_secret(ch, WORKER_SECRET)).LoadAdapter(
                iter([common_pb2.AdapterChunk(id=adapter_id, sha256=sha256, fetch_on_demand=True)]), timeout=30
            )

    def worker_adapter_ids(self) -> set[int]:
        (info,) = [w for w in self.lp_b.list_workers() if w.worker_id == self.worker_id]
        import grpc

        with grpc.insecure_channel(info.addr) as ch:
            reply = worker_pb2_grpc.WorkerStub(with_secret(ch, WORKER_SECRET)).ListAdapters(
                common_pb2.Empty(), timeout=30
            )
        return {a.id for a in reply.adapters}

    def close(self) -> None:
        self.lp_a.close()
        self.lp_b.close()
        for p in self.procs:
            stop_process(p, 30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, postgres_server, fixtures_dir):
    root = tmp_path_factory.mktemp("replicas")
    c = Cluster(root, postgres_server.create_database("replicas"), fixtures_dir / "adapters")
    yield c
    c.close()


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_register_via_a_generate_via_b(cluster, fixtures_dir):
    shout = fixtures_dir / "adapters" / "shout.gguf"
    info = cluster.lp_a.add_adapter(shout)
    assert info.sha256 == sha256_of(shout)
    assert cluster.lp_b.get_adapter(info.id) == info  # visible on B at once
    assert cluster.lp_b.add_adapter(shout).id == info.id  # same content through B: same id
    via_b = cluster.lp_b.generate(PROMPT, adapters={info.id: 1.0}, max_tokens=8)
    via_a = cluster.lp_a.generate(PROMPT, adapters={info.id: 1.0}, max_tokens=8)
    base = cluster.lp_b.generate(PROMPT, adapters={}, max_tokens=8)
    assert via_b.token_ids == via_a.token_ids and len(via_b.token_ids) == 8
    assert via_b.token_ids != base.token_ids
    assert via_b.telemetry["worker_id"] == cluster.worker_id


def test_alias_via_a_is_served_by_name_via_b(cluster, fixtures_dir, tmp_path):
    """Aliases live in the shared database: shout's content registered again through A under a
    new name is, through B at once, the same adapter by that name (lookup and generation)."""
    shout = fixtures_dir / "adapters" / "shout.gguf"
    info = cluster.lp_a.add_adapter(shout, name="shout-b")
    assert (info.name, info.aliases) == ("shout", ("shout-b",))
    assert cluster.lp_b.get_adapter("shout-b") == info
    by_name = cluster.lp_b.generate(PROMPT, adapters={"shout-b": 1.0}, max_tokens=8)
    by_id = cluster.lp_a.generate(PROMPT, adapters={info.id: 1.0}, max_tokens=8)
    assert by_name.token_ids == by_id.token_ids and len(by_name.token_ids) == 8
    with pytest.raises(LoraplaneError) as taken:
        cluster.lp_b.add_adapter(write_adapter(tmp_path / "other.gguf", seed=8800), name="shout-b")
    assert taken.value.code == "ALREADY_EXISTS"


def test_default_set_via_b_read_via_a(cluster, fixtures_dir):
    sea = cluster.lp_a.add_adapter(fixtures_dir / "adapters" / "sea.gguf", server_path=True)
    assert sea.path == str((fixtures_dir / "adapters" / "sea.gguf").resolve())  # copied from there
    cluster.lp_b.set_default({sea.id: 0.5})
    got = {e.id: e.scale for e in cluster.lp_a.get_default().entries}
    assert got == {a.id: (0.5 if a.id == sea.id else 0.0) for a in cluster.lp_b.list_adapters()}
    assert cluster.lp_a.get_adapter(sea.id).default_scale == 0.5
    cluster.lp_b.set_default({})
    assert {e.scale for e in cluster.lp_a.get_default().entries} == {0.0}


def test_service_address_worker_is_adopted_and_unregistration_reaches_every_worker(cluster, tmp_path):
    from tests.helpers.scripted_worker import ScriptedMember

    scripted = ScriptedMember("w-only-a", cluster.a_addr)  # one address, like a Service
    try:
        assert wait_until(lambda: cluster.alive(cluster.lp_b, "w-only-a"), timeout=30), cluster.logs()
        tiny = cluster.lp_a.add_adapter(write_adapter(tmp_path / "t.gguf", seed=8801))
        # Nothing is pushed at registration; both workers come to hold it as a
        # routed request would make them: the scripted one as if it had fetched it, the real
        # one told id → sha256 (it fetches the bytes on first use).
        with scripted.servicer.lock:
            scripted.servicer.adapters[tiny.id] = tiny.sha256
        cluster.announce(tiny.id, tiny.sha256)
        assert wait_until(lambda: tiny.id in cluster.worker_adapter_ids(), timeout=60)
        cluster.lp_b.remove_adapter(tiny.id)  # B took the call: it reaches every live worker
        assert wait_until(lambda: tiny.id not in scripted.servicer.adapters, timeout=30)
        assert wait_until(lambda: tiny.id not in cluster.worker_adapter_ids(), timeout=60)
        with pytest.raises(LoraplaneError) as gone:
            cluster.lp_a.get_adapter(tiny.id)
        assert gone.value.code == "NOT_FOUND"
    finally:
        scripted.close()
    # its heartbeats stop: dead on both replicas, so it is never routed to again
    for lp in (cluster.lp_a, cluster.lp_b):
        assert wait_until(lambda lp=lp: not cluster.alive(lp, "w-only-a"), timeout=30)


def test_concurrent_registrations_on_two_replicas(cluster, tmp_path):
    files = [write_adapter(tmp_path / f"c{i}.gguf", seed=9000 + i) for i in range(40)]
    jobs = [(cluster.lp_a if i < 20 else cluster.lp_b, f) for i, f in enumerate(files)]
    with ThreadPoolExecutor(40) as ex:
        infos = list(ex.map(lambda job: job[0].add_adapter(job[1]), jobs))
    ids = [i.id for i in infos]
    assert len(set(ids)) == 40
    assert [i.sha256 for i in infos] == [sha256_of(f) for f in files]
    listed = {a.id: a.sha256 for a in cluster.lp_a.list_adapters()}
    assert all(listed[i.id] == i.sha256 for i in infos)
    same = write_adapter(tmp_path / "same.gguf", seed=9999)
    with ThreadPoolExecutor(8) as ex:
        same_ids = list(ex.map(lambda lp: lp.add_adapter(same).id, [cluster.lp_a, cluster.lp_b] * 4))
    assert len(set(same_ids)) == 1 and same_ids[0] > max(ids)


KEYS_REFRESH_S = 1.0  # control_plane.tenants.KEYS_REFRESH_S: B learns A's new keys within it
TOKENS = [2, 651, 6114, 3124]  # a 4-token prompt: what tokens_per_minute counts exactly


def test_tenant_over_tokens_per_minute_on_a_is_refused_on_b_within_one_second(cluster):
    """The quota is global: a tenant whose tokens per minute are used up through A is refused
    through B at most 1 s after the request that crossed the limit was admitted; another tenant
    is served on both; usage is summed over the replicas."""
    prompt, max_tokens = [2, 651, 6114, 3124], 8  # 12 tokens a request
    _, key = cluster.lp_a.add_tenant("global-tpm", tokens_per_minute=36)
    _, other_key = cluster.lp_a.add_tenant("global-other", tokens_per_minute=100_000)
    time.sleep(KEYS_REFRESH_S + 0.5)  # B's key table is reloaded once a second
    via_a = LoraplaneClient(cluster.a_addr, api_key=key, timeout=120)
    via_b = LoraplaneClient(cluster.b_addr, api_key=key, timeout=120)
    other_b = LoraplaneClient(cluster.b_addr, api_key=other_key, timeout=120)
    try:
        for _ in range(2):
            via_a.generate(prompt_tokens=prompt, adapters={}, max_tokens=max_tokens, ignore_eos=True)
        crossed_at = time.monotonic()  # the third request's admission uses the last of the 36 tokens
        via_a.generate(prompt_tokens=prompt, adapters={}, max_tokens=max_tokens, ignore_eos=True)
        time.sleep(max(0.0, crossed_at + 1.0 - time.monotonic()))
        with pytest.raises(LoraplaneError) as refused:
            via_b.generate(prompt_tokens=prompt, adapters={}, max_tokens=max_tokens, ignore_eos=True)
        assert refused.value.code == "RESOURCE_EXHAUSTED", refused.value.message
        assert "tenant 'global-tpm': over tokens_per_minute 36" in refused.value.message
        with pytest.raises(LoraplaneError) as on_a:
            via_a.generate(prompt_tokens=prompt, adapters={}, max_tokens=max_tokens, ignore_eos=True)
        assert on_a.value.code == "RESOURCE_EXHAUSTED"
        assert len(other_b.generate(prompt_tokens=prompt, adapters={}, max_tokens=2).token_ids) == 2

        def usage():
            return next(t.usage for t in cluster.lp_b.list_tenants() if t.name == "global-tpm")

        # one refusal on each replica; A's reaches the database with A's next sync
        assert wait_until(lambda: usage().rejected_total == 2, timeout=2.0), usage()
        assert (usage().requests_total, usage().tokens_total) == (3, 36)
    finally:
        for lp in (via_a, via_b, other_b):
            lp.close()


def test_tenant_max_concurrent_counts_requests_in_flight_on_every_replica(cluster):
    """max_concurrent 1: a stream in flight through A makes B refuse the tenant; once it is
    cancelled, B admits it again (after both replicas synced)."""
    _, key = cluster.lp_a.add_tenant("global-conc", max_concurrent=1)
    time.sleep(KEYS_REFRESH_S + 0.5)
    via_a = LoraplaneClient(cluster.a_addr, api_key=key, timeout=120)
    via_b = LoraplaneClient(cluster.b_addr, api_key=key, timeout=120)
    try:
        stream = via_a.generate_stream(PROMPT, adapters={}, max_tokens=400, ignore_eos=True)
        next(stream)  # started: in flight on A
        time.sleep(1.0)  # A's sync, then B's (250 ms each)
        with pytest.raises(LoraplaneError) as refused:
            via_b.generate(PROMPT, adapters={}, max_tokens=2)
        assert refused.value.code == "RESOURCE_EXHAUSTED"
        assert "1 requests in flight, max_concurrent 1" in refused.value.message
        stream.close()  # cancels the request on A

        def admitted_on_b() -> bool:
            try:
                return len(via_b.generate(PROMPT, adapters={}, max_tokens=2).token_ids) == 2
            except LoraplaneError as exc:
                assert exc.code == "RESOURCE_EXHAUSTED", exc.message
                return False

        assert wait_until(admitted_on_b, timeout=3.0, interval=0.1)
    finally:
        via_a.close()
        via_b.close()


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals ``(start, end)`` open at one instant."""
    edges = sorted([(t0, 1) for t0, _ in intervals] + [(t1, -1) for _, t1 in intervals], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def burst(addrs: list[str], key: str, n: int, max_tokens: int) -> tuple[list[tuple[float, float]], list[str]]:
    """``n`` streams of tenant ``key`` sent at one instant, alternately through ``addrs``:
    ``(the (first event, end) interval of each admitted one, each refusal's message)``."""
    clients = [LoraplaneClient(addrs[i % len(addrs)], api_key=key, timeout=120) for i in range(n)]
    start = threading.Barrier(n)
    admitted: list[tuple[float, float]] = []
    refused: list[str] = []

    def one(lp: LoraplaneClient) -> None:
        lp.list_adapters()  # connected before the barrier: the burst is the requests alone
        start.wait(30)
        try:
            first = None
            for _ev in lp.generate_stream(prompt_tokens=TOKENS, adapters={}, max_tokens=max_tokens, ignore_eos=True):
                first = first or time.monotonic()
            admitted.append((first or time.monotonic(), time.monotonic()))
        except LoraplaneError as exc:
            assert exc.code == "RESOURCE_EXHAUSTED", exc
            refused.append(exc.message)

    try:
        with ThreadPoolExecutor(n) as ex:
            list(ex.map(one, clients))
    finally:
        for lp in clients:
            lp.close()
    return admitted, refused


def test_a_simultaneous_burst_through_both_replicas_never_passes_max_concurrent_rpm_or_tpm(cluster):
    """32 requests of one tenant at the same instant, 16 through each replica: with
    max_concurrent 2 at most 2 are ever in flight (the intervals between each admitted stream's
    first event and its end never overlap more); with requests_per_minute 10, or with
    tokens_per_minute for 10 requests, at most 11 of 32 are admitted (≤ 10 % over). Each
    admission is decided by the database, not by each replica's view of the others' (which let
    2 per replica, 4, and 16 to 20 of 32 through)."""
    _, conc_key = cluster.lp_a.add_tenant("burst-conc", max_concurrent=2)
    _, rpm_key = cluster.lp_a.add_tenant("burst-rpm", requests_per_minute=10)
    _, tpm_key = cluster.lp_a.add_tenant("burst-tpm", tokens_per_minute=10 * (len(TOKENS) + 1))
    time.sleep(KEYS_REFRESH_S + 0.5)
    both = [cluster.a_addr, cluster.b_addr]
    admitted, refused = burst(both, conc_key, 32, max_tokens=24)
    assert admitted and len(admitted) + len(refused) == 32
    assert max_overlap(admitted) <= 2, admitted
    assert all("requests in flight, max_concurrent 2" in m for m in refused), refused[:3]
    admitted, refused = burst(both, rpm_key, 32, max_tokens=1)
    assert 10 <= len(admitted) <= 11, (len(admitted), refused[:3])
    assert all("over requests_per_minute 10" in m for m in refused), refused[:3]
    admitted, refused = burst(both, tpm_key, 32, max_tokens=1)
    assert 10 <= len(admitted) <= 11, (len(admitted), refused[:3])
    assert all("over tokens_per_minute 50 (the request needs 5 tokens" in m for m in refused), refused[:3]

    def usage(name: str):
        return next(t.usage for t in cluster.lp_b.list_tenants() if t.name == name)

    assert usage("burst-rpm").requests_total == len(admitted)
    assert wait_until(lambda: usage("burst-conc").in_flight == 0, timeout=3.0)  # A's rows: its next sync


def test_kill_a_during_registrations_and_generations(cluster, tmp_path):
    both = f"{cluster.a_addr},{cluster.b_addr}"
    files = [write_adapter(tmp_path / f"k{i}.gguf", seed=9500 + i) for i in range(12)]
    acknowledged: list[tuple[int, str]] = []
    errors: list[BaseException] = []
    generated: list[int] = []
    stream_outcome: dict = {}
    started = threading.Event()

    def register() -> None:
        with LoraplaneClient(both, timeout=120) as lp:
            for f in files:
                try:
                    info = lp.add_adapter(f)
                except BaseException as exc:  # noqa: BLE001 - asserted below
                    errors.append(exc)
                    return
                acknowledged.append((info.id, info.sha256))
                time.sleep(0.2)

    def generate() -> None:
        with LoraplaneClient(both, timeout=120) as lp:
            for _ in range(6):
                for _attempt in range(5):  # the caller's retry of a broken stream
                    try:
                        generated.append(len(lp.generate(PROMPT, adapters={}, max_tokens=4).token_ids))
                        break
                    except LoraplaneError as exc:
                        if exc.code != "UNAVAILABLE":
                            errors.append(exc)
                            return
                else:
                    errors.append(AssertionError("generation never succeeded on B"))

    def long_stream_through_a() -> None:
        with LoraplaneClient(cluster.a_addr, timeout=120) as lp:
            try:
                for _ev in lp.generate_stream(PROMPT, adapters={}, max_tokens=400, ignore_eos=True):
                    started.set()
                stream_outcome["finished"] = True
            except LoraplaneError as exc:
                stream_outcome["error"] = exc

    # a tenant whose only concurrency claim A holds when it dies: B refuses it until the claim's
    # lease (5 s, renewed by A's syncs until then) expires, then admits it
    _, lease_key = cluster.lp_a.add_tenant("lease", max_concurrent=1)
    time.sleep(KEYS_REFRESH_S + 0.5)
    lease_a = LoraplaneClient(cluster.a_addr, api_key=lease_key, timeout=120)
    lease_b = LoraplaneClient(cluster.b_addr, api_key=lease_key, timeout=120)
    held = lease_a.generate_stream(PROMPT, adapters={}, max_tokens=400, ignore_eos=True)
    next(held)  # started: A holds the claim
    threads = [threading.Thread(target=f) for f in (register, generate, generate, long_stream_through_a)]
    for t in threads:
        t.start()
    assert started.wait(120)
    assert wait_until(lambda: len(acknowledged) >= 3, timeout=120)
    cluster.a.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(LoraplaneError) as still_held:
        lease_b.generate(PROMPT, adapters={}, max_tokens=2)
    assert "1 requests in flight, max_concurrent 1" in still_held.value.message

    def lease_admitted() -> bool:
        try:
            return len(lease_b.generate(PROMPT, adapters={}, max_tokens=2).token_ids) == 2
        except LoraplaneError as exc:
            assert "max_concurrent 1" in exc.message, exc
            return False

    assert wait_until(lease_admitted, timeout=15, interval=0.2)
    reclaimed_s = time.monotonic() - killed_at
    assert 3.0 < reclaimed_s < 7.0, reclaimed_s  # the lease (5 s) after A's last renewal, plus a sync
    lease_a.close()
    lease_b.close()
    threads[3].join(30)
    assert not threads[3].is_alive(), "a stream through the dead replica hung"
    assert stream_outcome["error"].code == "UNAVAILABLE" and time.monotonic() - killed_at < 30
    for t in threads[:3]:
        t.join(300)
    assert errors == [] and [t.is_alive() for t in threads] == [False] * 4
    assert [sha for _, sha in acknowledged] == [sha256_of(f) for f in files]  # every one acknowledged
    assert generated == [4] * 12
    for adapter_id, sha in acknowledged:  # present through B
        assert cluster.lp_b.get_adapter(adapter_id).sha256 == sha
    with psycopg.connect(cluster.url) as conn:  # none half-registered: every row's bytes are whole
        rows = conn.execute(
            "SELECT a.sha256, string_agg(b.data, ''::bytea ORDER BY b.seq) FROM adapters a"
            " LEFT JOIN adapter_blobs b ON b.sha256 = a.sha256 GROUP BY a.sha256"
        ).fetchall()
        orphans = conn.execute(
            "SELECT count(*) FROM adapter_blobs b WHERE NOT EXISTS (SELECT 1 FROM adapters a WHERE a.sha256 = b.sha256)"
        ).fetchone()
    assert all(data is not None and hashlib.sha256(data).hexdigest() == sha for sha, data in rows)
    assert orphans == (0,)
    assert cluster.worker.poll() is None and cluster.alive(cluster.lp_b, cluster.worker_id)
    last = cluster.lp_b.generate(PROMPT, adapters={acknowledged[-1][0]: 1.0}, max_tokens=4)
    assert len(last.token_ids) == 4 and last.telemetry["worker_id"] == cluster.worker_id
    # the CLI with both addresses goes on through B; with only the dead one it cannot connect
    ok = CliRunner().invoke(cli, ["adapters", "show", str(acknowledged[0][0]), "--json", "--addr", both])
    assert ok.exit_code == 0 and f'"sha256": "{acknowledged[0][1]}"' in ok.output
    dead = CliRunner().invoke(cli, ["adapters", "list", "--addr", cluster.a_addr, "--connect-timeout", "2"])
    assert dead.exit_code == 3
