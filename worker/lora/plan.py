"""Adapter sets and the per-ubatch LoRA plan (the eager-PyTorch stand-in for a ggml graph).

An ``AdapterSet`` is what llama.cpp keeps per context (``llama_context::loras``): adapter →
scale, zero scales dropped. A ubatch carries one or more sets (one in compatibility mode,
several in mixed mode) and a per-row index into them.

A ``LoraPlan`` is built once per tuple of active sets and cached by the context: for every
base weight, the branches of all active adapters stacked along the rank dimension (one A and
one B per weight) and each rank column's effective scale in every set (``lora_scale``).
Building it is what "graph rebuilt" means here; reusing it is "graph reused" (llama.cpp
``llm_graph_result::can_reuse``). What changes per ubatch — which row belongs to which set —
is one index vector (``LoraPlan.route``) and never invalidates the plan.

Where scaling happens (decided once, llama.cpp ``build_lora_mm``): after the B·(A·x)
product, ``y += scale · B(A x)`` with ``scale = adapter_scale · alpha / rank`` (alpha ≠ 0)
else ``adapter_scale``. The adapter tensors are never modified.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from worker.lora.adapter import NODES_PER_LORA_WEIGHT, LoraAdapter, LoraPair, lora_scale

# llama.cpp reserves this many graph nodes per patched weight per adapter
# (llama_context::graph_max_nodes: "6 nodes per lora tensor").


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
class FusedLora:
    """Every branch on one base weight, concatenated along the rank dimension.

    With ``R = Σ r`` over the branches (torch shapes):
        linear:      lora_a ``(R, k)``,    lora_b ``(d, R)``
        token_embd:  lora_a ``(V, R)``,    lora_b ``(d, R)``
        experts:     lora_a ``(E, R, k)``, lora_b ``(E, d, R)``
        set_scales:  f32 ``(n_sets, R)``: each rank column's effective scale in each set
                     (``lora_scale`` of its adapter; 0 where the set lacks the adapter).

    Semantics (one matmul pair per weight, whatever the number of adapters; rows whose set
    lacks an adapter get a zero mask on its columns — the segmented product of S-LoRA/punica
    written as a dense mask, cheap because R is small):
        for each row i:  y[i] += B · (S[set(i)] ⊙ (A · x[i]))
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    set_scales: torch.Tensor
    n_branches: int


@dataclass
class LoraPlan:
    """The cached "graph" for a tuple of adapter sets.

    Attributes:
        sets: the active sets, index = per-row set index of a ubatch.
        adapters: union of the sets' adapters (distinct by content).
        fused: base weight name → the concatenated branches on it.
        n_lora_nodes: ``NODES_PER_LORA_WEIGHT`` × number of (adapter, weight) branches, the
            node reservation llama.cpp would make for them.
        row_set: int64 ``(n_rows,)`` set index of each row of the current ubatch (None: one set).
    """

    sets: tuple[AdapterSet, ...]
    adapters: list[LoraAdapter]
    fused: dict[str, FusedLora]
    n_lora_nodes: int
    row_set: torch.Tensor | None = None

    def route(self, row_set: torch.Tensor) -> None:
        """Record the per-row set index of the ubatch (int64 ``(n_rows,)``)."""
        self.row_set = None if len(self.sets) == 1 else row_set

    def row_scales(self, fw: FusedLora, dtype: torch.dtype) -> torch.Tensor:
        """``(n_rows, R)`` per-row column scales, or ``(R,)`` when the ubatch has one set."""
        s = fw.set_scales if fw.set_scales.dtype == dtype else fw.set_scales.to(dtype)
        return s[0] if self.row_set is None else s.index_select(0, self.row_set)


def _fuse(name: str, parts: list[tuple[LoraPair, torch.Tensor]]) -> FusedLora:
    """Concatenate branches on ``name`` along rank (A: dim -1 for token_embd, else -2; B: -1)."""
    scales = torch.cat([sc.unsqueeze(1).expand(-1, p.rank) for p, sc in parts], dim=1)
    if len(parts) == 1:
        a, b = parts[0][0].lora_a, parts[0][0].lora_b
    else:
        a_dim = -1 if name == "token_embd.weight" else -2
        a = torch.cat([p.lora_a for p, _ in parts], dim=a_dim)
        b = torch.cat([p.lora_b for p, _ in parts], dim=-1)
    return FusedLora(a, b, scales.to(a.device).contiguous(), len(parts))


def build_plan(sets: Sequence[AdapterSet]) -> LoraPlan:
    """Build the plan for ``sets`` (llama.cpp: graph build with ``llama_context::loras``).

    Rule: effective scale per (adapter, weight, set) = ``lora_scale(adapter_scale, alpha,
    rank)`` with ``rank = B.ne[0]`` of that weight's pair (llama-adapter.cpp ``get_scale``).
    """
    sets = tuple(sets) or (EMPTY_SET,)
    n_sets = len(sets)
    adapters: list[LoraAdapter] = []
    scale_in_set: list[list[float]] = []
    index: dict[str, int] = {}
    for j, s in enumerate(sets):
        for _, a, sc in s.entries:
            if a.sha256 not in index:
                index[a.sha256] = len(adapters)
                adapters.append(a)
                scale_in_set.append([0.0] * n_sets)
            scale_in_set[index[a.sha256]][j] += sc
    per_weight: dict[str, list[tuple[LoraPair, torch.Tensor]]] = {}
    n_branches = 0
    for ai, a in enumerate(adapters):
        for name, pair in a.pairs.items():
            sc = torch.tensor([lora_scale(scale_in_set[ai][j], a.alpha, pair.rank) for j in range(n_sets)],
                              dtype=torch.float32)
            per_weight.setdefault(name, []).append((pair, sc))
            n_branches += 1
    fused = {name: _fuse(name, parts) for name, parts in per_weight.items()}
    return LoraPlan(sets, adapters, fused, NODES_PER_LORA_WEIGHT * n_branches)
