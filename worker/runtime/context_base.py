"""What every worker context shares: the ubatch, its result, the adapter sets (llama.cpp
``llama_context``'s ``set_adapters``), the LoRA plan cache and its counters.

``worker.runtime.context.WorkerContext`` (the CPU engine) and
``worker.gpu.context.GpuWorkerContext`` (the GPU engine) derive from
:class:`AdapterContext`; they differ in their KV cache and in how ``decode`` runs the graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplane.formats.adapter_file import AdapterError
from worker.lora.adapter_set import EMPTY_SET, AdapterSet
from worker.lora.plan import LoraPlan, build_plan
from worker.lora.pool import LoraPool, PoolCapacityError, PoolExhaustedError
from worker.lora.registry import ModelAdapters
from worker.runtime.kv_cache import KVStore
from worker.runtime.model import LoadedModel


class DecodeError(ValueError):
    """A ubatch is malformed (names the row / sequence at fault)."""


@dataclass
class UBatch:
    """One ubatch (llama.cpp ``llama_batch``): parallel lists, one entry per token row.

    ``set_index[i]`` selects the row's adapter set among the context's active sets
    (mixed batching); None means set 0 for every row.
    """

    tokens: list[int]
    pos: list[int]
    seq_ids: list[int]
    logits: list[bool]
    set_index: list[int] | None = None

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class DecodeResult:
    """Logits f32 ``(n_out, n_vocab)`` for the rows that asked for them, in row order."""

    logits: torch.Tensor
    out_rows: list[int]
    graph_reused: bool
    n_nodes: int
    n_adapter_sets: int


@dataclass
class ContextStats:
    """``graph_reuses``: decodes in which no slot's content had changed since the previous
    decode; ``graph_rebuilds``: decodes after a page-in or eviction."""

    graph_reuses: int = 0
    graph_rebuilds: int = 0
    decode_calls: int = 0
    tokens_computed: int = 0


class AdapterContext:
    """The adapter sets and the LoRA plan cache of a context over ``model`` (the engines'
    shared part; each sets ``kv`` and implements ``decode``).

    Args:
        model: loaded base model.
        adapters: the model's adapter registry (shared by all contexts of the model).
    """

    kv: KVStore

    def __init__(self, model: LoadedModel, adapters: ModelAdapters):
        self.model = model
        self.adapters = adapters
        self.active_sets: tuple[AdapterSet, ...] = (EMPTY_SET,)
        self.pool: LoraPool = adapters.pool
        self._seen_generation = -1  # pool generation at the previous decode
        self.stats = ContextStats()
        adapters.contexts.append(self)

    def close(self) -> None:
        """Detach from the model (contexts go before models)."""
        if self in self.adapters.contexts:
            self.adapters.contexts.remove(self)
        self._close_kv()

    # --- adapters -------------------------------------------------------------------------
    def set_adapters(self, sets: AdapterSet | Sequence[AdapterSet]) -> bool:
        """Make ``sets`` the active adapter sets; returns True when they changed.

        Unchanged (same adapters by content, same non-zero scales) → no-op. Changed → every
        adapter of ``sets`` is made resident in the slot pool (paging in what is missing,
        evicting least recently used unheld slots) and marked recently used. The context
        holds no slot: the caller keeps them held until ``decode`` when anything else may
        page in between (the scheduler's requests hold theirs from admission); ``decode``
        pages in again what went meanwhile. Only a page-in changes slot content; changing
        sets alone costs nothing.

        Raises:
            DecodeError: an adapter is not registered, or the sets need more slots than can be
                free now (``max_loras``, or every slot held/pinned).
        """
        new = (sets,) if isinstance(sets, AdapterSet) else tuple(sets) or (EMPTY_SET,)
        if new == self.active_sets:
            return False
        for s in new:
            for aid, a, _ in s.entries:
                if self.adapters.by_id.get(aid) is not a:
                    raise DecodeError(
                        f"adapter {aid} ('{a.name}') is not registered with this model "
                        f"(registered: {sorted(self.adapters.by_id)})"
                    )
        self._make_resident(new)
        self.active_sets = new
        return True

    def _make_resident(self, sets: Sequence[AdapterSet]) -> None:
        """Page in every adapter of ``sets`` that is not resident, holding nothing afterwards.

        Raises:
            DecodeError: they cannot all be resident now, or a file cannot be re-read.
        """
        wanted = [a for s in sets for _, a, _ in s.entries]
        try:
            self.pool.acquire(wanted)
        except (PoolCapacityError, PoolExhaustedError) as exc:
            raise DecodeError(f"adapter sets need slots: {exc}") from exc
        except AdapterError as exc:  # a file-backed adapter's tensors could not be re-read
            raise DecodeError(f"paging an adapter in failed: {exc}") from exc
        self.pool.release(wanted)

    @property
    def node_budget(self) -> int:
        """Worst-case graph nodes (``ModelAdapters.node_budget``)."""
        return self.adapters.node_budget()

    def _get_plan(self) -> tuple[LoraPlan, bool]:
        """The ubatch's routing over the pool, and whether no slot changed since the last decode
        ("graph reused")."""
        gen = self.pool.generation
        plan = build_plan(self.active_sets, self.pool)
        reused = gen == self._seen_generation
        self._seen_generation = gen
        if reused:
            self.stats.graph_reuses += 1
        else:
            self.stats.graph_rebuilds += 1
        return plan, reused

    def _close_kv(self) -> None:
        """Drop every sequence of the KV cache (``close``)."""
        raise NotImplementedError

    def graph_counts(self) -> dict[str, int]:
        """The engine's CUDA graph counters (``cuda_graphs_captured``, ``cuda_graph_replays``,
        ``cuda_graph_eager_fallbacks``); none on the CPU engine."""
        return {}

    def decode(self, ub: UBatch) -> DecodeResult:
        """Run one ubatch (llama.cpp ``llama_decode``): each engine's own."""
        raise NotImplementedError


__all__ = ["AdapterContext", "ContextStats", "DecodeError", "DecodeResult", "UBatch"]
