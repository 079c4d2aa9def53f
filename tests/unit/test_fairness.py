"""Fair admission (``worker.serving.fairness``, worker ``--fairness vtc``): the VTC
state and order alone, and with the scheduler's admission rule (resident-first, bounded
bypass) through ``Scheduler._next_admissible`` on a fake pool — no model, no threads."""

from __future__ import annotations

import math
import random
import types
from collections import deque
from dataclasses import dataclass, field

import click
import pytest
from click.testing import CliRunner

from loraplane.v1 import worker_pb2
from worker.errors import InvalidRequestError
from worker.rpc.servicer import tenant_from_proto
from worker.serving.fairness import FairQueue, check_weight
from worker.serving.request import ANONYMOUS, RequestTenant
from worker.serving.scheduler import ADMIT_LOOKAHEAD, MAX_BYPASS, Scheduler, admission_order


@dataclass(eq=False)
class Req:
    """What the fair queue and the admission rule read of a ``GenRequest``."""

    name: str
    prompt: list[int]
    tenant: RequestTenant = ANONYMOUS
    adapters: tuple[str, ...] = ()  # sha256 of the adapters it uses
    bypassed: int = 0
    fair_state: object = None
    fair_running: bool = False
    staged: dict = field(default_factory=dict)
    pool_held: list = field(default_factory=list)
    admitted_at: float = 0.0

    @property
    def adapter_set(self):
        return types.SimpleNamespace(
            entries=[(i, types.SimpleNamespace(sha256=s), 1.0) for i, s in enumerate(self.adapters)]
        )

    def note_residency(self, was, *, slot_wait_ms, page_in_ms):
        pass


def req(name: str, tenant: str, n_prompt: int = 4, *, weight: float = 1.0, priority: int = 0, adapters=()) -> Req:
    return Req(name, [1] * n_prompt, RequestTenant(tenant, weight, priority), tuple(adapters))


def names(reqs) -> list[str]:
    return [r.name for r in reqs]


# ---- counters and order -------------------------------------------------------------------


def test_order_is_by_counter_then_arrival_and_charges_prompts_as_it_goes():
    fq = FairQueue(prompt_weight=1.0, output_weight=2.0)
    a1, a2, a3 = req("a1", "A", 4), req("a2", "A", 4), req("a3", "A", 4)
    b1, b2 = req("b1", "B", 10), req("b2", "B", 10)
    for r in (a1, a2, a3, b1, b2):
        fq.enqueue(r)
    # both at 0: A's head arrived first; A then stands at 4 (its prompt), B at 0 → b1; B at 10,
    # A at 4 → a2; A at 8 → a3; A at 12 > 10 → b2
    assert names(fq.order(8)) == ["a1", "b1", "a2", "a3", "b2"]
    assert names(fq.order(2)) == ["a1", "b1"]
    fq.admitted(a1)
    assert fq.counter("A") == 4.0 and fq.counter("B") == 0.0
    fq.charge_output([a1, a1, a1])  # three tokens: 2 virtual tokens each
    assert fq.counter("A") == 10.0
    assert names(fq.order(8))[:2] == ["b1", "a2"]  # B (0) before A (10)
    fq.admitted(b1)
    fq.ended(a1)
    fq.ended(b1)
    snap = {t.name: t for t in fq.snapshot()}
    assert (snap["A"].prompt_tokens, snap["A"].output_tokens, snap["A"].queued, snap["A"].running) == (4, 3, 2, 0)
    assert (snap["B"].virtual_tokens, snap["B"].queued, snap["B"].running) == (10.0, 1, 0)


