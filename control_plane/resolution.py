"""Turning a request's adapter field into the resolved `AdapterScales` a worker receives.

A request with no adapter map uses the global default set as it was when the request
was admitted; a request with a map (even an empty one) uses exactly that map, every other
registered adapter at scale 0. Workers only ever see resolved sets.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence

from control_plane.errors import (
    AmbiguousNameError,
    InvalidArgumentError,
    NotFoundError,
    describe_ids,
    echo,
    listing,
)
from control_plane.store import AdapterRecord
from loraplane.adapter_scales import MAX_ADAPTER_ID, AdapterScales, AdapterScalesError, check_scale_bounds

_ASCII_ID = re.compile(r"[0-9]{1,10}")
_ASCII_DIGITS = re.compile(r"[0-9]+")
ID_PREFIX = "adapter:"
"""``adapter:<id>`` names an adapter by id on every API (and no adapter name may start with it)."""


def is_id_token(text: str) -> bool:
    """True when ``text`` is ASCII digits only: such a token always names an adapter id, never
    a name (so registration refuses all-digit names, `names.name_clash`)."""
    return bool(_ASCII_DIGITS.fullmatch(text))


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


def find_adapter(token: str, records: Sequence[AdapterRecord]) -> int:
    """The id of the adapter ``token`` names among ``records``: the one rule the CLI, gRPC
    (``AdapterRef.name``, ``AdapterScale.name``, ``PinRequest.name``) and HTTP (``model``,
    ``lora_name``) share.

    * ASCII digits only → that id (`parse_adapter_id`; never a name);
    * ``adapter:<id>`` → that id (the form ``/v1/models`` lists unnamed adapters under);
    * otherwise a name: the adapter whose name or one of whose aliases it is.

    Raises:
        NotFoundError: no registered adapter has that id / name (the message lists what is).
        AmbiguousNameError: several adapters answer to the name (the message lists their ids;
            name one by id).
    """
    id_text = token[len(ID_PREFIX) :] if token.startswith(ID_PREFIX) else token
    if is_id_token(id_text):
        adapter_id = parse_adapter_id(id_text)
        if adapter_id is not None and any(r.id == adapter_id for r in records):
            return adapter_id
        raise NotFoundError(f"adapter {echo(id_text)} not registered; {describe_ids([r.id for r in records])}")
    matches = [r.id for r in records if token in r.names]
    if len(matches) > 1:
        raise AmbiguousNameError(
            f"adapter name '{echo(token)}' is ambiguous: adapters {matches} answer to it; name one by id"
        )
    if not matches:
        names = sorted({n for r in records for n in r.names})
        raise NotFoundError(
            f"no adapter is named '{echo(token)}' (names: {listing(names)}; {describe_ids([r.id for r in records])})"
        )
    return matches[0]


def check_scale(scale: float, what: str) -> float:
    """``scale`` as a float; InvalidArgumentError naming ``what`` (e.g. "adapter 3") when it is
    negative, not finite, or above `MAX_ADAPTER_SCALE` (the one check of every scale that enters
    the control plane: gRPC and HTTP adapter maps, the default set, start-up adapters). The
    bounds are `AdapterScales`'s (`check_scale_bounds`); the sign is this plane's rule."""
    value = float(scale)
    if math.isfinite(value) and value < 0:
        raise InvalidArgumentError(f"{what}: scale {value} is negative (0 detaches an adapter)")
    try:
        return check_scale_bounds(value, what)
    except AdapterScalesError as exc:
        raise InvalidArgumentError(str(exc)) from None


def map_from_pairs(pairs: Iterable[tuple[int, float]]) -> dict[int, float]:
    """``{id: scale}`` from ``(id, scale)`` pairs; an id given twice is an InvalidArgumentError."""
    out: dict[int, float] = {}
    for adapter_id, scale in pairs:
        if adapter_id in out:
            raise InvalidArgumentError(f"adapter {adapter_id} is listed more than once")
        out[int(adapter_id)] = float(scale)
    return out


def resolve_adapters(
    request_map: Mapping[int, float] | None, default_set: Sequence[tuple[int, float]]
) -> AdapterScales:
    """The adapters at their scales that a request runs with.

    Args:
        request_map: the request's ``{id: scale}``; None means "no map" (use the default).
        default_set: the global default set as of admission: one ``(id, scale)`` per
            registered adapter (0: detached), so its ids are the registered ids.

    Raises:
        NotFoundError: an id in ``request_map`` is not registered (the message lists them),
            even at scale 0.
        InvalidArgumentError: a negative or non-finite scale, or one above `MAX_ADAPTER_SCALE`.
    """
    if request_map is None:
        chosen = {int(i): check_scale(s, f"adapter {i}") for i, s in default_set}
    else:
        registered = {int(i) for i, _ in default_set}
        unknown = sorted(set(request_map) - registered)
        if unknown:
            raise NotFoundError(f"adapter id(s) {unknown} not registered; {describe_ids(registered)}")
        chosen = {int(i): check_scale(s, f"adapter {i}") for i, s in request_map.items()}
    return AdapterScales(chosen.items())
