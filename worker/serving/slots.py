"""Slots: parallel sequences (llama-server ``server_slot``).

A ``Slot`` owns one KV sequence (seq_id = slot id) and remembers which adapter set computed
each cached position, so KV computed under one set never serves another.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from worker.lora.adapter_set import AdapterSet
from worker.runtime.sampling import Sampler
from worker.serving.request import GenRequest


class SlotState(Enum):
    """What a slot is doing (llama-server ``slot_state``)."""

    IDLE = "idle"
    PROMPT = "prompt"  # prompt tokens still to compute
    GENERATING = "generating"  # one token per step


@dataclass
class Slot:
    """A parallel sequence: owns KV sequence ``id`` and what is cached in it.

    ``cache_tokens[p]`` is the token whose KV sits at position p and ``cache_sets[p]`` the
    adapter set that computed it.
    """

    id: int
    state: SlotState = SlotState.IDLE
    req: GenRequest | None = None
    sampler: Sampler | None = None
    n_past: int = 0
    cache_tokens: list[int] = field(default_factory=list)
    cache_sets: list[AdapterSet] = field(default_factory=list)
    last_step: int = -1
    last_used: float = 0.0
    last_set: AdapterSet | None = None  # llama-server ``slot.lora``: the previous request's set

    @property
    def busy(self) -> bool:
        """Whether a request runs on this slot."""
        return self.req is not None

    @property
    def request(self) -> GenRequest:
        """The request this slot serves (raises ``RuntimeError`` on an idle slot)."""
        if self.req is None:
            raise RuntimeError(f"slot {self.id} is idle")
        return self.req

    def next_set(self) -> AdapterSet:
        """The adapter set of the rows this slot feeds next."""
        return self.request.set_at(self.n_past)

    def can_batch_with(self, other: Slot) -> bool:
        """llama-server's compatibility rule: the same adapter set for the rows both feed next
        (whole adapter vector equal; every slot serves completions, so the task type, the
        rule's other half, always matches)."""
        return self.next_set() == other.next_set()

    def assign(self, req: GenRequest) -> None:
        """Start serving ``req`` (its prompt first) with a fresh sampler."""
        self.req = req
        self.sampler = Sampler(req.params)
        self.state = SlotState.PROMPT

    def release(self) -> None:
        """Become idle, remembering the finished request's adapter set (``last_set``)."""
        if self.req is not None:
            self.last_set = self.req.adapter_set
        self.req = None
        self.sampler = None
        self.state = SlotState.IDLE
        self.last_used = time.monotonic()

    def drop_cache(self) -> None:
        """Forget what the slot's KV sequence held (the caller clears the KV itself)."""
        self.cache_tokens, self.cache_sets = [], []

    def cached_prefix_for(self, req: GenRequest) -> int:
        """Positions of this slot's cache that ``req`` may reuse: same tokens *and* the same
        adapter set at every position (capped so the last prompt token is recomputed)."""
        n = 0
        limit = min(len(self.cache_tokens), len(req.prompt) - 1)
        while n < limit and self.cache_tokens[n] == req.prompt[n] and self.cache_sets[n] == req.set_at(n):
            n += 1
        return n


__all__ = ["Slot", "SlotState"]
