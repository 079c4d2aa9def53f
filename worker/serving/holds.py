"""Request holds per adapter id: an adapter a queued or running request uses (or one being
brought to host for a request about to be submitted) is never freed or evicted from the host
tier while held (docs/architecture.md, "Paging rules").

`RequestHolds` counts them under the scheduler's condition variable, so a deferred function
waiting for an adapter to be unheld (``Scheduler.run_when_idle_of``) is woken when the last hold
goes; `RequestHolds.release` also gives back the request's adapter-slot holds in the pool.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

from worker.lora.pool import LoraPool
from worker.serving.request import GenRequest


class RequestHolds:
    """Adapter id → number of request holds, guarded by ``cv`` (the scheduler's condition).

    ``add``/``drop``/``count`` expect ``cv`` held by the caller; ``holding``, ``is_held`` and
    ``release`` take it themselves and are safe from any thread.
    """

    def __init__(self, cv: threading.Condition, pool: LoraPool) -> None:
        self._cv = cv
        self._pool = pool
        self._n: dict[int, int] = {}

    def add(self, adapter_ids: Iterable[int]) -> None:
        """One more hold on each id (``cv`` held)."""
        self._change(adapter_ids, +1)

    def drop(self, adapter_ids: Iterable[int]) -> None:
        """One hold less on each id (``cv`` held); an id at 0 is forgotten."""
        self._change(adapter_ids, -1)

    def count(self, adapter_id: int) -> int:
        """The holds on ``adapter_id`` (``cv`` held)."""
        return self._n.get(adapter_id, 0)

    def _change(self, adapter_ids: Iterable[int], delta: int) -> None:
        for aid in adapter_ids:
            n = self._n.get(aid, 0) + delta
            if n > 0:
                self._n[aid] = n
            else:
                self._n.pop(aid, None)

    @contextlib.contextmanager
    def holding(self, adapter_ids: Iterable[int]) -> Iterator[None]:
        """One hold on each id for the duration of a ``with`` block, for a request not submitted
        yet (its adapters are being brought to host): the host tier keeps them and an unload
        waits. ``Scheduler.submit`` takes the request's own holds, so a submit inside the block
        leaves no gap."""
        ids = tuple(adapter_ids)
        with self._cv:
            self.add(ids)
        try:
            yield
        finally:
            with self._cv:
                self.drop(ids)
                self._cv.notify_all()

    def is_held(self, adapter_id: int) -> bool:
        """Whether any request (submitted, or being submitted) holds ``adapter_id``."""
        with self._cv:
            return self.count(adapter_id) > 0

    def release(self, req: GenRequest) -> None:
        """Drop the request's adapter-slot holds (pool) and its request holds."""
        if req.pool_held:
            self._pool.release(req.pool_held)
            req.pool_held = []
        with self._cv:
            self.drop(req.held_ids)
            req.held_ids = ()
            self._cv.notify_all()


__all__ = ["RequestHolds"]