def test_lift_to_the_minimum_of_the_backlogged_never_down():
    fq = FairQueue()
    heavy = [req(f"h{i}", "H", 50) for i in range(3)]
    for r in heavy:
        fq.enqueue(r)
    fq.admitted(heavy[0])  # H: 50, still backlogged (h1, h2)
    fq.enqueue(mid := req("m1", "M", 5))
    fq.admitted(mid)
    fq.charge_output([mid] * 100)  # M: max(0, 50) + 5 + 200 = 255, nothing of M queued now
    assert fq.counter("M") == 255.0
    fq.enqueue(req("l1", "L"))  # new tenant while H (50) is backlogged: lifted to 50, not 0
    assert fq.counter("L") == 50.0
    fq.enqueue(req("m2", "M"))  # M comes back above the minimum: keeps its own 255
    assert fq.counter("M") == 255.0
    # L and H tie at 50: H's head arrived first, then L, then H again (55 > 50 + 4), M last
    assert names(fq.order(8)) == ["h1", "l1", "h2", "m2"]


def test_lift_with_nothing_queued_uses_the_tenant_admitted_last():
    fq = FairQueue()
    fq.enqueue(a := req("a", "A", 30))
    fq.admitted(a)
    fq.charge_output([a] * 10)  # A: 30 + 20 = 50, the last to leave the queue
    fq.enqueue(b := req("b", "B"))  # empty queue: B lifted to A's counter now
    assert fq.counter("B") == 50.0
    # priority classes lift within their class: a class-1 newcomer sees no class-1 tenant
    fq.enqueue(req("c", "C", priority=1))
    assert fq.counter("C") == 0.0
    fq.ended(b)


def test_weights_give_proportional_service_under_backlog():
    """Simulated closed loops, 2 slots, no preemption: A (weight 2) and B (weight 1) always
    have 4 requests queued; each request has a 4-token prompt and produces 8 tokens."""
    fq = FairQueue(prompt_weight=1.0, output_weight=2.0)
    service = {"A": 0.0, "B": 0.0}
    tags = {"A": RequestTenant("A", 2.0), "B": RequestTenant("B", 1.0)}
    queued: dict[str, int] = {"A": 0, "B": 0}
    running: list[list] = []  # [request, tokens left]
    n = 0
    for _step in range(3000):
        for t in ("A", "B"):
            while queued[t] < 4:
                n += 1
                fq.enqueue(Req(f"{t}{n}", [1] * 4, tags[t]))
                queued[t] += 1
        while len(running) < 2:
            r = fq.order(1)[0]
            fq.admitted(r)
            queued[r.tenant.name] -= 1
            service[r.tenant.name] += 4
            running.append([r, 8])
        fq.charge_output([r for r, _ in running])
        for item in running:
            service[item[0].tenant.name] += 2
            item[1] -= 1
        for item in [i for i in running if i[1] == 0]:
            running.remove(item)
            fq.ended(item[0])
    assert service["A"] / service["B"] == pytest.approx(2.0, rel=0.05)
    # counters: weighted service / weight, equal up to a request's worth
    assert abs(fq.counter("A") - fq.counter("B")) <= 4 + 2 * 8 * 2


def test_priority_classes_are_strict_and_vtc_within_a_class():
    fq = FairQueue()
    for r in (req("low1", "L", priority=1), req("hi1", "H1"), req("hi2", "H2"), req("hi3", "H1")):
        fq.enqueue(r)
    # class 0 only (the window of resident-first stays in the class), VTC inside it
    assert names(fq.order(8)) == ["hi1", "hi2", "hi3"]
    snap = {t.name: t for t in fq.snapshot()}
    assert (snap["L"].priority, snap["L"].queued) == (1, 1)
    for r in fq.order(8):
        fq.admitted(r)
    assert names(fq.order(8)) == ["low1"]


def test_cancelled_queued_request_leaves_without_charge():
    fq = FairQueue()
    fq.enqueue(a := req("a", "A", 9))
    fq.enqueue(b := req("b", "A", 9))
    fq.ended(b)  # cancelled while queued, behind a
    assert names(fq.order(8)) == ["a"] and fq.counter("A") == 0.0
    fq.ended(a)
    assert fq.order(8) == [] and fq.snapshot()[0].queued == 0


