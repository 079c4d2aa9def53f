"""The LoRA plan for a tuple of adapter sets (the eager-PyTorch stand-in for a ggml graph).

A ``LoraPlan`` is built once per tuple of active sets and cached by the context: for every
base weight, the branches of all active adapters stacked along the rank dimension (one A and
one B per weight) and each rank column's effective scale in every set (``lora_scale``).
Building it is what "graph rebuilt" means here; reusing it is "graph reused" (llama.cpp
``llm_graph_result::can_reuse``). The plan is immutable once built. What changes per ubatch —
which row belongs to which set — is a graph *input*, an int64 index vector passed to
``LoraPlan.row_scales`` (llama.cpp's ``llm_graph_input_*`` tensors, vLLM's
``token_lora_indices``); it never invalidates the plan.

Where scaling happens (decided once, llama.cpp ``build_lora_mm``): after the B·(A·x)
product, ``y += scale · B(A x)`` with ``scale = adapter_scale · alpha / rank`` (alpha ≠ 0)
else ``adapter_scale``. The adapter tensors are never modified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.lora.adapter import NODES_PER_LORA_WEIGHT, LoraAdapter, LoraPair, lora_scale
from worker.lora.adapter_set import EMPTY_SET, AdapterSet


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


@dataclass(frozen=True)
class LoraPlan:
    """The cached "graph" for a tuple of adapter sets. Immutable after ``build_plan``.

    Attributes:
        sets: the active sets, index = per-row set index of a ubatch.
        adapters: union of the sets' adapters (distinct by content).
        fused: base weight name → the concatenated branches on it.
        n_lora_nodes: ``NODES_PER_LORA_WEIGHT`` × number of (adapter, weight) branches, the
            node reservation llama.cpp would make for them.
    """

    sets: tuple[AdapterSet, ...]
    adapters: list[LoraAdapter]
    fused: dict[str, FusedLora]
    n_lora_nodes: int

    def row_scales(self, fw: FusedLora, row_set: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Per-row column scales of ``fw`` for the rows routed by ``row_set``.

        Args:
            fw: a fused weight of this plan.
            row_set: the graph input: int64 ``(n_rows,)`` set index of each row (None, or a
                plan with one set: every row uses set 0).
            dtype: dtype of the result.

        Returns:
            ``(n_rows, R)``, or ``(R,)`` when every row uses set 0 (broadcasts).
        """
        s = fw.set_scales if fw.set_scales.dtype == dtype else fw.set_scales.to(dtype)
        return s[0] if row_set is None or len(self.sets) == 1 else s.index_select(0, row_set)


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
