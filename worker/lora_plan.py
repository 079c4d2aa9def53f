"""Adapter sets and the per-ubatch LoRA plan (the eager-PyTorch stand-in for a ggml graph).

An ``AdapterSet`` is what llama.cpp keeps per context (``llama_context::loras``): adapter →
scale, zero scales dropped. A ubatch carries one or more sets (one in compatibility mode,
several in mixed mode) and a per-row index into them.

A ``LoraPlan`` is built once per tuple of active sets and cached by the context: for every
base weight, which low-rank branches run and each branch's effective scale for every set
(``lora_scale``). Building it is what "graph rebuilt" means here; reusing it is "graph
reused" (llama.cpp ``llm_graph_result::can_reuse``). What changes per ubatch — which rows
use which adapter — is routed cheaply by ``LoraPlan.route`` and never invalidates the plan.

Where scaling happens (decided once, llama.cpp ``build_lora_mm``): after the B·(A·x)
product, ``y += scale · B(A x)`` with ``scale = adapter_scale · alpha / rank`` (alpha ≠ 0)
else ``adapter_scale``. The adapter tensors are never modified.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from worker.adapters import LoraAdapter, LoraPair, lora_scale

# llama.cpp reserves this many graph nodes per patched weight per adapter
# (llama_context::graph_max_nodes: "6 nodes per lora tensor").
NODES_PER_LORA_WEIGHT = 6


@dataclass(frozen=True)
class AdapterSet:
    """An immutable adapter → scale mapping, zero scales dropped, ordered by adapter id.

    Attributes:
        entries: ((adapter_id, adapter, scale), ...) sorted by id; scales are non-zero.
    """

    entries: tuple[tuple[int, LoraAdapter, float], ...] = ()

    @classmethod
    def of(cls, items: Mapping[int, tuple[LoraAdapter, float]] | Sequence[tuple[int, LoraAdapter, float]]) -> "AdapterSet":
        rows = items.items() if isinstance(items, Mapping) else [(i, (a, s)) for i, a, s in items]
        kept = sorted((int(i), a, float(s)) for i, (a, s) in rows if float(s) != 0.0)
        return cls(tuple(kept))

    @property
    def key(self) -> tuple[tuple[str, float], ...]:
        """Identity used for equality of sets: adapter content hash + scale (llama.cpp
        ``adapters_lora_are_same`` compares pointers and scales; content hashes are stronger)."""
        return tuple((a.sha256, s) for _, a, s in self.entries)

    @property
    def fingerprint(self) -> str:
        """Short hex digest of ``key``: adapter *content* and scales, never names or ids."""
        if not self.entries:
            return "base"
        h = hashlib.sha256(repr(self.key).encode()).hexdigest()
        return h[:16]

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(i for i, _, _ in self.entries)

    def is_empty(self) -> bool:
        return not self.entries

    def all_alora(self) -> bool:
        """True when every adapter in the set is an activated LoRA (empty set: False)."""
        return bool(self.entries) and all(a.alora_invocation_tokens for _, a, _ in self.entries)

    def without(self, adapter_ids: Sequence[int]) -> "AdapterSet":
        drop = set(adapter_ids)
        return AdapterSet(tuple(e for e in self.entries if e[0] not in drop))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AdapterSet) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


EMPTY_SET = AdapterSet()


@dataclass(frozen=True)
class LoraBranch:
    """One low-rank branch on one base weight.

    Attributes:
        adapter_index: index of the adapter in ``LoraPlan.adapters``.
        pair: the adapter's A/B tensors for this weight (torch shapes per ``worker.adapters``).
        set_scales: f32 ``(n_sets,)`` effective scale per adapter set (0 where absent).
    """

    adapter_index: int
    pair: LoraPair
    set_scales: torch.Tensor


@dataclass
class LoraRoute:
    """Per-ubatch routing of one adapter: which rows use it and with what scale per branch.

    ``rows`` is None when every row of the ubatch uses the adapter (no gather needed).
    """

    rows: torch.Tensor | None
    row_set: torch.Tensor | None  # set index of each selected row (None: single set)


@dataclass
class LoraPlan:
    """The cached "graph" for a tuple of adapter sets.

    Attributes:
        sets: the active sets, index = per-row set index of a ubatch.
        adapters: union of the sets' adapters (distinct by content).
        branches: base weight name → branches to add to it.
        n_lora_nodes: ``NODES_PER_LORA_WEIGHT`` × number of branches.
    """

    sets: tuple[AdapterSet, ...]
    adapters: list[LoraAdapter]
    adapter_set_scales: list[torch.Tensor]  # per adapter: f32 (n_sets,) adapter_scale per set
    branches: dict[str, list[LoraBranch]]
    n_lora_nodes: int
    routes: list[LoraRoute] = field(default_factory=list)

    def route(self, row_set: torch.Tensor) -> None:
        """Compute which rows use which adapter for one ubatch.

        Args:
            row_set: int64 ``(n_rows,)`` set index of each row, on the compute device.
        """
        self.routes = []
        single = len(self.sets) == 1
        for scales in self.adapter_set_scales:
            if single:
                self.routes.append(LoraRoute(None, None))
                continue
            used = scales.to(row_set.device)[row_set] != 0
            if bool(used.all()):
                self.routes.append(LoraRoute(None, row_set))
            else:
                rows = torch.nonzero(used, as_tuple=False).flatten()
                self.routes.append(LoraRoute(rows, row_set.index_select(0, rows)))

    def row_scales(self, br: LoraBranch, route: LoraRoute, x: torch.Tensor) -> torch.Tensor | float:
        """Scale for the routed rows: a float (one set) or ``(n_sel, 1)`` tensor (mixed)."""
        if route.row_set is None:
            return float(br.set_scales[0])
        s = br.set_scales.to(device=x.device, dtype=x.dtype).index_select(0, route.row_set)
        return s.unsqueeze(-1)


def build_plan(sets: Sequence[AdapterSet]) -> LoraPlan:
    """Build the plan for ``sets`` (llama.cpp: graph build with ``llama_context::loras``).

    Rule: effective scale per (adapter, weight, set) = ``lora_scale(adapter_scale, alpha,
    rank)`` with ``rank = B.ne[0]`` of that weight's pair (llama-adapter.cpp ``get_scale``).
    """
    sets = tuple(sets) or (EMPTY_SET,)
    n_sets = len(sets)
    adapters: list[LoraAdapter] = []
    index: dict[str, int] = {}
    for s in sets:
        for _, a, _ in s.entries:
            if a.sha256 not in index:
                index[a.sha256] = len(adapters)
                adapters.append(a)
    adapter_set_scales = []
    for a in adapters:
        col = [0.0] * n_sets
        for j, s in enumerate(sets):
            for _, a2, sc in s.entries:
                if a2.sha256 == a.sha256:
                    col[j] += sc
        adapter_set_scales.append(torch.tensor(col, dtype=torch.float32))
    branches: dict[str, list[LoraBranch]] = {}
    n_branches = 0
    for ai, a in enumerate(adapters):
        for name, pair in a.pairs.items():
            scales = torch.tensor(
                [lora_scale(float(adapter_set_scales[ai][j]), a.alpha, pair.rank) for j in range(n_sets)],
                dtype=torch.float32,
            )
            branches.setdefault(name, []).append(LoraBranch(ai, pair, scales))
            n_branches += 1
    return LoraPlan(sets, adapters, adapter_set_scales, branches, NODES_PER_LORA_WEIGHT * n_branches)