def test_memory_cap_forgets_idle_tenants_only():
    fq = FairQueue(max_tenants=3)
    busy = req("busy", "B0", 7)
    fq.enqueue(busy)
    for i in range(1, 10):  # nine tenants come, are served and go idle
        fq.enqueue(r := req(f"r{i}", f"T{i}"))
        fq.admitted(r)
        fq.ended(r)
    assert len(fq) == 3
    assert fq.counter("B0") == 0.0  # queued all along: kept
    assert fq.counter("T1") is None and fq.counter("T9") is not None  # LRU: the oldest idle went
    # a forgotten tenant comes back: lifted to the backlogged minimum (B0: 0), as if new
    fq.enqueue(req("again", "T1"))
    assert fq.counter("T1") == 0.0
    assert len(fq.snapshot(limit=2)) == 2 and fq.snapshot()[0].name in ("B0", "T1")


def test_weights_are_checked():
    assert check_weight("w", 2) == 2.0
    for bad in (0, -1, math.nan, math.inf):
        with pytest.raises(ValueError, match="--fairness-output-weight must be a finite number > 0"):
            FairQueue(output_weight=bad)
    with pytest.raises(ValueError, match="--fairness-prompt-weight"):
        FairQueue(prompt_weight=0)


def test_tenant_from_the_wire():
    assert tenant_from_proto(None) == ANONYMOUS == RequestTenant("anonymous", 1.0, 0)
    assert tenant_from_proto(worker_pb2.RequestTenant()) == ANONYMOUS  # proto3 zeros
    assert tenant_from_proto(worker_pb2.RequestTenant(name="acme", weight=2.5, priority=-3)) == RequestTenant(
        "acme", 2.5, -3
    )
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(InvalidRequestError, match="tenant 'acme': weight"):
            tenant_from_proto(worker_pb2.RequestTenant(name="acme", weight=bad))
    with pytest.raises(ValueError, match="tenant 'x': weight 0 must be a finite number > 0"):
        RequestTenant("x", 0)
    with pytest.raises(InvalidRequestError, match="tenant name has 300 characters; at most 256"):
        tenant_from_proto(worker_pb2.RequestTenant(name="x" * 300))


def test_cli_flags_validated_and_turned_into_worker_args():
    from clients.cli.server_commands import worker_cmd
    from worker.options import worker_argv

    for bad in ("0", "-2", "nan", "inf"):
        res = CliRunner().invoke(worker_cmd, ["--fairness", "vtc", "--fairness-prompt-weight", bad])
        assert res.exit_code == 2, res.output
        assert "--fairness-prompt-weight" in res.output and "is not a finite number > 0" in res.output
    res = CliRunner().invoke(worker_cmd, ["--fairness", "fair"])
    assert res.exit_code == 2 and "'off', 'vtc'" in res.output
    base = dict(model_path=None, n_slots=2, device="cpu", n_ctx_slot=None)
    args = worker_argv(dict(base, fairness="vtc", fairness_prompt_weight=1.5, fairness_output_weight=3.0))
    assert args[-6:] == ("--fairness", "vtc", "--fairness-prompt-weight", "1.5", "--fairness-output-weight", "3.0")
    assert "--fairness" not in worker_argv(base)  # not given: the worker's default (off)
    assert isinstance(worker_cmd, click.Command)


# ---- with the scheduler's admission rule ---------------------------------------------------


class FakePool:
    """``LoraPool`` as admission sees it: which adapters are resident; acquiring always works
    and makes them resident."""

    def __init__(self, resident=()):
        self.resident = set(resident)

    def slot_of(self, sha):
        return 0 if sha in self.resident else None

    def acquire(self, adapters, staged):
        self.resident.update(a.sha256 for a in adapters)


def sched(pool: FakePool, fair: FairQueue | None) -> Scheduler:
    """A scheduler with only what ``_next_admissible`` uses (no model, no loop thread)."""
    s = Scheduler.__new__(Scheduler)
    s.ctx = types.SimpleNamespace(pool=pool)
    s.queue = deque()
    s.fair = fair
    return s


def admit_one(s: Scheduler) -> Req:
    r = s._next_admissible()
    assert r is not None
    s.queue.remove(r)
    if s.fair is not None:
        s.fair.admitted(r)
    return r


