"""`loraplane.adapter_scales.AdapterScales`: the one value type for a request's resolved adapters."""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle

import pytest

from loraplane.adapter_scales import (
    MAX_ADAPTER_ID,
    NO_ADAPTERS,
    AdapterScales,
    AdapterScalesError,
    check_scale_bounds,
)
from loraplane.v1 import common_pb2 as pb


def test_ids_ascend_and_zero_scales_are_dropped():
    scales = AdapterScales([(5, 0.5), (2, 1.0), (3, 0.0), (7, -2.0)])
    assert scales.entries == ((2, 1.0), (5, 0.5), (7, -2.0))
    assert scales.ids == (2, 5, 7) and len(scales) == 3 and list(scales) == [(2, 1.0), (5, 0.5), (7, -2.0)]
    assert AdapterScales([(3, 0.0)]) == NO_ADAPTERS and not NO_ADAPTERS and NO_ADAPTERS.ids == ()


def test_equal_sets_are_equal_and_hash_alike():
    a, b = AdapterScales([(0, 1.0), (2, 0.5)]), AdapterScales([(2, 0.5), (1, 0.0), (0, 1.0)])
    assert a == b and hash(a) == hash(b) and {a: "w1"}[b] == "w1"
    assert a != AdapterScales([(0, 1.0), (2, 0.25)]) and a != [(0, 1.0), (2, 0.5)]
    assert repr(a) == "AdapterScales([(0, 1.0), (2, 0.5)])"


def test_immutable_and_copyable():
    a = AdapterScales([(1, 0.5)])
    with pytest.raises(AttributeError, match="immutable"):
        a._entries = ()  # type: ignore[misc]
    assert copy.deepcopy(a) == a and pickle.loads(pickle.dumps(a)) == a

    @dataclasses.dataclass
    class Holder:
        adapters: AdapterScales

    assert dataclasses.asdict(Holder(a))["adapters"] == a  # telemetry records are read with asdict


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        ([(3, math.inf)], "adapter 3: scale inf is not a finite number"),
        ([(3, -math.inf)], "adapter 3: scale -inf is not a finite number"),
        ([(3, math.nan)], "adapter 3: scale nan is not a finite number"),
        ([(3, 1e30)], "adapter 3: scale 1e+30 is above the limit of 10000"),
        ([(3, -10000.5)], "adapter 3: scale -10000.5 is above the limit of 10000"),
        ([(3, 1.0), (3, 0.5)], "adapter 3 is listed more than once"),
        ([(3, 0.0), (3, 0.0)], "adapter 3 is listed more than once"),  # zeros count: checked before dropping
        ([(-1, 1.0)], f"adapter id -1 is outside 0..{MAX_ADAPTER_ID}"),
        ([(2**32, 1.0)], f"adapter id {2**32} is outside 0..{MAX_ADAPTER_ID}"),
    ],
)
def test_the_constructor_refuses(pairs, message):
    with pytest.raises(AdapterScalesError) as err:
        AdapterScales(pairs)
    assert str(err.value) == message
    assert isinstance(err.value, ValueError)


def test_bounds_are_inclusive_and_signless():
    assert check_scale_bounds(10000, "adapter 0") == 10000.0 and check_scale_bounds(-10000, "x") == -10000.0
    assert AdapterScales([(0, 10000.0), (MAX_ADAPTER_ID, -1.0)]).ids == (0, MAX_ADAPTER_ID)


def test_proto_round_trip_keeps_ids_and_scales():
    amap = pb.AdapterMap(entries=[pb.AdapterScale(id=4, scale=0.25), pb.AdapterScale(id=1, scale=2.0)])
    scales = AdapterScales.from_proto(amap)
    assert scales.entries == ((1, 2.0), (4, 0.25))
    assert [(e.id, e.scale, e.name) for e in scales.to_proto().entries] == [(1, 2.0, ""), (4, 0.25, "")]
    assert AdapterScales.from_proto(pb.AdapterMap()) == NO_ADAPTERS and not NO_ADAPTERS.to_proto().entries


def test_from_proto_refuses_names_rather_than_reading_id_zero():
    amap = pb.AdapterMap(entries=[pb.AdapterScale(name="shout", scale=1.0), pb.AdapterScale(id=2, scale=1.0)])
    with pytest.raises(AdapterScalesError) as err:
        AdapterScales.from_proto(amap)
    assert str(err.value) == (
        "adapters ['shout'] given by name: a worker takes ids only; names are resolved by the control plane"
    )
