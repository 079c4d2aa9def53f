"""The per-model adapter registry (llama.cpp ``llama_model::loras`` + graph node budget)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from worker.lora.adapter import LoraAdapter
from worker.lora.adapter_set import AdapterSet


class AdapterInUseError(RuntimeError):
    """An adapter cannot be freed while a context's active set still uses it."""


class AdapterUser(Protocol):
    """Anything that holds active adapter sets (a context): freeing checks it first."""

    active_sets: Sequence[AdapterSet]


class ModelAdapters:
    """Adapters registered with one base model (llama.cpp ``llama_model::loras``).

    Adapters are immutable; freeing one that a live context still has in its active sets is
    refused (llama.cpp would leave the context a dangling pointer).
    """

    def __init__(self, n_base_tensors: int):
        self.n_base_tensors = n_base_tensors
        self.by_id: dict[int, LoraAdapter] = {}
        self.contexts: list[AdapterUser] = []

    def add(self, adapter_id: int, adapter: LoraAdapter) -> None:
        self.by_id[adapter_id] = adapter

    def free(self, adapter_id: int) -> LoraAdapter:
        """Unregister ``adapter_id``.

        Raises:
            KeyError: not registered.
            AdapterInUseError: a context's active set still uses it (detach it first).
        """
        adapter = self.by_id[adapter_id]
        for ctx in self.contexts:
            if any(adapter_id in s.ids for s in ctx.active_sets):
                raise AdapterInUseError(
                    f"adapter {adapter_id} ('{adapter.name}') is in a context's active adapter set; "
                    "detach it (set_adapters without it) before freeing")
        return self.by_id.pop(adapter_id)

    def node_budget(self) -> int:
        """Worst-case graph nodes: ``max(1024, 8 · n_base_tensors) + Σ 6 · |pairs|`` over
        registered adapters (llama.cpp ``llama_context::graph_max_nodes``)."""
        return max(1024, 8 * self.n_base_tensors) + sum(a.n_nodes for a in self.by_id.values())


__all__ = ["AdapterInUseError", "AdapterUser", "ModelAdapters"]