def test_resident_first_within_the_fair_order_bypasses_the_fair_head_at_most_max_bypass_times():
    pool = FakePool(resident={"hot"})
    s = sched(pool, FairQueue())
    cold = req("cold", "A", adapters=("cold",))  # the fair head: A at 0, arrived first
    for r in [cold] + [req(f"b{i}", "B", adapters=("hot",)) for i in range(8)]:
        s.queue.append(r)
        s.fair.enqueue(r)
    order = [admit_one(s).name for _ in range(MAX_BYPASS + 2)]
    # B's resident requests pass the cold head MAX_BYPASS times, then the head goes
    assert order == [f"b{i}" for i in range(MAX_BYPASS)] + ["cold", f"b{MAX_BYPASS}"]
    assert cold.bypassed == MAX_BYPASS


def test_resident_first_never_reaches_past_the_lookahead_of_the_fair_order():
    pool = FakePool(resident={"hot"})
    s = sched(pool, FairQueue())
    # A has ADMIT_LOOKAHEAD cold requests and the lowest counter throughout; B's resident one
    # is 9th in the fair order: outside the window, so A's head is admitted first
    a = [req(f"a{i}", "A", 1, adapters=("cold",)) for i in range(ADMIT_LOOKAHEAD)]
    for r in a:
        s.queue.append(r)
        s.fair.enqueue(r)
    s.fair.enqueue(b := req("b", "B", 1, adapters=("hot",)))  # lifted to A's 0
    s.fair.admitted(b)
    s.fair.charge_output([b] * 50)  # B at 101
    s.fair.ended(b)
    s.queue.append(b2 := req("b2", "B", adapters=("hot",)))
    s.fair.enqueue(b2)
    assert s.fair.counter("B") == 101.0
    assert names(s.fair.order(ADMIT_LOOKAHEAD)) == names(a)
    assert admit_one(s).name == "a0"


def test_fairness_off_admits_in_todays_order():
    """``--fairness off``: ``_next_admissible`` is today's rule — ``admission_order`` over the
    FIFO queue with the queue head's bypass count — whatever the tenants, on random queues."""
    rng = random.Random(7)
    for _trial in range(50):
        pool = FakePool(resident={"r0", "r1"})
        ref_pool = FakePool(resident={"r0", "r1"})
        reqs = [
            req(f"q{i}", rng.choice("ABC"), adapters=(rng.choice(["r0", "r1", "c0", "c1", "c2"]),)) for i in range(20)
        ]
        twins = [Req(r.name, r.prompt, r.tenant, r.adapters) for r in reqs]
        s = sched(pool, None)
        s.queue.extend(reqs)
        got = [admit_one(s).name for _ in range(len(reqs))]
        ref: deque = deque(twins)  # today's code, written out: head = queue[0]
        want = []
        while ref:
            head = ref[0]
            pick = admission_order(ref, ref_pool)[0]
            ref_pool.acquire([a for _, a, _ in pick.adapter_set.entries], {})
            if pick is not head:
                head.bypassed += 1
            ref.remove(pick)
            want.append(pick.name)
        assert got == want
        assert all(r.fair_state is None for r in reqs)


# ---- the bench's service measure (bench/fairness.py) ----------------------------------------


