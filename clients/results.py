"""Typed, immutable results of the loraplane client, converted from the wire messages.

Every class here is a frozen dataclass built by a ``from_proto`` classmethod and turned into
plain JSON-ready data by ``to_json``. Float32 wire values (scales, alphas, log-probs) are
rendered with the shortest decimal that round-trips through float32, so ``0.3`` prints as
``0.3`` rather than ``0.30000001192092896``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from loraplane.v1 import common_pb2, control_plane_pb2


def f32(x: float) -> float:
    """The shortest Python float that is the same float32 as ``x``."""
    if not math.isfinite(x):
        return x
    target = struct.unpack("<f", struct.pack("<f", x))[0]
    for digits in range(1, 10):
        candidate = float(f"{target:.{digits}g}")
        if struct.unpack("<f", struct.pack("<f", candidate))[0] == target:
            return candidate
    return target


_REQUEST_ONLY = {("loraplane.v1.AdapterScale", "name")}
"""Fields only requests use (an adapter by name); answers leave them empty, so they are not shown."""


def message_to_dict(msg: Message) -> dict[str, Any]:
    """Every field of ``msg`` in declaration order, defaults included (request-only fields,
    `_REQUEST_ONLY`, left out), float32 shortened.

    (``json_format.MessageToDict`` puts set fields first and renders 64-bit ints as strings;
    telemetry is easier to read and diff in declaration order with real numbers.)
    """
    out: dict[str, Any] = {}
    for fd in msg.DESCRIPTOR.fields:
        if (msg.DESCRIPTOR.full_name, fd.name) in _REQUEST_ONLY:
            continue
        value = getattr(msg, fd.name)
        if _is_repeated(fd):
            out[fd.name] = [_scalar_or_message(fd, v) for v in value]
        else:
            out[fd.name] = _scalar_or_message(fd, value)
    return out


def _is_repeated(fd: FieldDescriptor) -> bool:
    # protobuf >= 5.28 has ``is_repeated``; ``label`` is deprecated there.
    is_repeated = getattr(fd, "is_repeated", None)
    if isinstance(is_repeated, bool):
        return is_repeated
    return fd.label == FieldDescriptor.LABEL_REPEATED


def _scalar_or_message(fd: FieldDescriptor, value: Any) -> Any:
    if fd.type == FieldDescriptor.TYPE_MESSAGE:
        return message_to_dict(value)
    if fd.type == FieldDescriptor.TYPE_FLOAT:
        return f32(value)
    return value


@dataclass(frozen=True)
class AdapterScale:
    """One adapter id with its strength (0 means detached)."""

    id: int
    scale: float

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "scale": f32(self.scale)}


@dataclass(frozen=True)
class Adapter:
    """A registered adapter as the control plane describes it (``AdapterInfo``)."""

    id: int
    name: str
    path: str
    sha256: str
    arch: str
    alpha: float
    ranks: tuple[int, ...]
    target_tensors: tuple[str, ...]
    task_name: str
    prompt_prefix: str
    alora_invocation_tokens: tuple[int, ...]
    alora_invocation_text: str
    default_scale: float
    size_bytes: int
    n_nodes: int
    source_format: str = "gguf"
    pinned: bool = False
    aliases: tuple[str, ...] = ()

    @classmethod
    def from_proto(cls, info: common_pb2.AdapterInfo) -> Adapter:
        return cls(
            id=info.id,
            name=info.name,
            path=info.path,
            sha256=info.sha256,
            arch=info.arch,
            alpha=f32(info.alpha),
            ranks=tuple(info.ranks),
            target_tensors=tuple(info.target_tensors),
            task_name=info.task_name,
            prompt_prefix=info.prompt_prefix,
            alora_invocation_tokens=tuple(info.alora_invocation_tokens),
            alora_invocation_text=info.alora_invocation_text,
            default_scale=f32(info.default_scale),
            size_bytes=info.size_bytes,
            n_nodes=info.n_nodes,
            source_format=info.source_format or "gguf",
            pinned=info.pinned,
            aliases=tuple(info.aliases),
        )

    @property
    def is_alora(self) -> bool:
        return bool(self.alora_invocation_tokens)

    def to_json(self) -> dict[str, Any]:
        """``{"id", "sha256", ...metadata}`` (the ``adapters add --json`` shape)."""
        return {
            "id": self.id,
            "sha256": self.sha256,
            "name": self.name,
            "path": self.path,
            "arch": self.arch,
            "alpha": self.alpha,
            "ranks": list(self.ranks),
            "target_tensors": list(self.target_tensors),
            "task_name": self.task_name,
            "prompt_prefix": self.prompt_prefix,
            "alora_invocation_tokens": list(self.alora_invocation_tokens),
            "alora_invocation_text": self.alora_invocation_text,
            "default_scale": self.default_scale,
            "size_bytes": self.size_bytes,
            "n_nodes": self.n_nodes,
            "source_format": self.source_format,
            "pinned": self.pinned,
            "aliases": list(self.aliases),
        }


def adapter_names(adapters: Iterable[Adapter]) -> dict[int, str]:
    """``{id: name}`` of ``adapters`` (`LoraplaneClient.list_adapters`): what ``default get`` and
    ``workers list`` show beside ids."""
    return {a.id: a.name for a in adapters}


@dataclass(frozen=True)
class DefaultSet:
    """The global default adapter set: what requests without an adapter map use."""

    entries: tuple[AdapterScale, ...]

    @classmethod
    def from_proto(cls, amap: common_pb2.AdapterMap) -> DefaultSet:
        return cls(tuple(AdapterScale(e.id, f32(e.scale)) for e in amap.entries))

    def as_dict(self) -> dict[int, float]:
        return {e.id: e.scale for e in self.entries}

    def to_json(self, names: Mapping[int, str] | None = None) -> dict[str, Any]:
        """``{"adapters": [{"id", "scale"}, ...]}``; with ``names`` (id → name, `adapter_names`)
        each entry also has ``"name"`` ("" for an id ``names`` lacks)."""
        if names is None:
            return {"adapters": [e.to_json() for e in self.entries]}
        return {"adapters": [{**e.to_json(), "name": names.get(e.id, "")} for e in self.entries]}


@dataclass(frozen=True)
class WorkerInfo:
    """A worker as the control plane sees it."""

    worker_id: str
    addr: str
    state: str
    last_heartbeat_age_s: float
    adapter_ids: tuple[int, ...]
    model: str
    n_slots: int
    in_flight: int
    restarts: int = 0
    draining_adapter_ids: tuple[int, ...] = ()
    # Adapter paging, as of the worker's last heartbeat.
    resident_adapter_ids: tuple[int, ...] = ()
    host_adapter_ids: tuple[int, ...] = ()
    max_loras: int = 0
    max_cpu_loras: int = 0
    resident: int = 0
    host: int = 0
    page_ins: int = 0
    evictions: int = 0
    fetches: int = 0
    fetch_bytes: int = 0
    page_in_bytes: int = 0
    host_evictions: int = 0

    @classmethod
    def from_proto(cls, w: control_plane_pb2.WorkerInfo) -> WorkerInfo:
        """Field for field from the proto (repeated fields become tuples; the paging
        counters are flattened from ``paging``)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            src = w if f.name in control_plane_pb2.WorkerInfo.DESCRIPTOR.fields_by_name else w.paging
            values[f.name] = getattr(src, f.name)
        return cls(**{k: v if isinstance(v, (str, int, float)) else tuple(v) for k, v in values.items()})  # type: ignore[arg-type]

    @property
    def alive(self) -> bool:
        return self.state == "alive"

    def to_json(self, names: Mapping[int, str] | None = None) -> dict[str, Any]:
        """The ``workers list --json`` object: every field, tuples as lists; with ``names``
        (id → name, `adapter_names`) also ``"adapters": [{"id", "name"}, ...]`` for
        ``adapter_ids`` ("" for an id ``names`` lacks)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["last_heartbeat_age_s"] = round(self.last_heartbeat_age_s, 3)
        if names is not None:
            out["adapters"] = [{"id": i, "name": names.get(i, "")} for i in self.adapter_ids]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


@dataclass(frozen=True)
class TokenLogprob:
    """A token id with its log-prob (one of the top-N alternatives, or a prompt token)."""

    token_id: int
    logprob: float

    def to_json(self) -> dict[str, Any]:
        return {"token_id": self.token_id, "logprob": f32(self.logprob)}


@dataclass(frozen=True)
class GeneratedLogprobs:
    """The chosen token's log-prob (before sampling) and the top-N alternatives."""

    token_id: int
    logprob: float
    top: tuple[TokenLogprob, ...]

    def to_json(self) -> dict[str, Any]:
        return {"token_id": self.token_id, "logprob": f32(self.logprob), "top": [t.to_json() for t in self.top]}


