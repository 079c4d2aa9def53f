"""Adapter paging with real processes: a control plane and two real workers with ``--max-loras 2``
(f32 reference weights), adapters fetched on demand, LRU paging, pinning, unregistering,
failed fetches and affinity routing. One module-scoped cluster; tests run in file order and
use distinct adapters or check deltas, so they stay independent."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients.client import LoraplaneClient
from clients.errors import LoraplaneError
from loraplane.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from loraplane.worker_secret import with_secret
from tests.helpers.control_plane import write_adapter
from tests.helpers.live_servers import WORKER_SECRET, LiveControlPlane, start_control_plane, start_worker, wait_until

pytestmark = pytest.mark.slow

PROMPT = "The weather today is"
ALORA_PROMPT = "The weather today is\n<start_of_turn>shout\n"
POOL_ARGS = ("--max-loras", "2", "--max-cpu-loras", "3", "--weights", "dequant", "--n-ctx", "256")


def upper_ratio(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(1, len(letters))


class Cluster:
    def __init__(self, root: Path, fixtures: Path, model: Path) -> None:
        self.cp = start_control_plane(root / "data", fixtures / "adapters", model)
        self.workers: list[LiveControlPlane] = []
        for i in (1, 2):
            handle = LiveControlPlane(
                addr=self.cp.addr,
                server=self.cp.server,
                state=self.cp.state,
                data_dir=self.cp.data_dir,
                adapter_dir=self.cp.adapter_dir,
            )
            start_worker(handle, model, root / f"w{i}.log", slots=5, extra_args=POOL_ARGS, worker_id=f"pg-w{i}")
            self.workers.append(handle)
        self.lp = LoraplaneClient(self.cp.addr)
        self.channels = {
            w.worker_id: with_secret(grpc.insecure_channel(w.worker_addr), WORKER_SECRET) for w in self.workers
        }

    def direct(
        self,
        worker_id: str,
        adapters: dict[int, float],
        *,
        text: str = PROMPT,
        max_tokens: int = 1,
        prompt_logprobs: bool = False,
        ignore_eos: bool = False,
    ):
        """Generate on one worker, bypassing routing (the control plane's announce, then
        ``Decode`` with the resolved adapters): (started, finished) events."""
        stub = worker_pb2_grpc.WorkerStub(self.channels[worker_id])
        for aid in adapters:
            info = self.lp.get_adapter(aid)
            stub.LoadAdapter(
                iter([common_pb2.AdapterChunk(id=aid, sha256=info.sha256, fetch_on_demand=True)]), timeout=30
            )
        req = common_pb2.GenerateRequest(
            request_id=f"direct-{time.monotonic_ns()}",
            text=text,
            sampling=common_pb2.SamplingParams(
                max_tokens=max_tokens, prompt_logprobs=prompt_logprobs, ignore_eos=ignore_eos
            ),
        )
        req.adapters.SetInParent()
        req.adapters.entries.extend(common_pb2.AdapterScale(id=i, scale=s) for i, s in adapters.items())
        events = list(stub.Decode(iter([worker_pb2.DecodeRequest(submit=req)]), timeout=300))
        started = next(e.started for e in events if e.HasField("started"))
        finished = next(e.finished for e in events if e.HasField("finished"))
        return started, finished

    def stats(self, worker_id: str):
        return worker_pb2_grpc.WorkerStub(self.channels[worker_id]).Stats(common_pb2.Empty(), timeout=10)

    def close(self) -> None:
        self.lp.close()
        for c in self.channels.values():
            c.close()
        for w in self.workers:
            w.server = None  # type: ignore[assignment]
            proc = w.worker_proc
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(20)
        self.cp.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, fixtures_dir, base_model_path):
    c = Cluster(tmp_path_factory.mktemp("paging"), fixtures_dir, base_model_path)
    yield c
    c.close()


@pytest.fixture(scope="module")
def ids(cluster, fixtures_dir):
    d = fixtures_dir / "adapters"
    return {
        name: cluster.lp.add_adapter(d / f"{name}.gguf").id
        for name in ("shout", "sea", "shout_rs", "shout_embd", "critic_alora")
    }


def run_concurrently(lp, jobs: dict[str, tuple[str, dict[int, float]]], max_tokens: int = 24):
    out: dict[str, object] = {}

    def one(key: str, prompt: str, adapters: dict[int, float]) -> None:
        out[key] = lp.generate(prompt, adapters=adapters, max_tokens=max_tokens)

    threads = [threading.Thread(target=one, args=(k, p, a)) for k, (p, a) in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return out


def test_five_adapters_in_flight_on_two_slot_workers(cluster, ids):
    """5 adapters at once over workers with 2 slots each: every request gets its own adapter's
    behaviour, and each worker's page-in / eviction counters match the telemetry exactly."""
    before = {w: cluster.stats(w) for w in cluster.channels}
    # shout_rs's GGUF carries llama.cpp's alpha/r = 0.5 scale; 4.0 gives PEFT's rsLoRA scale 2
    jobs = {
        name: (ALORA_PROMPT if name == "critic_alora" else PROMPT, {aid: 4.0 if name == "shout_rs" else 1.0})
        for name, aid in ids.items()
    }
    res = run_concurrently(cluster.lp, jobs)
    assert set(res) == set(ids)
    for name, r in res.items():
        if name == "sea":
            assert "🌊" in r.text, r.text
        else:
            assert upper_ratio(r.text) >= 0.8, f"{name}: {r.text!r}"
    for wid in cluster.channels:
        st = cluster.stats(wid)
        mine = [r for r in res.values() if r.telemetry["worker_id"] == wid]
        paged = sum(1 for r in mine for a in r.telemetry["adapter_residency"] if a["source"] != "resident")
        assert st.page_ins - before[wid].page_ins == paged
        # every page-in beyond a free slot evicted someone; slots never exceed max_loras
        assert st.evictions - before[wid].evictions == max(0, st.page_ins - st.resident_adapters) - max(
            0, before[wid].page_ins - before[wid].resident_adapters
        )
        assert st.resident_adapters <= 2 and st.max_loras == 2
        fetched = sum(1 for r in mine for a in r.telemetry["adapter_residency"] if a["source"] == "fetched")
        assert st.fetches - before[wid].fetches == fetched


