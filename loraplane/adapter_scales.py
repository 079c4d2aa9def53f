"""Which adapters at which scales: the one value type for a request's resolved adapters.

The control plane resolves a request's adapter map into an `AdapterScales` and writes it into
the request it relays (`AdapterScales.to_proto`); the worker reads it back at its gRPC edge
(`AdapterScales.from_proto`) and builds its ``AdapterSet`` (the loaded adapters behind the ids)
from it. Torch-free and plane-free: both planes import it, neither imports the other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

from loraplane.limits import MAX_ADAPTER_SCALE
from loraplane.v1 import common_pb2

MAX_ADAPTER_ID = 2**32 - 1
"""Adapter ids are protobuf ``uint32`` on the wire (``AdapterRef.id``, ``AdapterScale.id``)."""


class AdapterScalesError(ValueError):
    """A scale or an id that an `AdapterScales` cannot hold; the message names the adapter.
    Each plane turns it into its own invalid-argument error at its edge."""


def check_scale_bounds(scale: float, what: str) -> float:
    """``scale`` as a float, when it is finite and its magnitude at most `MAX_ADAPTER_SCALE`.

    ``what`` names the adapter in the message (e.g. ``"adapter 3"``). A sign is not checked:
    the control plane refuses negative scales as its own rule (``control_plane.resolution.
    check_scale``); workers take them as given.

    Raises:
        AdapterScalesError: the scale is not finite, or above the limit in magnitude (past it
            an adapter's delta swamps the base weights' output: `MAX_ADAPTER_SCALE`).
    """
    value = float(scale)
    if not math.isfinite(value):
        raise AdapterScalesError(f"{what}: scale {value} is not a finite number")
    if abs(value) > MAX_ADAPTER_SCALE:
        raise AdapterScalesError(f"{what}: scale {value:g} is above the limit of {MAX_ADAPTER_SCALE:g}")
    return value


class AdapterScales:
    """An immutable ``adapter id → scale`` set: ids ascending, zero scales dropped (a zero
    scale is the base model for that adapter, llama.cpp skips it too), every scale finite and
    at most `MAX_ADAPTER_SCALE` in magnitude.

    Equal sets (same ids, same scales) are equal and hash alike, so a set is its own key
    (the control plane's worker affinity).

    Args:
        pairs: ``(adapter_id, scale)`` pairs in any order, zero scales included.

    Raises:
        AdapterScalesError: an id outside ``0..MAX_ADAPTER_ID``, a scale `check_scale_bounds`
            refuses, or an id given twice (even at scale 0).
    """

    __slots__ = ("_entries",)

    _entries: tuple[tuple[int, float], ...]

    def __init__(self, pairs: Iterable[tuple[int, float]] = ()) -> None:
        seen: dict[int, float] = {}
        for adapter_id, scale in pairs:
            aid = int(adapter_id)
            if not 0 <= aid <= MAX_ADAPTER_ID:
                raise AdapterScalesError(f"adapter id {aid} is outside 0..{MAX_ADAPTER_ID}")
            value = check_scale_bounds(scale, f"adapter {aid}")
            if aid in seen:
                raise AdapterScalesError(f"adapter {aid} is listed more than once")
            seen[aid] = value
        object.__setattr__(self, "_entries", tuple(sorted((i, s) for i, s in seen.items() if s != 0.0)))

    @classmethod
    def from_proto(cls, amap: common_pb2.AdapterMap) -> AdapterScales:
        """The set an ``AdapterMap`` of ids carries (the worker's edge: the control plane
        resolved every name). Entries naming an adapter are refused, never read as id 0.

        Raises:
            AdapterScalesError: an entry with a ``name``, or what the constructor refuses.
        """
        named = [e.name for e in amap.entries if e.name]
        if named:
            raise AdapterScalesError(
                f"adapters {named} given by name: a worker takes ids only; names are resolved by the control plane"
            )
        return cls((e.id, e.scale) for e in amap.entries)

    def to_proto(self) -> common_pb2.AdapterMap:
        """An ``AdapterMap`` with one entry per adapter, by id (no names)."""
        return common_pb2.AdapterMap(entries=[common_pb2.AdapterScale(id=i, scale=s) for i, s in self._entries])

    @property
    def entries(self) -> tuple[tuple[int, float], ...]:
        """``((adapter_id, scale), ...)`` by ascending id, scales non-zero."""
        return self._entries

    @property
    def ids(self) -> tuple[int, ...]:
        """The adapter ids, ascending."""
        return tuple(i for i, _ in self._entries)

    def __iter__(self) -> Iterator[tuple[int, float]]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AdapterScales) and self._entries == other._entries

    def __hash__(self) -> int:
        return hash(self._entries)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"AdapterScales is immutable (cannot set {name})")

    def __repr__(self) -> str:
        return f"AdapterScales({list(self._entries)})"

    def __reduce__(self) -> tuple[type[AdapterScales], tuple[tuple[tuple[int, float], ...]]]:
        return (AdapterScales, (self._entries,))


NO_ADAPTERS = AdapterScales()
"""The empty set: the base model alone."""


__all__ = ["MAX_ADAPTER_ID", "NO_ADAPTERS", "AdapterScales", "AdapterScalesError", "check_scale_bounds"]
