"""Turning a request's adapter field into the resolved vector a worker receives.

A request with no adapter map uses the global default set as it was when the request
was admitted; a request with a map (even an empty one) uses exactly that map, every other
registered adapter at scale 0. Workers only ever see resolved vectors.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence

from control_plane.errors import InvalidArgumentError, NotFoundError, describe_ids

AdapterVector = list[tuple[int, float]]

MAX_ADAPTER_ID = 2**32 - 1
"""Adapter ids are protobuf ``uint32`` on the wire (``AdapterRef.id``, ``AdapterScale.id``)."""
_ASCII_ID = re.compile(r"[0-9]{1,10}")


def parse_adapter_id(text: str) -> int | None:
    """The adapter id ``text`` spells, or None when it spells none.

    ASCII digits only, at most `MAX_ADAPTER_ID`: ``int()`` and ``str.isdigit`` accept any
    Unicode digit (``"٣"`` is 3), signs, spaces and underscores, so an id is never parsed with
    them alone. A 20-digit id is None (not registered), never an overflow further down.
    """
    if not _ASCII_ID.fullmatch(text):
        return None
    value = int(text)
    return value if value <= MAX_ADAPTER_ID else None


def check_scale(scale: float, what: str) -> float:
    """``scale`` as a float; InvalidArgumentError naming ``what`` (e.g. "adapter 3") when it is
    negative or not finite."""
    value = float(scale)
    if not math.isfinite(value):
        raise InvalidArgumentError(f"{what}: scale {value} is not a finite number")
    if value < 0:
        raise InvalidArgumentError(f"{what}: scale {value} is negative (0 detaches an adapter)")
    return value


def map_from_pairs(pairs: Iterable[tuple[int, float]]) -> dict[int, float]:
    """``{id: scale}`` from ``(id, scale)`` pairs; an id given twice is an InvalidArgumentError."""
    out: dict[int, float] = {}
    for adapter_id, scale in pairs:
        if adapter_id in out:
            raise InvalidArgumentError(f"adapter {adapter_id} is listed more than once")
        out[int(adapter_id)] = float(scale)
    return out


def resolve_adapter_vector(
    request_map: Mapping[int, float] | None, default_set: Sequence[tuple[int, float]]
) -> AdapterVector:
    """The non-zero ``(id, scale)`` entries, by id, that a request runs with.

    Args:
        request_map: the request's ``{id: scale}``; None means "no map" (use the default).
        default_set: the global default set as of admission: one ``(id, scale)`` per
            registered adapter (0: detached), so its ids are the registered ids.

    Raises:
        NotFoundError: an id in ``request_map`` is not registered (the message lists them).
        InvalidArgumentError: a negative or non-finite scale.
    """
    if request_map is None:
        chosen = {int(i): check_scale(s, f"adapter {i}") for i, s in default_set}
    else:
        registered = {int(i) for i, _ in default_set}
        unknown = sorted(set(request_map) - registered)
        if unknown:
            raise NotFoundError(f"adapter id(s) {unknown} not registered; {describe_ids(registered)}")
        chosen = {int(i): check_scale(s, f"adapter {i}") for i, s in request_map.items()}
    return [(i, s) for i, s in sorted(chosen.items()) if s != 0.0]


def adapter_set_key(vector: Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """Hashable identity of a resolved vector (same adapters, same scales → same key)."""
    return tuple(sorted((int(i), float(s)) for i, s in vector if s != 0.0))
