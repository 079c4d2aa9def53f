"""The LoRA routing of one ubatch over the slot pool (the eager stand-in for a ggml graph input).

The adapters' tensors live in the slot pool (``worker.lora.pool.LoraPool``); nothing is
concatenated per batch composition. What changes per ubatch — which rows use which adapters
at which scale — is a graph *input* (llama.cpp ``llm_graph_input_*``, vLLM
``token_lora_indices`` + per-slot scales): ``LoraPlan.set_slot_scale`` gives each adapter
set's ``adapter_scale`` per slot, and the graph expands it to rows with the int64 ``row_set``
vector. Building it is a few dozen scalar writes.

Where scaling happens (decided once, llama.cpp ``build_lora_mm``): after the B·(A·x)
product, ``y += scale · B(A x)`` with ``scale = adapter_scale · alpha / rank`` (alpha ≠ 0)
else ``adapter_scale`` (``lora_scale``). The per-(slot, weight) factor ``alpha / rank`` sits in
the pool (``WeightSlots.factor``), the per-(set, slot) ``adapter_scale`` here; their product
is the scale. The adapter tensors are never modified.

Side branches (token_embd and 3-D expert weights, see the pool's docstring) are fused from
the resident adapters along rank (``FusedLora``) once per pool *generation*; their columns map
to slots through ``col_slot`` and use the same routing input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.lora.adapter import NODES_PER_LORA_WEIGHT, LoraPair
from worker.lora.adapter_set import EMPTY_SET, AdapterSet
from worker.lora.pool import LoraPool, is_pooled


@dataclass(frozen=True)
class FusedLora:
    """A side weight's branches of every resident adapter, concatenated along rank.

    With ``R = Σ r`` over the branches (torch shapes):
        token_embd:  lora_a ``(V, R)``,    lora_b ``(d, R)``
        experts:     lora_a ``(E, R, k)``, lora_b ``(E, d, R)``
        col_slot:    int64 ``(R,)`` the slot of each rank column
        col_factor:  f32 ``(R,)`` alpha / r of its adapter on this weight (1 when alpha = 0)

    Semantics: for each row i:  y[i] += B · ((S[i, col_slot] · col_factor) ⊙ (A · x[i]))
    with S the ``(n, s_used)`` per-row slot scales of the ubatch.
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    col_slot: torch.Tensor
    col_factor: torch.Tensor


def side_branches(pool: LoraPool) -> dict[str, FusedLora]:
    """Fuse the non-pooled branches of the resident adapters (rebuilt per pool generation),
    in the pool's dtype (host copies may be F16; side pairs are always in memory)."""
    per_weight: dict[str, list[tuple[int, float, LoraPair]]] = {}
    for slot, info in enumerate(pool.slots):
        a = info.adapter
        if a is None:
            continue
        for name, pair in a.pairs.items():
            if is_pooled(name, pair):
                continue
            per_weight.setdefault(name, []).append((slot, a.alpha / pair.rank if a.alpha else 1.0, pair))
    out: dict[str, FusedLora] = {}
    for name, parts in per_weight.items():
        a_dim = -1 if pair_is_embd(name) else -2
        la = torch.cat([p.lora_a.to(pool.dtype) for _, _, p in parts], dim=a_dim)
        lb = torch.cat([p.lora_b.to(pool.dtype) for _, _, p in parts], dim=-1)
        dev = la.device
        col_slot = torch.cat([torch.full((p.rank,), s, dtype=torch.long) for s, _, p in parts]).to(dev)
        col_factor = torch.cat([torch.full((p.rank,), f, dtype=torch.float32) for _, f, p in parts]).to(dev)
        out[name] = FusedLora(la, lb, col_slot, col_factor)
    return out


def pair_is_embd(name: str) -> bool:
    return name == "token_embd.weight"


@dataclass(frozen=True)
class LoraPlan:
    """The LoRA inputs of one ubatch. Built per ubatch (cheap); the pool is shared.

    Attributes:
        sets: the ubatch's adapter sets, index = per-row set index.
        pool: the slot pool the adapters of ``sets`` are resident in.
        s_used: slot prefix the products cover (one past the highest slot any set uses).
        set_slot_scale: f32 ``(n_sets, s_used)``: ``adapter_scale`` of each slot in each set
            (0: the set lacks that slot's adapter).
        side: side weight name → fused branches of the resident adapters.
        n_lora_nodes: ``NODES_PER_LORA_WEIGHT`` × (adapter, weight) branches the sets use.
    """

    sets: tuple[AdapterSet, ...]
    pool: LoraPool
    s_used: int
    set_slot_scale: torch.Tensor
    side: dict[str, FusedLora]
    n_lora_nodes: int

    @property
    def empty(self) -> bool:
        return self.s_used == 0


def build_plan(sets: Sequence[AdapterSet], pool: LoraPool, side: dict[str, FusedLora]) -> LoraPlan:
    """Routing of ``sets`` over ``pool`` (every adapter of the sets must be resident).

    Raises:
        KeyError: an adapter of ``sets`` is not resident (the caller acquires first).
    """
    sets = tuple(sets) or (EMPTY_SET,)
    slot_of: list[list[tuple[int, float]]] = []
    s_used = 0
    n_branches: dict[str, int] = {}
    for s in sets:
        row = []
        for _, a, scale in s.entries:
            slot = pool.slot_of(a.sha256)
            if slot is None:
                raise KeyError(f"adapter '{a.name}' ({a.sha256[:12]}) is not resident in the slot pool")
            row.append((slot, scale))
            s_used = max(s_used, slot + 1)
            n_branches[a.sha256] = len(a.pairs)
        slot_of.append(row)
    m = torch.zeros((len(sets), s_used), dtype=torch.float32)
    for j, row in enumerate(slot_of):
        for slot, scale in row:
            m[j, slot] += scale
    return LoraPlan(sets, pool, s_used, m, side, NODES_PER_LORA_WEIGHT * sum(n_branches.values()))


__all__ = ["FusedLora", "LoraPlan", "build_plan", "side_branches"]