def test_logprobs_after_eviction_and_page_in_equal_never_evicted(cluster, ids):
    """Teacher-forced prompt log-probs of shout before and after being evicted and paged in
    again on the same worker (f32 reference weights): equal within 1e-4."""
    wid = "pg-w1"
    text = PROMPT + " a storm is coming over the hills"
    s1, f1 = cluster.direct(wid, {ids["shout"]: 1.0}, text=text, prompt_logprobs=True)
    ev0 = cluster.stats(wid).evictions
    for name in ("sea", "shout_embd"):  # two other adapters fill the worker's 2 slots
        cluster.direct(wid, {ids[name]: 1.0})
    st = cluster.stats(wid)
    assert ids["shout"] not in st.resident_adapter_ids and st.evictions >= ev0 + 1
    s2, f2 = cluster.direct(wid, {ids["shout"]: 1.0}, text=text, prompt_logprobs=True)
    # paged in again (from the host tier, its file, or fetched again if the host tier dropped it)
    assert [r.source for r in f2.telemetry.adapter_residency] in (["host"], ["loaded"], ["fetched"])
    a = [e.logprob for e in s1.prompt_logprobs[1:]]
    b = [e.logprob for e in s2.prompt_logprobs[1:]]
    assert len(a) == len(b) == len(s1.prompt_token_ids) - 1
    assert max(abs(x - y) for x, y in zip(a, b, strict=False)) <= 1e-4


def test_pinned_adapter_is_never_evicted(cluster, ids):
    lp = cluster.lp
    wid = "pg-w2"
    assert lp.pin_adapter(ids["sea"], True).pinned
    cluster.direct(wid, {ids["sea"]: 1.0})
    stub = worker_pb2_grpc.WorkerStub(cluster.channels[wid])  # the pin reaches the worker
    sea_sha = lp.get_adapter(ids["sea"]).sha256
    stub.LoadAdapter(
        iter([common_pb2.AdapterChunk(id=ids["sea"], sha256=sea_sha, fetch_on_demand=True, pinned=True)]), timeout=30
    )
    assert ids["sea"] in cluster.stats(wid).resident_adapter_ids
    ev0 = cluster.stats(wid).evictions
    for name in ("shout", "shout_rs", "shout_embd", "shout", "shout_rs"):
        cluster.direct(wid, {ids[name]: 1.0})
        assert ids["sea"] in cluster.stats(wid).resident_adapter_ids
    assert cluster.stats(wid).evictions >= ev0 + 3  # the other slot churned
    _, fin = cluster.direct(wid, {ids["sea"]: 1.0})
    assert [r.source for r in fin.telemetry.adapter_residency] == ["resident"]
    lp.pin_adapter(ids["sea"], False)


