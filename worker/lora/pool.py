"""The adapter slot pool: ``max_loras`` device slots per patched weight, paged by LRU.

`LoraPool` keeps, per patched 2-D base weight ``W (d, k)``, a `WeightSlots`: A as
``a (S, R, k)``, Bᵀ as ``bt (S, R, d)`` and a per-slot ``factor`` (f32 ``(S,)``: ``alpha / r``,
llama.cpp's scale rule at adapter scale 1; 0 = no branch), ``S`` = ``max_loras``, ``R`` the
rank padded to `RANK_ALIGN`; ``token_embd`` and 3-D expert tensors are per-slot side branches
(`SideBranch`). `LoraPool.acquire` holds a request's adapters (all-or-nothing, else
`PoolExhaustedError`), paging each missing one into a slot by an in-place copy (``_page_in``)
and evicting the least recently used unheld, unpinned slot; pins never take the last free slot.
The graph reads the slots through the routing of `worker.lora.plan`
(``worker.runtime.kernels.lora``, ``worker.runtime.graph.build_lora_mm``).

Layout, allocation, side branches and the paging rules: docs/architecture.md, "Slot pool and
mixed batches" and "Paging rules".
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from loraplane.formats.adapter_file import lora_scale
from worker.lora.adapter import LoraAdapter, LoraPair, is_pooled

RANK_ALIGN = 8  # padded rank granularity of a weight's slot buffers


class PoolExhaustedError(RuntimeError):
    """The adapters cannot all be resident now: every slot is held or pinned (retry later)."""


class PoolCapacityError(ValueError):
    """A request can never fit: more distinct adapters than ``max_loras`` slots."""


@dataclass
class WeightSlots:
    """Slot buffers of one base weight (shapes in the module docstring)."""

    a: torch.Tensor
    bt: torch.Tensor
    factor: torch.Tensor
    rank_of: list[int]  # rank r of each slot's branch on this weight (0: none)

    @property
    def rank_cap(self) -> int:
        """Padded rank ``R`` of the slot buffers (``a.shape[1]``)."""
        return int(self.a.shape[1])


@dataclass(frozen=True)
class SideBranch:
    """One slot's branch on a side weight (torch shapes, the pool's dtype):
    token_embd A ``(V, r)``, B ``(d, r)``; experts A ``(E, r, k)``, B ``(E, d, r)``;
    ``factor`` = ``lora_scale(1.0, alpha, r)`` (alpha / r; 1 when alpha = 0)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    factor: float


@dataclass
class SlotInfo:
    """What one slot holds: the adapter (None: empty), holds, pin, LRU tick."""

    adapter: LoraAdapter | None = None
    holds: int = 0
    pinned: bool = False
    last_used: int = 0


@dataclass
class PoolStats:
    """Counters of one pool (monotonic) — reported in ``WorkerStats``."""

    page_ins: int = 0
    evictions: int = 0
    page_in_bytes: int = 0
    rank_growths: int = 0
    # per adapter content (sha256): page-ins into a slot and LRU evictions out of one
    page_ins_by_sha: dict[str, int] = field(default_factory=dict)
    evictions_by_sha: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class AcquireResult:
    """Per adapter (by sha256) of an ``acquire``: its slot and whether it was paged in now."""

    slots: dict[str, int]
    paged_in: tuple[str, ...]


