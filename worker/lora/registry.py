"""The per-model adapter registry (llama.cpp ``llama_model::loras`` + graph node budget).

``by_id`` holds the adapters of the host tier (validated; file-backed in a worker, kept by
``worker.lora.host_cache``); the slot pool (``worker.lora.pool``, the device tier) holds those
a ubatch may use. The node budget counts the adapters resident in slots: what a ubatch can
touch, not every registration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from worker.lora.adapter import LoraAdapter
from worker.lora.adapter_set import AdapterSet
from worker.lora.pool import LoraPool, PoolExhaustedError


class AdapterInUseError(RuntimeError):
    """An adapter cannot be freed while a context's active set still uses it."""


class AdapterUser(Protocol):
    """Anything that holds active adapter sets (a context): freeing checks it first."""

    @property
    def active_sets(self) -> Sequence[AdapterSet]: ...


class ModelAdapters:
    """Adapters registered with one base model (llama.cpp ``llama_model::loras``).

    Adapters are immutable; freeing one that a live context still has in its active sets is
    refused (llama.cpp would leave the context a dangling pointer).

    Args:
        n_base_tensors: tensors of the base model (node budget).
        pool: the model's adapter slot pool (shared by its contexts).
    """

    def __init__(self, n_base_tensors: int, pool: LoraPool):
        self.n_base_tensors = n_base_tensors
        self.pool = pool
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
                    "detach it (set_adapters without it) before freeing"
                )
        if not any(i != adapter_id and a.sha256 == adapter.sha256 for i, a in self.by_id.items()):
            try:
                self.pool.evict(adapter.sha256)
            except PoolExhaustedError as exc:
                raise AdapterInUseError(f"adapter {adapter_id} ('{adapter.name}'): {exc}") from exc
        return self.by_id.pop(adapter_id)

    def node_budget(self) -> int:
        """Worst-case graph nodes: ``max(1024, 8 · n_base_tensors) + Σ 6 · |pairs|`` over the
        adapters resident in slots (llama.cpp ``llama_context::graph_max_nodes`` counts every
        loaded adapter; with a pool only the resident ones can enter a graph)."""
        return max(1024, 8 * self.n_base_tensors) + sum(a.n_nodes for a in self.pool.resident())


__all__ = ["AdapterInUseError", "AdapterUser", "ModelAdapters"]