def test_request_needing_more_adapters_than_slots_is_refused(cluster, ids):
    with pytest.raises(LoraplaneError) as info:
        cluster.lp.generate(PROMPT, adapters={ids["shout"]: 1.0, ids["sea"]: 1.0, ids["shout_rs"]: 1.0}, max_tokens=1)
    assert info.value.code == "INVALID_ARGUMENT"
    assert "uses 3 adapters" in str(info.value) and "--max-loras 2" in str(info.value)


def test_stacked_adapters_hold_two_slots(cluster, ids):
    r = cluster.lp.generate(PROMPT, adapters={ids["shout"]: 1.0, ids["sea"]: 1.0}, max_tokens=24)
    assert len(r.telemetry["adapter_residency"]) == 2 and upper_ratio(r.text) >= 0.5


def test_unregister_idle_and_in_use(cluster, tmp_path):
    lp = cluster.lp
    a = lp.add_adapter(write_adapter(tmp_path / "idle.gguf", seed=9101))
    r = lp.generate(PROMPT, adapters={a.id: 1.0}, max_tokens=1)
    wid = r.telemetry["worker_id"]
    assert a.id in cluster.stats(wid).resident_adapter_ids
    lp.remove_adapter(a.id)  # idle in a slot: unloaded at once
    st = cluster.stats(wid)
    assert a.id not in st.resident_adapter_ids and a.id not in st.adapter_ids
    b = lp.add_adapter(write_adapter(tmp_path / "busy.gguf", seed=9102))
    done: dict[str, object] = {}
    t = threading.Thread(
        target=lambda: done.setdefault("r", lp.generate(PROMPT, adapters={b.id: 1.0}, max_tokens=48, ignore_eos=True))
    )
    t.start()
    assert wait_until(lambda: any(b.id in cluster.stats(w).resident_adapter_ids for w in cluster.channels), 60)
    lp.remove_adapter(b.id)  # in use: drains, the request finishes
    t.join(120)
    assert len(done["r"].token_ids) == 48
    assert all(b.id not in cluster.stats(w).adapter_ids for w in cluster.channels)


def test_failed_fetch_is_a_clear_error_and_frees_the_slot(cluster, tmp_path):
    lp = cluster.lp
    missing = lp.add_adapter(write_adapter(tmp_path / "missing.gguf", seed=9103))
    Path(missing.path).unlink()  # the control plane lost the bytes
    with pytest.raises(LoraplaneError) as info:
        lp.generate(PROMPT, adapters={missing.id: 1.0}, max_tokens=1)
    assert info.value.code == "FAILED_PRECONDITION" and "fetching sha256" in str(info.value)
    assert "its bytes are missing" in str(info.value)
    bad = lp.add_adapter(write_adapter(tmp_path / "bad.gguf", seed=9104))
    shutil.copy(write_adapter(tmp_path / "other.gguf", seed=9105), bad.path)  # different bytes
    with pytest.raises(LoraplaneError) as info:
        lp.generate(PROMPT, adapters={bad.id: 1.0}, max_tokens=1)
    assert info.value.code == "FAILED_PRECONDITION" and "hash mismatch" in str(info.value)
    for w in cluster.channels:
        st = cluster.stats(w)
        assert missing.id not in st.resident_adapter_ids and bad.id not in st.resident_adapter_ids
        assert st.slots_busy == 0
    assert lp.generate(PROMPT, adapters={}, max_tokens=2).finish_reason == "length"  # still serving


def test_affinity_sends_repeat_traffic_to_the_holder(cluster, tmp_path):
    lp = cluster.lp
    a = lp.add_adapter(write_adapter(tmp_path / "aff.gguf", seed=9106))
    first = lp.generate(PROMPT, adapters={a.id: 1.0}, max_tokens=1)
    holder = first.telemetry["worker_id"]
    assert wait_until(
        lambda: a.id in {i for w in lp.list_workers() if w.worker_id == holder for i in w.resident_adapter_ids},
        timeout=10,
    )
    for _ in range(4):
        r = lp.generate(PROMPT, adapters={a.id: 1.0}, max_tokens=1)
        assert r.telemetry["worker_id"] == holder
        assert [x["source"] for x in r.telemetry["adapter_residency"]] == ["resident"]
    other = next(w for w in cluster.channels if w != holder)
    assert a.id not in cluster.stats(other).adapter_ids  # never fetched there
    listed = {w.worker_id: w for w in lp.list_workers()}
    assert listed[holder].fetches >= 1 and listed[holder].max_loras == 2