class LoraPool:
    """``max_loras`` adapter slots over every patched weight, with LRU paging and pinning.

    One owner thread (the worker's scheduler loop, or a test) changes it; other threads may
    only read ``resident_shas()`` (a locked snapshot, for stats and heartbeats).

    Args:
        max_loras: slot count ``S`` (vLLM ``max_loras``).
        max_lora_rank: largest rank a slot can take (adapters above it are refused at load).
        device_for: device of the base weight a branch patches.
        dtype: dtype of the slot buffers (the model's dtype).
    """

    def __init__(
        self,
        max_loras: int,
        max_lora_rank: int,
        *,
        dtype: torch.dtype = torch.float32,
        device_for=lambda name: torch.device("cpu"),
    ):
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_lora_rank}")
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.device_for = device_for
        self.slots = [SlotInfo() for _ in range(max_loras)]
        self.weights: dict[str, WeightSlots] = {}
        self.side: list[dict[str, SideBranch]] = [{} for _ in range(max_loras)]  # per slot
        self.by_sha: dict[str, int] = {}
        self.generation = 0  # bumped whenever any slot's content changes
        self.stats = PoolStats()
        self._tick = 0
        self._pinned_sha: set[str] = set()
        self._by_sha_lock = threading.Lock()  # guards by_sha against readers on other threads

    # --- queries --------------------------------------------------------------------------
    def slot_of(self, sha256: str) -> int | None:
        """Slot index holding content ``sha256``, None when not resident (owner thread)."""
        return self.by_sha.get(sha256)

    def resident_shas(self) -> set[str]:
        """Content hashes of the resident adapters (safe from any thread)."""
        with self._by_sha_lock:
            return set(self.by_sha)

    def resident(self) -> list[LoraAdapter]:
        """Adapters in slots, by slot index."""
        return [s.adapter for s in self.slots if s.adapter is not None]

    def pinned_shas(self) -> set[str]:
        """Content hashes of the resident adapters whose slot is pinned (safe from any thread:
        a snapshot of the slot list)."""
        return {s.adapter.sha256 for s in list(self.slots) if s.adapter is not None and s.pinned}

    def held(self, sha256: str) -> int:
        """Slot holds on content ``sha256`` (0 when not resident)."""
        s = self.by_sha.get(sha256)
        return 0 if s is None else self.slots[s].holds

    def buffer_bytes(self) -> int:
        """Bytes of every slot buffer allocated so far."""
        return sum(w.a.numel() * w.a.element_size() + w.bt.numel() * w.bt.element_size() for w in self.weights.values())

    # --- pinning --------------------------------------------------------------------------
    def set_pinned(self, sha256: str, pinned: bool) -> None:
        """Mark content ``sha256`` pinned (never evicted once resident) or not."""
        if pinned:
            self._pinned_sha.add(sha256)
        else:
            self._pinned_sha.discard(sha256)
        s = self.by_sha.get(sha256)
        if s is not None:
            self.slots[s].pinned = pinned and self._may_pin(s)

    def _may_pin(self, slot: int) -> bool:
        """Pins may take at most ``S - 1`` slots."""
        others = sum(1 for i, s in enumerate(self.slots) if s.pinned and i != slot)
        return others < self.max_loras - 1

    # --- acquire / release ----------------------------------------------------------------
    def find_slots(self, adapters: Sequence[LoraAdapter]) -> list[int] | None:
        """Slots that ``acquire(adapters)`` would page into (victims included), or None when
        they cannot all be resident now. Changes nothing."""
        distinct = {a.sha256: a for a in adapters}
        if len(distinct) > self.max_loras:
            raise PoolCapacityError(f"{len(distinct)} distinct adapters exceed max_loras {self.max_loras}")
        missing = [sha for sha in distinct if sha not in self.by_sha]
        if not missing:
            return []
        keep = {self.by_sha[sha] for sha in distinct if sha in self.by_sha}
        free = [i for i, s in enumerate(self.slots) if s.adapter is None]
        victims = sorted(
            (s.last_used, i)
            for i, s in enumerate(self.slots)
            if s.adapter is not None and s.holds == 0 and not s.pinned and i not in keep
        )
        order = free + [i for _, i in victims]
        return order[: len(missing)] if len(order) >= len(missing) else None

    def acquire(
        self, adapters: Sequence[LoraAdapter], staged: Mapping[str, Mapping[str, LoraPair]] | None = None
    ) -> AcquireResult:
        """Make every adapter resident (paging in what is missing) and hold it.

        Free slots are used lowest index first (keeps the used prefix short), then the least
        recently used unheld, unpinned slot is evicted. ``staged`` (sha256 → pooled pairs with
        data, from ``stage``) spares a file-backed adapter's re-read on this thread.

        Raises:
            PoolCapacityError: more distinct adapters than ``max_loras`` (can never fit).
            PoolExhaustedError: not all can be resident now (nothing changed; retry later).
            AdapterError: a file-backed adapter's tensors cannot be re-read (the adapters
                paged in before it stay resident, unheld; nothing is held).
        """
        distinct = {a.sha256: a for a in adapters}
        targets = self.find_slots(list(distinct.values()))
        if targets is None:
            raise PoolExhaustedError(
                f"{len(distinct)} adapters need slots but every one of the {self.max_loras} slots is held or pinned"
            )
        paged: list[str] = []
        it = iter(targets)
        for sha, a in distinct.items():
            if sha not in self.by_sha:
                self._page_in(a, next(it), (staged or {}).get(sha))
                paged.append(sha)
        self._tick += 1
        slots = {}
        for sha in distinct:
            s = self.by_sha[sha]
            self.slots[s].holds += 1
            self.slots[s].last_used = self._tick
            slots[sha] = s
        return AcquireResult(slots, tuple(paged))

    def release(self, adapters: Sequence[LoraAdapter]) -> None:
        """Drop one hold of each distinct adapter (acquired before)."""
        for sha in {a.sha256 for a in adapters}:
            s = self.by_sha.get(sha)
            if s is not None and self.slots[s].holds > 0:
                self.slots[s].holds -= 1

    def evict(self, sha256: str) -> bool:
        """Empty the slot holding ``sha256`` (unregister). False when not resident.

        Raises:
            PoolExhaustedError: it is held by a request (drain first).
        """
        s = self.by_sha.get(sha256)
        if s is None:
            return False
        if self.slots[s].holds:
            raise PoolExhaustedError(f"adapter {sha256[:12]} is held by {self.slots[s].holds} request(s)")
        self._clear(s)
        self._pinned_sha.discard(sha256)
        return True

    # --- paging ---------------------------------------------------------------------------
    def _clear(self, slot: int) -> None:
        info = self.slots[slot]
        if info.adapter is None:
            return
        with self._by_sha_lock:
            del self.by_sha[info.adapter.sha256]
        for w in self.weights.values():
            if w.rank_of[slot]:
                w.factor[slot] = 0.0
                w.rank_of[slot] = 0
        self.side[slot] = {}
        self.slots[slot] = SlotInfo()
        self.generation += 1

    @staticmethod
    def stage(adapter: LoraAdapter) -> Mapping[str, LoraPair]:
        """The pooled pairs of ``adapter`` with data, read now (any thread): what ``acquire``
        copies into a slot. For a file-backed adapter this is the file read, done ahead of
        admission so that the decode loop only copies (prefetch for queued requests).

        Raises:
            AdapterError: the file cannot be re-read.
        """
        return adapter.tensors([n for n, p in adapter.pairs.items() if is_pooled(n, p)])

    def _page_in(self, adapter: LoraAdapter, slot: int, staged: Mapping[str, LoraPair] | None = None) -> None:
        """Copy ``adapter`` into ``slot`` in place (evicting its occupant).

        Raises:
            ValueError: a rank above ``max_lora_rank`` (checked before anything changes;
                the worker refuses such adapters at load, so this is an internal guard).
            AdapterError: a file-backed adapter's tensors cannot be re-read (checked before
                the occupant is evicted).
        """
        too_big = [f"{n}: rank {p.rank}" for n, p in adapter.pairs.items() if p.rank > self.max_lora_rank]
        if too_big:
            raise ValueError(
                f"adapter '{adapter.name}' exceeds --max-lora-rank {self.max_lora_rank}: {', '.join(too_big)}"
            )
        data = staged if staged is not None else self.stage(adapter)
        occupant = self.slots[slot].adapter
        if occupant is not None:
            self.stats.evictions += 1
            by_sha = self.stats.evictions_by_sha
            by_sha[occupant.sha256] = by_sha.get(occupant.sha256, 0) + 1
            self._clear(slot)
        nbytes = 0
        for name, pair in data.items():
            r = pair.rank
            w = self._weight(name, pair)
            w.a[slot, :r].copy_(pair.lora_a)
            w.bt[slot, :r].copy_(pair.lora_b.T)
            if r < w.rank_cap:
                w.a[slot, r:].zero_()
                w.bt[slot, r:].zero_()
            w.factor[slot] = lora_scale(1.0, adapter.alpha, r)
            w.rank_of[slot] = r
            nbytes += (pair.lora_a.numel() + pair.lora_b.numel()) * w.a.element_size()
        for name, pair in adapter.pairs.items():
            if is_pooled(name, pair):
                continue
            dev = self.device_for(name)
            a, b = (t.to(dtype=self.dtype, device=dev) for t in (pair.lora_a, pair.lora_b))
            self.side[slot][name] = SideBranch(a, b, lora_scale(1.0, adapter.alpha, pair.rank))
            nbytes += (a.numel() + b.numel()) * a.element_size()
        self.slots[slot] = SlotInfo(adapter=adapter, pinned=False)
        with self._by_sha_lock:
            self.by_sha[adapter.sha256] = slot
        if adapter.sha256 in self._pinned_sha:
            self.slots[slot].pinned = self._may_pin(slot)
        self.stats.page_ins += 1
        self.stats.page_ins_by_sha[adapter.sha256] = self.stats.page_ins_by_sha.get(adapter.sha256, 0) + 1
        self.stats.page_in_bytes += nbytes
        self.generation += 1

    def _weight(self, name: str, pair: LoraPair) -> WeightSlots:
        """The slot buffers of ``name``, allocated or grown to hold rank ``pair.rank``."""
        need = -(-pair.rank // RANK_ALIGN) * RANK_ALIGN
        need = min(max(need, RANK_ALIGN), max(self.max_lora_rank, pair.rank))
        w = self.weights.get(name)
        if w is not None and w.rank_cap >= pair.rank:
            return w
        k, d = int(pair.lora_a.shape[1]), int(pair.lora_b.shape[0])
        dev = self.device_for(name)
        a = torch.zeros((self.max_loras, need, k), dtype=self.dtype, device=dev)
        bt = torch.zeros((self.max_loras, need, d), dtype=self.dtype, device=dev)
        if w is None:
            w = WeightSlots(a, bt, torch.zeros(self.max_loras, dtype=torch.float32, device=dev), [0] * self.max_loras)
        else:
            old = w.rank_cap
            a[:, :old].copy_(w.a)
            bt[:, :old].copy_(w.bt)
            w.a, w.bt = a, bt
            self.stats.rank_growths += 1
        self.weights[name] = w
        return w


__all__ = [
    "AcquireResult",
    "LoraPool",
    "PoolCapacityError",
    "PoolExhaustedError",
    "PoolStats",
    "RANK_ALIGN",
    "SideBranch",
    "SlotInfo",
    "WeightSlots",
    "is_pooled",
]
