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

Side branches (token_embd and 3-D expert weights, see the pool's docstring) sit per slot in
the pool (``LoraPool.side``) and use the same routing input: the graph applies the side branch
of each slot the ubatch uses (``LoraPlan.side_slots``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplane.formats.adapter_file import NODES_PER_LORA_WEIGHT
from worker.lora.adapter_set import EMPTY_SET, AdapterSet
from worker.lora.pool import LoraPool


@dataclass(frozen=True)
class LoraPlan:
    """The LoRA inputs of one ubatch. Built per ubatch (cheap); the pool is shared.

    Attributes:
        sets: the ubatch's adapter sets, index = per-row set index.
        pool: the slot pool the adapters of ``sets`` are resident in.
        s_used: slot prefix the products cover (one past the highest slot any set uses).
        set_slot_scale: f32 ``(n_sets, s_used)``: ``adapter_scale`` of each slot in each set
            (0: the set lacks that slot's adapter).
        side_slots: slots some set uses that hold side branches (token_embd, experts).
        n_lora_nodes: ``NODES_PER_LORA_WEIGHT`` × (adapter, weight) branches the sets use.
    """

    sets: tuple[AdapterSet, ...]
    pool: LoraPool
    s_used: int
    set_slot_scale: torch.Tensor
    side_slots: tuple[int, ...]
    n_lora_nodes: int

    @property
    def empty(self) -> bool:
        return self.s_used == 0


def build_plan(sets: Sequence[AdapterSet], pool: LoraPool) -> LoraPlan:
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
    used = sorted({slot for row in slot_of for slot, _ in row})
    side_slots = tuple(s for s in used if pool.side[s])
    return LoraPlan(sets, pool, s_used, m, side_slots, NODES_PER_LORA_WEIGHT * sum(n_branches.values()))


__all__ = ["LoraPlan", "build_plan"]
