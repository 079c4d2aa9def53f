"""Per-tenant queue shares: which tenant gives way when a full worker gets a request of a
lighter one.

`gives_way` says whether tenant H (a `Share`: requests on the worker, weight, priority) gives
its newest queued place to a new request of tenant T: H's class is worse, or, in the same class,
``n_H / w_H > (n_T + 1) / w_T``; `ordering` ranks the tenants that give way (worst class, then
highest load, loses). The worker's fair queue (``worker.serving.fairness``, ``--fairness vtc``)
and the control plane's capacity check (``WorkerPool.has_room``) apply the same rule, so fair
admission holds end to end.

The rule, why a swap never flips back, the splits it gives: docs/fairness.md, "Queue shares:
the queue limit per tenant".
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
