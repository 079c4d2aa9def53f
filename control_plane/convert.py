"""Proto ↔ domain conversions for the control plane (no logic beyond shape changes)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from control_plane.errors import InvalidArgumentError
from control_plane.resolution import map_from_pairs
from control_plane.store import AdapterRecord
from control_plane.tenant_admin import TenantView
from control_plane.workers import WorkerView
from loraplane.adapter_scales import AdapterScales
from loraplane.v1 import common_pb2, control_plane_pb2


def adapter_info(rec: AdapterRecord) -> common_pb2.AdapterInfo:
    m = rec.metadata
    return common_pb2.AdapterInfo(
        id=rec.id,
        name=rec.name,
        path=rec.path,
        sha256=rec.sha256,
        arch=m.get("arch", ""),
        alpha=m.get("alpha", 0.0),
        ranks=m.get("ranks", []),
        target_tensors=m.get("target_tensors", []),
        task_name=m.get("task_name", ""),
        prompt_prefix=m.get("prompt_prefix", ""),
        alora_invocation_tokens=m.get("alora_invocation_tokens", []),
        alora_invocation_text=m.get("alora_invocation_text", ""),
        default_scale=rec.default_scale,
        size_bytes=m.get("size_bytes", 0),
        n_nodes=m.get("n_nodes", 0),
        source_format=rec.source_format,
        pinned=rec.pinned,
        aliases=list(rec.aliases),
    )


def adapter_map(default_scales: Sequence[tuple[int, float]]) -> common_pb2.AdapterMap:
    """The default set as an ``AdapterMap``: one entry per registered adapter, zeros kept
    (``GetDefaultAdapters`` / ``SetDefaultAdapters`` answers)."""
    return common_pb2.AdapterMap(entries=[common_pb2.AdapterScale(id=i, scale=s) for i, s in default_scales])


Lookup = Callable[[str], int]
"""A name → id resolver (`control_plane.names.AdapterNames.lookup`)."""


def ref_id(ref: common_pb2.AdapterRef | common_pb2.AdapterScale | control_plane_pb2.PinRequest, lookup: Lookup) -> int:
    """The id an ``AdapterRef`` / ``AdapterScale`` / ``PinRequest`` names: its ``name`` through
    ``lookup`` when set (ASCII digits read as an id), else its ``id``.

    Raises:
        InvalidArgumentError: both a non-zero ``id`` and a ``name`` (give one).
        NotFoundError / AmbiguousNameError: from ``lookup``.
    """
    if not ref.name:
        return ref.id
    if ref.id:
        raise InvalidArgumentError(f"adapter given both as id {ref.id} and as name '{ref.name}'; give one")
    return lookup(ref.name)


def request_map(msg: common_pb2.AdapterMap, lookup: Lookup) -> dict[int, float]:
    """``{id: scale}`` of an AdapterMap, names resolved by ``lookup`` (`ref_id`); an adapter
    listed twice (by id or by name) is INVALID_ARGUMENT."""
    return map_from_pairs((ref_id(e, lookup), e.scale) for e in msg.entries)


def request_map_or_none(request: common_pb2.GenerateRequest, lookup: Lookup) -> dict[int, float] | None:
    """The request's map, or None when the field is unset ("use the default set")."""
    return request_map(request.adapters, lookup) if request.HasField("adapters") else None


def set_resolved_adapters(request: common_pb2.GenerateRequest, adapters: AdapterScales) -> None:
    """Write the resolved adapters into ``request.adapters`` (`AdapterScales.to_proto`),
    present even when empty, so the worker never has to resolve anything."""
    request.ClearField("adapters")
    request.adapters.SetInParent()
    request.adapters.MergeFrom(adapters.to_proto())


def worker_info(view: WorkerView) -> control_plane_pb2.WorkerInfo:
    return control_plane_pb2.WorkerInfo(
        worker_id=view.worker_id,
        addr=view.addr,
        state=view.state,
        last_heartbeat_age_s=view.last_heartbeat_age_s,
        adapter_ids=list(view.adapter_ids),
        model=view.model,
        n_slots=view.n_slots,
        in_flight=view.in_flight,
        restarts=view.restarts,
        draining_adapter_ids=list(view.draining_adapter_ids),
        paging=view.paging,
        resident_adapter_ids=list(view.resident_ids),
        host_adapter_ids=list(view.host_ids),
    )


@dataclass(frozen=True)
class Upload:
    """A RegisterAdapter stream: either ``server_path`` or ``data`` (an iterator of bytes)."""

    name: str
    server_path: str
    data: Iterator[bytes]
    source_format: str = ""


def upload_from_chunks(chunks: Iterator[common_pb2.AdapterChunk]) -> Upload:
    """Split a RegisterAdapter stream into its header (first chunk) and its data.

    Raises:
        InvalidArgumentError: no chunk at all, or a server path together with data.
    """
    first = next(chunks, None)
    if first is None:
        raise InvalidArgumentError("RegisterAdapter stream carried no chunk")
    if first.server_path:
        if first.data or next(chunks, None) is not None:
            raise InvalidArgumentError(
                f"RegisterAdapter: server_path '{first.server_path}' given together with data; send one or the other"
            )
        return Upload(first.name, first.server_path, iter(()))
    rest = (c.data for c in chunks)
    return Upload(first.name, "", itertools.chain([first.data], rest), first.source_format)


def tenant_info(view: TenantView) -> control_plane_pb2.Tenant:
    """A tenant with its limits and usage (`control_plane.tenant_admin.TenantView`)."""
    r, u = view.record, view.usage
    return control_plane_pb2.Tenant(
        name=r.name,
        weight=r.weight,
        priority=r.priority,
        max_concurrent=r.max_concurrent,
        tokens_per_minute=r.tokens_per_minute,
        requests_per_minute=r.requests_per_minute,
        key_count=r.key_count,
        usage=control_plane_pb2.TenantUsage(
            in_flight=u.in_flight,
            tokens_available=u.tokens_available,
            requests_available=u.requests_available,
            requests_total=u.requests_total,
            tokens_total=u.tokens_total,
            rejected_total=u.rejected_total,
        ),
    )


TENANT_LIMIT_FIELDS = ("weight", "priority", "max_concurrent", "tokens_per_minute", "requests_per_minute")


def tenant_settings(limits: control_plane_pb2.TenantLimits) -> dict[str, float | int]:
    """The settings a ``TenantLimits`` sets (its optional fields that are present)."""
    return {f: getattr(limits, f) for f in TENANT_LIMIT_FIELDS if limits.HasField(f)}