# ---- stream events -----------------------------------------------------------------------


@dataclass(frozen=True)
class StartedEvent:
    """First event of a generation: the prompt as the model tokenized it.

    ``prompt_logprobs`` is None unless requested; otherwise one entry per prompt token, entry
    0 None (nothing precedes it), entry j the log-prob of prompt token j given tokens 0..j-1.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, as soon as the worker produced it.

    ``text`` is the detokenized piece (empty while a UTF-8 character is incomplete);
    ``step`` is the decode step's telemetry (``StepTelemetry`` fields).
    """

    request_id: str
    token_id: int
    text: str
    logprob: float
    top: tuple[TokenLogprob, ...]
    step: dict[str, Any]


@dataclass(frozen=True)
class FinishedEvent:
    """Last event: why generation stopped, the full text and the request's telemetry."""

    request_id: str
    finish_reason: str
    text: str
    telemetry: dict[str, Any]


GenerateEvent = StartedEvent | TokenEvent | FinishedEvent


def event_from_proto(ev: common_pb2.GenerateEvent) -> GenerateEvent | None:
    """The typed event, or None for an event kind this client does not know (newer server)."""
    kind = ev.WhichOneof("event")
    if kind == "started":
        s = ev.started
        prompt_lps = None
        if len(s.prompt_logprobs):
            prompt_lps = tuple(
                TokenLogprob(p.token_id, f32(p.logprob)) if p.has_logprob else None for p in s.prompt_logprobs
            )
        return StartedEvent(ev.request_id, tuple(s.prompt_token_ids), prompt_lps)
    if kind == "token":
        t = ev.token
        return TokenEvent(
            request_id=ev.request_id,
            token_id=t.token_id,
            text=t.text,
            logprob=f32(t.logprob),
            top=tuple(TokenLogprob(x.token_id, f32(x.logprob)) for x in t.top),
            step=message_to_dict(t.step),
        )
    if kind == "finished":
        f = ev.finished
        return FinishedEvent(ev.request_id, f.finish_reason, f.text, message_to_dict(f.telemetry))
    return None


