"""Adapter sets: what llama.cpp keeps per context (``llama_context::loras``).

An ``AdapterSet`` is a request's `AdapterScales` (ids and scales, from the wire) resolved over
the adapters this worker holds: each id with its loaded ``LoraAdapter``. A ubatch carries one or more
sets (one in compatibility mode, several in mixed mode) and a per-row index into them. Set
identity is adapter *content* (sha256) plus scale, so the prefix cache can key KV by it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loraplane.adapter_scales import AdapterScales
from worker.lora.adapter import LoraAdapter


@dataclass(frozen=True)
class AdapterSet:
    """An immutable adapter → scale mapping, zero scales dropped, ordered by adapter id.

    Attributes:
        entries: ((adapter_id, adapter, scale), ...) sorted by id; scales are non-zero.
    """

    entries: tuple[tuple[int, LoraAdapter, float], ...] = ()

    @classmethod
    def of(
        cls, items: Mapping[int, tuple[LoraAdapter, float]] | Sequence[tuple[int, LoraAdapter, float]]
    ) -> AdapterSet:
        rows = items.items() if isinstance(items, Mapping) else [(i, (a, s)) for i, a, s in items]
        kept = sorted((int(i), a, float(s)) for i, (a, s) in rows if float(s) != 0.0)
        return cls(tuple(kept))

    @classmethod
    def of_scales(cls, scales: AdapterScales, adapters: Mapping[int, LoraAdapter]) -> AdapterSet:
        """``scales`` with each id's loaded adapter from ``adapters`` (the worker's host tier).

        Raises:
            KeyError: an id of ``scales`` has no adapter in ``adapters`` (the caller loads
                every one first: ``WorkerEngine._to_host``).
        """
        return cls(tuple((i, adapters[i], s) for i, s in scales))

    @property
    def scales(self) -> AdapterScales:
        """The ids and scales alone (request telemetry reports them)."""
        return AdapterScales((i, s) for i, _, s in self.entries)

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

    def without(self, adapter_ids: Sequence[int]) -> AdapterSet:
        drop = set(adapter_ids)
        return AdapterSet(tuple(e for e in self.entries if e[0] not in drop))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AdapterSet) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


EMPTY_SET = AdapterSet()


__all__ = ["AdapterSet", "EMPTY_SET"]
