"""Per-tenant queue shares: which tenant gives way when a full worker gets a request of a
lighter one.

A worker takes ``--slots + --queue-limit`` requests at once. With fair admission
(``--fairness vtc``, `worker.serving.fairness`) a full worker still takes a request of
tenant T when another tenant H *gives way* to it: H's newest queued request is then evicted
(RESOURCE_EXHAUSTED, HTTP 429 with ``Retry-After``, as a full queue answers) and T's request
takes its place. The control plane applies the same rule to its own count of what it relayed
to each worker that shares its queue before it answers "every live worker is full"
(`WorkerPool.has_room`), so a light tenant's request reaches the worker's queue instead of
being turned away in front of it.

A tenant's **load** on a worker is its requests there (queued and running) divided by its
weight. H gives way to a new request of T (`gives_way`) when H has a request queued (running
requests are never preempted; the caller checks) and

- H's priority class is worse than T's (a higher value): strict, as classes are served; or
- same class, and H's load is above T's load counting the new request:
  ``n_H / w_H > (n_T + 1) / w_T``.

Among the tenants that give way, the one of the worst class, then of the highest load, loses its
newest queued request (`ordering`). The second condition keeps a swap from ever making the split
less even, so two tenants never evict each other back and forth: after the swap H's load is
still at least T's, and H's next request finds T not giving way. Equal weights thus split a full
worker evenly (a heavy tenant keeps ``n_H ≤ n_T + 1``), and weights 4 and 1 split it 4 to 1.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Share:
    """One tenant's share of a worker.

    Attributes:
        requests: its requests there (queued and running; for a newcomer, before the new one).
        weight: its fair share (> 0).
        priority: its class (lower is served first).
        name: the tenant.
    """

    requests: int
    weight: float
    priority: int
    name: str = ""

    @property
    def load(self) -> float:
        """Requests per unit of weight."""
        return self.requests / self.weight


def gives_way(holder: Share, newcomer: Share) -> bool:
    """Whether ``holder`` gives one of its queued requests' places to one more request of
    ``newcomer`` (module docstring; the caller checks that ``holder`` has one queued)."""
    if holder.priority != newcomer.priority:
        return holder.priority > newcomer.priority
    return holder.load > (newcomer.requests + 1) / newcomer.weight


def ordering(holder: Share) -> tuple[int, float]:
    """Sort key among the holders that give way: the largest one loses a request (the worst
    class, then the highest load)."""
    return (holder.priority, holder.load)