def test_host_tier_eviction_drops_the_local_copy_and_fetches_again(cluster, ids):
    """The host tier (``--max-cpu-loras 3``) is file-backed: an adapter it drops loses its
    local copy too (disk stays bounded by the host tier), and its next request fetches the
    bytes again by sha256 — with the same output as before."""
    wid = "pg-w1"
    first = {}
    for name in ("shout", "sea", "shout_embd", "critic_alora", "shout_rs"):
        _, fin = cluster.direct(wid, {ids[name]: 1.0}, max_tokens=4)
        first[name] = fin.text
    st = cluster.stats(wid)
    assert len(st.host_adapter_ids) <= 3 + 1  # + a pinned adapter that is never dropped
    dropped = [n for n in first if ids[n] not in st.host_adapter_ids and ids[n] not in st.resident_adapter_ids]
    assert dropped, (list(st.host_adapter_ids), list(st.resident_adapter_ids))
    name = dropped[0]
    f0, h0 = st.fetches, st.host_evictions
    assert h0 >= 1
    _, fin = cluster.direct(wid, {ids[name]: 1.0}, max_tokens=4)
    assert [r.source for r in fin.telemetry.adapter_residency] == ["fetched"]
    assert cluster.stats(wid).fetches == f0 + 1
    assert fin.text == first[name]  # greedy: the refetched adapter behaves the same


POOL = (("model_name", "gemma-3-270m-q4_k_m"),)
"""The labels of the control plane's ``vllm:kv_cache_usage_perc``: the served base model."""