def test_bench_service_difference_counts_only_tenants_backlogged_over_the_window():
    from bench.fairness import (
        Call,
        backlog_intervals,
        max_service_difference,
        service_at,
        service_curve,
        vtc_bound,
    )

    # A: one request sent at 0, prompt (4 tokens) computed at 1, a token every second 2..9, ends at 10
    a = [Call("A", 0, 0.0, prompt_tokens=4, started=1.0, tokens=[float(t) for t in range(2, 10)], ended=10.0)]
    # B: two requests back to back (a 0.1 s turnaround), a token at 3 and 4, then 7 and 8
    b = [
        Call("B", 0, 0.0, prompt_tokens=2, started=2.5, tokens=[3.0, 4.0], ended=5.0),
        Call("B", 0, 5.1, prompt_tokens=2, started=6.5, tokens=[7.0, 8.0], ended=9.0),
    ]
    # C: idle between 3 and 8: never backlogged over a window that crosses that gap
    c = [Call("C", 0, 0.0, started=0.5, tokens=[1.0], ended=3.0), Call("C", 0, 8.0, ended=10.0)]
    curves = {k: service_curve(v, 1.0, 2.0) for k, v in (("A", a), ("B", b), ("C", c))}
    assert service_at(curves["A"], 0.9) == 0 and service_at(curves["A"], 1.0) == 4
    assert service_at(curves["A"], 9.0) == 4 + 2 * 8 and service_at(curves["B"], 9.0) == 2 * (2 + 2 * 2)
    intervals = {k: backlog_intervals(v, gap_s=0.25) for k, v in (("A", a), ("B", b), ("C", c))}
    assert intervals["B"] == [(0.0, 9.0)] and intervals["C"] == [(0.0, 3.0), (8.0, 10.0)]
    # windows [0, 4], [2, 6], [4, 8]: A and B are compared, C never (not backlogged throughout);
    # S(b) - S(a) with S counting events at or before t: [0,4]: A 4 + 3 tokens x 2 = 10, B 2 +
    # 2 x 2 = 6 → 4; [2,6]: A 8, B 6 → 2; [4,8]: A 8, B 2 + 2 x 2 = 6 → 2
    d, n = max_service_difference(curves, intervals, 0.0, 8.0, 4.0, 2.0)
    assert (d, n) == (4.0, 3)
    assert max_service_difference(curves, intervals, 0.0, 8.0, 9.0, 1.0) == (pytest.approx(math.nan, nan_ok=True), 0)
    assert vtc_bound(1.0, 2.0, max_prompt=32, slots=2, max_tokens=32) == 256.0
    assert vtc_bound(1.0, 2.0, max_prompt=1000, slots=2, max_tokens=32) == 2000.0


def test_tenant_service_is_the_proto_field_for_field_and_reaches_worker_stats():
    import dataclasses

    from worker.rpc.servicer import stats_to_proto
    from worker.serving.engine import WorkerStatsRecord
    from worker.serving.fairness import TenantService
    from worker.serving.scheduler import SchedulerStats

    assert {f.name for f in dataclasses.fields(TenantService)} == set(
        worker_pb2.TenantService.DESCRIPTOR.fields_by_name
    )
    fq = FairQueue()
    fq.enqueue(r := req("r", "acme", 5, weight=4.0, priority=2))
    fq.admitted(r)
    sched_stats = SchedulerStats(*([0] * 10), fairness="vtc", tenants=tuple(fq.snapshot()))
    rec = WorkerStatsRecord(sched_stats, "w", "mixed", "keyed", "m", "cpu", "f32", [], 0, 0)
    msg = stats_to_proto(rec)
    assert msg.fairness == "vtc" and len(msg.tenants) == 1
    t = msg.tenants[0]
    assert (t.name, t.virtual_tokens, t.prompt_tokens, t.running, t.queued, t.weight, t.priority) == (
        "acme",
        1.25,
        5,
        1,
        0,
        4.0,
        2,
    )


def test_serve_passes_the_fairness_flags_to_its_worker(monkeypatch, tmp_path):
    """``loraplane serve --fairness vtc …``: the worker subprocess gets the same flags (the
    serve machinery itself is replaced: no process starts)."""
    import clients.cli.serve as serve_mod
    from clients.cli.server_commands import serve_cmd

    seen = {}

    def fake_run_serve(spec, run_control_plane, config, on_ready=None):
        seen["worker_args"] = spec.worker_args
        return 0

    monkeypatch.setattr(serve_mod, "run_serve", fake_run_serve)
    res = CliRunner().invoke(
        serve_cmd,
        ["--addr", "127.0.0.1:0", "--data-dir", str(tmp_path), "--fairness", "vtc", "--fairness-output-weight", "3"],
    )
    assert res.exit_code == 0, res.output
    args = list(seen["worker_args"])
    assert args[args.index("--fairness") + 1] == "vtc"
    assert args[args.index("--fairness-output-weight") + 1] == "3.0"
    assert "--fairness-prompt-weight" not in args  # not given: the worker's default


