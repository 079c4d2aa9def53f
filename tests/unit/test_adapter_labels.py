"""The control plane's ``adapter`` label values (``control_plane.adapter_labels.adapter_label``) and how
the metrics read adapter names: once per ``NAMING_MAX_AGE_S``, ``adapter:<id>`` and the last
count while the store cannot be read."""

from __future__ import annotations

import pytest

from control_plane.adapter_labels import AdapterNaming, adapter_label
from control_plane.metrics import ControlPlaneMetrics


@pytest.mark.parametrize(
    "adapter_id,name,served,label",
    [
        (3, "sea", "sea", "sea"),  # a name one adapter alone answers to
        (3, "twin", "adapter:3", "twin#3"),  # shared: /v1/models lists it by id
        (3, "", "adapter:3", "adapter:3"),  # unnamed
        (3, "other", "other", "other#3"),  # never the overflow label
        (3, "none", "none", "none#3"),  # never the base model's label
        (3, "sea#1", "sea#1", "sea#1#3"),  # never what adapter 1 named "sea" would read as
        (3, "v#2a", "v#2a", "v#2a"),  # "#" alone is fine
        (3, "gemma", "adapter:3", "gemma#3"),  # a legacy row named like the base model
    ],
)
def test_adapter_label(adapter_id, name, served, label):
    assert adapter_label(adapter_id, name, served) == label


def test_names_are_read_once_per_interval_and_an_outage_keeps_the_last_count(monkeypatch):
    import control_plane.metrics as metrics

    reads: list[int] = []
    store: list[dict[int, AdapterNaming] | None] = [{0: AdapterNaming("sea", "sea"), 1: AdapterNaming("a", "a")}]

    def adapters():
        reads.append(1)
        return store[0]

    clock = [100.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    m = ControlPlaneMetrics(model_name="base", adapters=adapters, pool_state=lambda: (0, 0, 0), adapter_label_cap=8)
    assert [n.label for n in m.namings([1, 0, 7])] == ["a", "sea", "adapter:7"]  # 7: not registered
    assert m.n_adapters() == 2
    m.exposition()
    assert len(reads) == 1  # namings, the count and a whole scrape: one read
    clock[0] += metrics.NAMING_MAX_AGE_S
    store[0] = None  # the database went away
    assert [n.label for n in m.namings([0])] == ["adapter:0"]
    assert m.n_adapters() == 2 and len(reads) == 2
