"""The ``adapter`` label values of the control plane's metrics (`adapter_label`): names, not
ids, with ``<name>#<id>`` wherever a name alone would be ambiguous. ``control_plane.metrics``
applies them; docs/operations.md, "Adapter labels", says what an operator sees."""

from __future__ import annotations

import re
from dataclasses import dataclass

from control_plane.resolution import ID_PREFIX
from loraplane.metrics import NO_ADAPTER_LABEL, OTHER_LABEL

_ID_SUFFIX = re.compile(r"#[0-9]+\Z")


@dataclass(frozen=True)
class AdapterNaming:
    """How the metrics name one adapter: ``served``, the id ``/v1/models`` lists it under
    (`control_plane.http.models.served_name`; ``vllm:lora_requests_info`` names it so), and
    ``label``, its ``adapter`` label value (`adapter_label`)."""

    served: str
    label: str


def adapter_label(adapter_id: int, name: str, served: str) -> str:
    """The ``adapter`` label value of adapter ``adapter_id``, named ``name`` ("": unnamed) and
    served as ``served`` (its name when unique, else ``adapter:<id>``):

      * its name, when that is the name it is served under and cannot be read as another
        label: not "none" / "other" (`NO_ADAPTER_LABEL`, `OTHER_LABEL`) and not ending in
        ``#<digits>``;
      * ``<name>#<id>`` for any other name (two adapters sharing it, a reserved one);
      * ``adapter:<id>`` for an unnamed adapter.

    So one label never means two adapters: a label ending in ``#<digits>`` holds the id of the
    one adapter it names, any other is a name one adapter alone answers to or ``adapter:<id>``
    (no servable name starts with ``adapter:``). vLLM labels LoRA series by name
    (``vllm:lora_requests_info``); names are not unique here (files embed theirs), ids are.
    """
    if name and served == name and name not in (NO_ADAPTER_LABEL, OTHER_LABEL) and not _ID_SUFFIX.search(name):
        return name
    return f"{name}#{adapter_id}" if name else f"{ID_PREFIX}{adapter_id}"


def unknown_adapter(adapter_id: int) -> AdapterNaming:
    """An adapter whose row cannot be read (database outage, just removed): its id form."""
    return AdapterNaming(f"{ID_PREFIX}{adapter_id}", f"{ID_PREFIX}{adapter_id}")