@dataclass(frozen=True)
class GenerateResult:
    """A whole generation, collected from the event stream.

    Attributes:
        text: generated text only (the prompt is not included).
        token_ids: generated token ids.
        prompt_token_ids: the prompt as the model tokenized it (BOS included for text prompts).
        finish_reason: ``"length"`` or ``"stop"``.
        telemetry: the request's ``RequestTelemetry`` fields plus ``"steps"``, the per-token
            ``StepTelemetry`` dicts in order.
        logprobs: per generated token, its log-prob and the top-N alternatives requested.
        prompt_logprobs: None unless requested; see `StartedEvent`.
        request_id: the id the server used.
    """

    text: str
    token_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]
    finish_reason: str
    telemetry: dict[str, Any]
    logprobs: tuple[GeneratedLogprobs, ...]
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None
    request_id: str = ""

    def to_json(self, *, include_logprobs: bool = False, include_prompt_logprobs: bool = False) -> dict[str, Any]:
        """The ``generate --json`` object; the log-prob keys only when asked for."""
        out: dict[str, Any] = {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "prompt_token_ids": list(self.prompt_token_ids),
            "finish_reason": self.finish_reason,
            "telemetry": self.telemetry,
        }
        if include_logprobs:
            out["logprobs"] = [lp.to_json() for lp in self.logprobs]
        if include_prompt_logprobs:
            entries = self.prompt_logprobs
            if entries is None:
                entries = (None,) * len(self.prompt_token_ids)
            out["prompt_logprobs"] = [None if e is None else e.to_json() for e in entries]
        return out


