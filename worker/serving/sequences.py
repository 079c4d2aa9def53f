"""Sequences: the parallel KV sequences a worker decodes (llama-server's ``server_slot``; the
``--slots`` flag sets how many).

A ``Seq`` owns one KV sequence (llama.cpp ``seq_id`` = ``Seq.id``) and remembers which adapter
set computed each cached position, so KV computed under one set never serves another. "Slot"
alone means an adapter slot of the pool (``worker.lora.pool``) everywhere in the worker.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

from worker.lora.adapter_set import AdapterSet
from worker.runtime.sampling import Sampler
from worker.serving.request import GenRequest

T = TypeVar("T")


def common_prefix_len(a: Sequence[T], b: Sequence[T], limit: int | None = None) -> int:
    """How many leading items ``a`` and ``b`` share (``==``), at most ``limit`` (None: no cap).

    The one longest-common-prefix rule of the worker: a sequence's reusable cache, the
    llama-server slot choice (``LlamaCachePolicy.pick_seq``) and the keyed prefix cache's
    lookup (``worker.serving.prefix_store``) all count with it.
    """
    n = min(len(a), len(b)) if limit is None else max(0, min(len(a), len(b), limit))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SeqState(Enum):
    """What a sequence is doing (llama-server ``slot_state``)."""

    IDLE = "idle"
    PROMPT = "prompt"  # prompt tokens still to compute
    GENERATING = "generating"  # one token per step


@dataclass
class Seq:
    """A parallel sequence: owns KV sequence ``id`` and what is cached in it.

    ``cache_tokens[p]`` is the token whose KV sits at position p and ``cache_sets[p]`` the
    adapter set that computed it.
    """

    id: int
    state: SeqState = SeqState.IDLE
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
        """Whether a request runs on this sequence."""
        return self.req is not None

    @property
    def request(self) -> GenRequest:
        """The request this sequence serves (raises ``RuntimeError`` when idle)."""
        if self.req is None:
            raise RuntimeError(f"sequence {self.id} is idle")
        return self.req

    def next_set(self) -> AdapterSet:
        """The adapter set of the rows this sequence feeds next."""
        return self.request.set_at(self.n_past)

    def can_batch_with(self, other: Seq) -> bool:
        """llama-server's compatibility rule: the same adapter set for the rows both feed next
        (same adapters at the same scales; every sequence serves completions, so the task type, the
        rule's other half, always matches)."""
        return self.next_set() == other.next_set()

    def assign(self, req: GenRequest) -> None:
        """Start serving ``req`` (its prompt first) with a fresh sampler."""
        self.req = req
        self.sampler = Sampler(req.params)
        self.state = SeqState.PROMPT

    def release(self) -> None:
        """Become idle, remembering the finished request's adapter set (``last_set``)."""
        if self.req is not None:
            self.last_set = self.req.adapter_set
        self.req = None
        self.sampler = None
        self.state = SeqState.IDLE
        self.last_used = time.monotonic()

    def drop_cache(self) -> None:
        """Forget what the KV sequence held (the caller clears the KV itself)."""
        self.cache_tokens, self.cache_sets = [], []

    def cached_prefix_for(self, req: GenRequest) -> int:
        """Positions of this sequence's cache that ``req`` may reuse: same tokens *and* the same
        adapter set at every position (capped so the last prompt token is recomputed)."""
        n = common_prefix_len(self.cache_tokens, req.prompt, len(req.prompt) - 1)
        return common_prefix_len(self.cache_sets, [req.set_at(p) for p in range(n)])


__all__ = ["Seq", "SeqState", "common_prefix_len"]