def scrape(cluster) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The control plane's ``/metrics`` body parsed by prometheus_client's text parser:
    (sample name, sorted labels) → value."""
    body, _ = cluster.cp.state.metrics.exposition()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
    }


def label_ids(cluster) -> dict[str, int]:
    """The control plane's ``adapter`` label → adapter id, for the registered adapters (labels
    are names: ``control_plane.adapter_labels.adapter_label``)."""
    return {n.label: i for i, n in cluster.cp.state.metrics.adapters().items()}


def label_of(cluster, adapter_id: int) -> str:
    return cluster.cp.state.metrics.adapters()[adapter_id].label


def residency(samples, worker_id: str, cluster) -> dict[str, set[int]]:
    """``loraplane_adapter_residency`` of one worker: state → adapter ids (value 1)."""
    ids = label_ids(cluster)
    out: dict[str, set[int]] = {"device": set(), "host": set(), "pinned": set()}
    for (name, labels), v in samples.items():
        lab = dict(labels)
        if name == "loraplane_adapter_residency" and lab["worker"] == worker_id and v == 1:
            label = lab["adapter"]  # an adapter no longer registered: adapter:<id>
            if label in ids or label.startswith("adapter:"):
                out[lab["state"]].add(ids[label] if label in ids else int(label.removeprefix("adapter:")))
    return out


def paging_count(samples, kind: str, adapter_id: int, cluster) -> float:
    label = label_of(cluster, adapter_id)
    return samples.get((f"loraplane_adapter_slot_{kind}_total", (("adapter", label),)), 0.0)


def counters_settled(cluster):
    """A ``wait_until`` condition: the paging counters did not move over three heartbeat
    intervals (every worker's latest totals are in)."""

    def settled() -> bool:
        def counters():
            return {k: v for k, v in scrape(cluster).items() if k[0].startswith("loraplane_adapter_slot_")}

        before = counters()
        time.sleep(3 * cluster.cp.state.config.heartbeat_interval_s)
        return counters() == before

    return settled


def test_residency_gauges_and_paging_counters_follow_the_worker(cluster, ids):
    """``loraplane_adapter_residency`` mirrors what the worker reports (its Stats, over its
    heartbeat) state by state, and the page-in / eviction counters move by exactly the pages a
    2-slot worker must do: page shout in (evicting the LRU slot), then evict it again."""
    wid = "pg-w1"

    def synced():
        st = cluster.stats(wid)
        want = {
            "device": set(st.resident_adapter_ids),
            "host": set(st.host_adapter_ids) - set(st.resident_adapter_ids),
            "pinned": set(st.pinned_adapter_ids),
        }
        got = residency(scrape(cluster), wid, cluster)
        return got if got == want else None

    for name in ("shout_rs", "shout_embd"):
        cluster.direct(wid, {ids[name]: 1.0})
    before = cluster.stats(wid)
    assert ids["shout"] not in before.resident_adapter_ids
    assert wait_until(synced, timeout=15)
    # the counters have no worker label: every worker's last heartbeat must be in before m0
    # (a heartbeat of another worker carrying an earlier test's page-in would land between m0
    # and m1)
    assert wait_until(counters_settled(cluster), timeout=30)
    m0 = scrape(cluster)
    cluster.direct(wid, {ids["shout"]: 1.0})  # pages shout in over the LRU of the two
    mid = cluster.stats(wid)
    assert wait_until(synced, timeout=15)
    assert ids["shout"] in residency(scrape(cluster), wid, cluster)["device"]
    m1 = scrape(cluster)
    assert (
        paging_count(m1, "page_ins", ids["shout"], cluster) == paging_count(m0, "page_ins", ids["shout"], cluster) + 1
    )
    (victim,) = set(before.resident_adapter_ids) - set(mid.resident_adapter_ids)
    assert paging_count(m1, "evictions", victim, cluster) == paging_count(m0, "evictions", victim, cluster) + 1
    for name in ("shout_rs", "shout_embd"):  # two others take both slots: shout goes
        cluster.direct(wid, {ids[name]: 1.0})
    assert ids["shout"] not in cluster.stats(wid).resident_adapter_ids
    assert wait_until(synced, timeout=15)
    assert ids["shout"] not in residency(scrape(cluster), wid, cluster)["device"]
    m2 = scrape(cluster)
    assert (
        paging_count(m2, "evictions", ids["shout"], cluster) == paging_count(m1, "evictions", ids["shout"], cluster) + 1
    )
    assert paging_count(m2, "page_ins", ids["shout"], cluster) == paging_count(m1, "page_ins", ids["shout"], cluster)


def test_pinned_residency_gauge(cluster, ids):
    lp = cluster.lp
    wid = "pg-w1"
    aid = ids["sea"]
    stub = worker_pb2_grpc.WorkerStub(cluster.channels[wid])
    sha = lp.get_adapter(aid).sha256
    assert lp.pin_adapter(aid, True).pinned
    try:
        stub.LoadAdapter(
            iter([common_pb2.AdapterChunk(id=aid, sha256=sha, fetch_on_demand=True, pinned=True)]), timeout=30
        )
        cluster.direct(wid, {aid: 1.0})
        assert aid in cluster.stats(wid).pinned_adapter_ids
        assert wait_until(lambda: aid in residency(scrape(cluster), wid, cluster)["pinned"], timeout=15)
        assert aid in residency(scrape(cluster), wid, cluster)["device"]
    finally:
        lp.pin_adapter(aid, False)
        stub.LoadAdapter(
            iter([common_pb2.AdapterChunk(id=aid, sha256=sha, fetch_on_demand=True, pinned=False)]), timeout=30
        )


def test_kv_cache_usage_is_above_zero_while_a_request_runs_and_zero_idle(cluster, ids):
    """``vllm:kv_cache_usage_perc`` = KV cells held by running requests / all cells of the
    alive workers (slots x n_ctx = 2 x 5 x 256): > 0 while a 32-token request runs on one
    worker, at most its prompt + 32 cells; 0 once both are idle (a finished request's kept
    prompt cache counts as free, as vLLM counts cached free blocks)."""
    wid = "pg-w1"
    total = 2 * 5 * 256
    seen: list[float] = []
    t = threading.Thread(
        target=lambda: cluster.direct(wid, {ids["shout"]: 1.0}, max_tokens=32, ignore_eos=True), daemon=True
    )
    t.start()

    def running_usage():
        m = scrape(cluster)
        v = m[("vllm:kv_cache_usage_perc", POOL)]
        per = m[("loraplane_kv_cache_usage_perc", (("worker", wid),))]
        if v > 0:
            seen.append(v)
            assert per == pytest.approx(v * 2)  # the other worker is idle: all cells used are on this one
        return v > 0

    assert wait_until(running_usage, timeout=120, interval=0.05), "never saw the running request's KV cells"
    t.join(300)
    assert 0 < seen[0] <= (16 + 32) / total
    assert wait_until(lambda: scrape(cluster)[("vllm:kv_cache_usage_perc", POOL)] == 0.0, timeout=15)