@dataclass
class ResultBuilder:
    """Accumulates stream events into a `GenerateResult` (the one mutable helper here)."""

    request_id: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    token_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    logprobs: list[GeneratedLogprobs] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    finished: FinishedEvent | None = None

    def add(self, ev: GenerateEvent) -> None:
        if ev.request_id:
            self.request_id = ev.request_id
        if isinstance(ev, StartedEvent):
            self.prompt_token_ids = ev.prompt_token_ids
            self.prompt_logprobs = ev.prompt_logprobs
        elif isinstance(ev, TokenEvent):
            self.token_ids.append(ev.token_id)
            self.pieces.append(ev.text)
            self.logprobs.append(GeneratedLogprobs(ev.token_id, ev.logprob, ev.top))
            self.steps.append(ev.step)
        elif isinstance(ev, FinishedEvent):
            self.finished = ev

    def build(self) -> GenerateResult:
        """The result; a stream that ended without ``finished`` is reported as such."""
        fin = self.finished
        telemetry = dict(fin.telemetry) if fin else {}
        telemetry["steps"] = list(self.steps)
        return GenerateResult(
            text=fin.text if fin and fin.text else "".join(self.pieces),
            token_ids=tuple(self.token_ids),
            prompt_token_ids=self.prompt_token_ids,
            finish_reason=fin.finish_reason if fin else "incomplete",
            telemetry=telemetry,
            logprobs=tuple(self.logprobs),
            prompt_logprobs=self.prompt_logprobs,
            request_id=self.request_id,
        )


@dataclass(frozen=True)
class TenantUsage:
    """A tenant's current usage over all control-plane replicas (as of the last quota sync)."""

    in_flight: int = 0
    tokens_available: float = 0.0
    requests_available: float = 0.0
    requests_total: int = 0
    tokens_total: int = 0
    rejected_total: int = 0


@dataclass(frozen=True)
class Tenant:
    """A tenant: its settings (0: unlimited), how many API keys map to it, its usage."""

    name: str
    weight: float = 1.0
    priority: int = 0
    max_concurrent: int = 0
    tokens_per_minute: int = 0
    requests_per_minute: int = 0
    key_count: int = 0
    usage: TenantUsage = TenantUsage()

    @classmethod
    def from_proto(cls, t: control_plane_pb2.Tenant) -> Tenant:
        u = t.usage
        return cls(
            name=t.name,
            weight=t.weight,
            priority=t.priority,
            max_concurrent=t.max_concurrent,
            tokens_per_minute=t.tokens_per_minute,
            requests_per_minute=t.requests_per_minute,
            key_count=t.key_count,
            usage=TenantUsage(
                in_flight=u.in_flight,
                tokens_available=u.tokens_available,
                requests_available=u.requests_available,
                requests_total=u.requests_total,
                tokens_total=u.tokens_total,
                rejected_total=u.rejected_total,
            ),
        )

    def to_json(self) -> dict[str, Any]:
        """The ``tenants … --json`` object (the HTTP front's ``/v1/tenants`` shape): settings,
        ``key_count`` and ``usage`` (bucket levels rounded to 3 decimals)."""
        usage = {f.name: getattr(self.usage, f.name) for f in fields(self.usage)}
        for k in ("tokens_available", "requests_available"):
            usage[k] = round(usage[k], 3)
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "usage"}
        return {**out, "usage": usage}
