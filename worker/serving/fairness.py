"""Fair admission across tenants: the Virtual Token Counter (worker ``--fairness vtc``).

`FairQueue` holds the state of VTC (Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024, Algorithm 2), weighted, with strict priority classes: a counter of weighted service
per tenant (`TenantState`, named by the request's ``RequestTenant``), charged for a request's
prompt when it is admitted and for each sampled token (``charge_output``), lifted when an idle
tenant returns. It gives the scheduler (``worker.serving.scheduler``) the order in which to try
the queued requests (``order``), names the queued request that gives way on a full worker
(``give_way``, the rule of `loraplane.queue_shares`) and reports tenants (``snapshot``,
`STATS_TENANTS`); idle tenants are remembered up to `MAX_TENANTS`. It decides nothing else: the
scheduler applies the slot pool's resident-first rule and the bounded bypass on top.
Thread safety: one lock; ``enqueue`` runs on submitting threads, the rest on the loop thread.

The rule, the lift, the bound without preemption, memory and costs: docs/fairness.md.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplane.queue_shares import Share, gives_way, ordering

if TYPE_CHECKING:
    from worker.serving.request import GenRequest, RequestTenant

MAX_TENANTS = 4096  # idle tenants remembered (LRU beyond; busy ones are always kept)
STATS_TENANTS = 64  # tenants reported in WorkerStats.tenants (busy first, then recent)


def check_weight(what: str, value: float) -> float:
    """``value`` as a float if it is a finite number > 0.

    Raises:
        ValueError: naming ``what`` (e.g. "--fairness-prompt-weight") and the value.
    """
    v = float(value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")
    return v


@dataclass(eq=False)
class TenantState:
    """One tenant's VTC state: ``counter`` in virtual tokens (weighted service / weight),
    totals of prompt and output tokens admitted / generated, its queued requests
    (``(arrival number, request)``, oldest first) and how many run."""

    name: str
    weight: float = 1.0
    priority: int = 0
    counter: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    queue: deque[tuple[int, GenRequest]] = field(default_factory=deque)
    running: int = 0

    @property
    def busy(self) -> bool:
        """Whether it has a request queued or running (never forgotten then)."""
        return bool(self.queue) or self.running > 0


@dataclass(frozen=True)
class TenantService:
    """A tenant's state as ``WorkerStats.tenants`` reports it (proto ``TenantService``,
    field for field)."""

    name: str
    virtual_tokens: float
    prompt_tokens: int
    output_tokens: int
    queued: int
    running: int
    weight: float
    priority: int


class FairQueue:
    """The VTC state and order of the scheduler's queued requests (module docstring).

    Each request it tracks carries its ``TenantState`` in ``req.fair_state`` (None once it
    ended) and whether it runs in ``req.fair_running``.

    Args:
        prompt_weight: ``w_p``, virtual tokens per prompt token (> 0, finite).
        output_weight: ``w_q``, virtual tokens per generated token (> 0, finite).
        max_tenants: idle tenants remembered (LRU beyond).

    Raises:
        ValueError: a weight that is not a finite number > 0, or ``max_tenants`` < 1.
    """

    def __init__(self, prompt_weight: float = 1.0, output_weight: float = 2.0, max_tenants: int = MAX_TENANTS):
        self.prompt_weight = check_weight("--fairness-prompt-weight", prompt_weight)
        self.output_weight = check_weight("--fairness-output-weight", output_weight)
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        self.max_tenants = max_tenants
        self._lock = threading.Lock()
        self._tenants: OrderedDict[str, TenantState] = OrderedDict()  # LRU: most recently active last
        self._backlogged: dict[str, TenantState] = {}  # tenants with a request queued
        self._last_left: dict[int, TenantState] = {}  # priority → tenant admitted last (the lift's l)
        self._arrivals = 0

    # --- the scheduler's calls ------------------------------------------------------------
    def enqueue(self, req: GenRequest) -> None:
        """A request joined the queue: find or make its tenant (weight and priority from the
        request's ``tenant``), lift the tenant's counter if it had nothing queued, queue it."""
        tag = req.tenant
        with self._lock:
            t = self._tenants.get(tag.name)
            new = t is None
            if t is None:
                t = self._tenants[tag.name] = TenantState(tag.name)
            else:
                self._tenants.move_to_end(tag.name)
            t.weight, t.priority = tag.weight, tag.priority
            if not t.queue:
                self._lift(t)
                self._backlogged[t.name] = t
            self._arrivals += 1
            t.queue.append((self._arrivals, req))
            req.fair_state, req.fair_running = t, False
            if new:
                self._forget_idle()  # after queueing: the new tenant is busy, never the one dropped

    def order(self, n: int) -> list[GenRequest]:
        """The next ``n`` (at most) queued requests VTC would admit, in order, all of the
        top priority class (module docstring); empty when nothing is queued."""
        with self._lock:
            if not self._backlogged:
                return []
            top = min(t.priority for t in self._backlogged.values())
            heap = [(t.counter, t.queue[0][0], 0, t) for t in self._backlogged.values() if t.priority == top]
            heapq.heapify(heap)  # arrival numbers are unique: tuples never compare the states
            out: list[GenRequest] = []
            while heap and len(out) < n:
                counter, _, i, t = heapq.heappop(heap)
                req = t.queue[i][1]
                out.append(req)
                if i + 1 < len(t.queue):
                    nxt = counter + self.prompt_weight * len(req.prompt) / t.weight
                    heapq.heappush(heap, (nxt, t.queue[i + 1][0], i + 1, t))
            return out

    def admitted(self, req: GenRequest) -> None:
        """``req`` left the queue for a KV sequence: charge its prompt, count it running."""
        t = req.fair_state
        if t is None:
            return
        with self._lock:
            self._unqueue(t, req)
            t.counter += self.prompt_weight * len(req.prompt) / t.weight
            t.prompt_tokens += len(req.prompt)
            t.running += 1
            req.fair_running = True
            self._last_left[t.priority] = t

    def ended(self, req: GenRequest) -> None:
        """``req`` ended, queued (cancelled, failed) or running: forget it (no charge)."""
        t = req.fair_state
        if t is None:
            return
        with self._lock:
            if req.fair_running:
                t.running -= 1
            else:
                self._unqueue(t, req)
            req.fair_state, req.fair_running = None, False

    def give_way(self, tag: RequestTenant) -> GenRequest | None:
        """On a full worker, the queued request that gives its place to a new request of tenant
        ``tag``: the newest queued request of the largest tenant that gives way
        (`loraplane.queue_shares`); None when none does (the new request is refused). The caller
        removes it from the queue (``ended``) and ends it."""
        with self._lock:
            t = self._tenants.get(tag.name)
            newcomer = Share(0 if t is None else len(t.queue) + t.running, tag.weight, tag.priority)
            best: tuple[tuple[int, float], TenantState] | None = None
            for h in self._backlogged.values():  # only they have a queued request to give
                share = Share(len(h.queue) + h.running, h.weight, h.priority)
                if h.name != tag.name and gives_way(share, newcomer):
                    if best is None or ordering(share) > best[0]:
                        best = (ordering(share), h)
            return None if best is None else best[1].queue[-1][1]

    def charge_output(self, reqs: Iterable[GenRequest]) -> None:
        """One generated token for each of ``reqs`` (one decode step's sampled rows; a
        request appears once per token): ``c += w_q / weight``. O(rows)."""
        w_q = self.output_weight
        with self._lock:
            for req in reqs:
                t = req.fair_state
                if t is not None:
                    t.counter += w_q / t.weight
                    t.output_tokens += 1

    # --- reading ------------------------------------------------------------------------
    def snapshot(self, limit: int = STATS_TENANTS) -> list[TenantService]:
        """At most ``limit`` tenants: those with requests queued or running first (lowest
        priority value, then counter), then the most recently active idle ones."""
        with self._lock:
            busy = sorted((t for t in self._tenants.values() if t.busy), key=lambda t: (t.priority, t.counter, t.name))
            idle = [t for t in reversed(self._tenants.values()) if not t.busy]
            return [
                TenantService(
                    name=t.name,
                    virtual_tokens=t.counter,
                    prompt_tokens=t.prompt_tokens,
                    output_tokens=t.output_tokens,
                    queued=len(t.queue),
                    running=t.running,
                    weight=t.weight,
                    priority=t.priority,
                )
                for t in (busy + idle)[:limit]
            ]

    def counter(self, name: str) -> float | None:
        """Tenant ``name``'s counter, None when not known (never seen, or forgotten)."""
        with self._lock:
            t = self._tenants.get(name)
            return None if t is None else t.counter

    def __len__(self) -> int:
        """Tenants known now."""
        with self._lock:
            return len(self._tenants)

    # --- internals (lock held) ------------------------------------------------------------
    def _lift(self, t: TenantState) -> None:
        """The paper's counter lift for ``t``, which has nothing queued (module docstring)."""
        waiting = [b.counter for b in self._backlogged.values() if b.priority == t.priority]
        if waiting:
            t.counter = max(t.counter, min(waiting))
            return
        last = self._last_left.get(t.priority)
        if last is not None:
            t.counter = max(t.counter, last.counter)

    def _unqueue(self, t: TenantState, req: GenRequest) -> None:
        """Take ``req`` out of ``t``'s queue (usually its head); ``t`` stops being backlogged
        when nothing of it is left queued."""
        if t.queue and t.queue[0][1] is req:
            t.queue.popleft()
        else:
            for i, (_, r) in enumerate(t.queue):
                if r is req:
                    del t.queue[i]
                    break
        if not t.queue:
            self._backlogged.pop(t.name, None)

    def _forget_idle(self) -> None:
        """Drop the least recently active idle tenants beyond ``max_tenants`` (busy ones are
        moved to the recent end and kept); then the lift references of classes no tenant
        has any more, once there are more of them than tenants allowed."""
        scanned = 0
        while len(self._tenants) > self.max_tenants and scanned < len(self._tenants):
            name, t = next(iter(self._tenants.items()))
            if t.busy:
                self._tenants.move_to_end(name)
                scanned += 1
            else:
                del self._tenants[name]
        if len(self._last_left) > self.max_tenants:
            classes = {t.priority for t in self._tenants.values()}
            self._last_left = {p: t for p, t in self._last_left.items() if p in classes}


__all__ = ["MAX_TENANTS", "STATS_TENANTS", "FairQueue", "TenantService", "TenantState", "check_weight"]