# ---- queue shares: who gives way on a full worker --------------------------------------------


def test_give_way_names_the_largest_tenants_newest_queued_request_never_a_better_class():
    """``FairQueue.give_way`` (the rule of ``loraplane.queue_shares``): the heaviest tenant's newest
    queued request, only while it stays at least as loaded as the newcomer after the swap;
    a worse priority class gives way to a better one at any load, never the other way; running
    requests count in a tenant's load but only a queued one is given."""
    from loraplane.queue_shares import Share, gives_way

    fq = FairQueue()
    reqs = [req(f"h{i}", "heavy") for i in range(3)] + [req("m0", "mid"), req("m1", "mid")]
    for r in reqs:
        fq.enqueue(r)
    fq.admitted(reqs[0])  # h0 runs: heavy holds 3 (1 running), mid 2
    assert fq.give_way(RequestTenant("new")).name == "h2"  # 3 > 1 and > mid's 2
    assert fq.give_way(RequestTenant("mid")) is None  # heavy 3 > 2 + 1? no
    assert fq.give_way(RequestTenant("heavy")) is None  # mid 2 > 4? no
    assert fq.give_way(RequestTenant("mid", weight=2.0)).name == "h2"  # 3 > (2 + 1) / 2
    low = req("x0", "batch", priority=5)
    fq.enqueue(low)
    assert fq.give_way(RequestTenant("vip", priority=-1)).name == "x0"  # the worst class first, load 1
    assert fq.give_way(RequestTenant("batch2", priority=9)) is None  # a worse class takes no place
    # the rule alone: no swap ever makes the split less even, so no ping-pong
    assert gives_way(Share(3, 1.0, 0), Share(1, 1.0, 0)) and not gives_way(Share(2, 1.0, 0), Share(2, 1.0, 0))
    assert gives_way(Share(1, 1.0, 0), Share(0, 4.0, 0)) and not gives_way(Share(0, 1.0, 0), Share(0, 1.0, 0))


def test_the_control_plane_tries_a_full_worker_for_a_lighter_tenant_only_if_it_shares_its_queue():
    """``WorkerPool.has_room`` counts its relays per worker and tenant: a worker at slots + queue
    limit is still tried for a tenant the rule lets in (the worker then evicts), never for the
    heavy tenant itself, and never when the worker does not share its queue (--fairness off:
    "every live worker is full" as before); a relay that ends gives its count back."""
    from control_plane.membership import WorkerPool
    from control_plane.workers import WorkerHandle
    from loraplane.queue_shares import Share

    pool = WorkerPool(None)  # type: ignore[arg-type]  # no registry: membership is not used here
    w = WorkerHandle("w1", "127.0.0.1:1", "m", "", 2, None, None, 0.0, queue_limit=2)  # type: ignore[arg-type]
    heavy, light = Share(1, 1.0, 0, "heavy"), Share(1, 1.0, 0, "light")
    tokens = [pool.begin(w, tenant=heavy) for _ in range(4)]
    assert w.in_flight == 4 and w.tenants["heavy"].requests == 4
    assert not pool.has_room(w, light)  # --fairness off (the default until its Stats say vtc)
    w.shares_queue = True
    assert pool.has_room(w, light) and not pool.has_room(w, heavy)
    mine = pool.begin(w, tenant=light)
    pool.end(w, tokens.pop())  # the heavy request that gave way
    assert pool.has_room(w, light)  # heavy 3 > light 1 + 1
    pool.begin(w, tenant=light)
    pool.end(w, tokens.pop())
    assert not pool.has_room(w, light) and not pool.has_room(w, heavy)  # 2 : 2
    assert pool.has_room(w, Share(1, 1.0, -1, "vip"))  # a better class: any load gives way
    pool.end(w, mine)
    assert w.tenants["light"].requests == 1 and w.in_flight == 3
    assert pool.has_room(w, heavy)  # below the capacity: anyone
