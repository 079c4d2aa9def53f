"""Building the request messages the client sends (shared by the sync and async clients).

The one subtle rule lives in `adapter_map_into`: ``adapters=None`` leaves
``GenerateRequest.adapters`` unset (the control plane uses its default set), while
``adapters={}`` sets an *empty* ``AdapterMap`` (explicitly no adapters). proto3 keeps the two
apart only because the map is wrapped in a message field, so the empty case must mark the
field present (``SetInParent``) rather than add nothing.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from loraplane.limits import CHUNK_BYTES
from loraplane.v1 import common_pb2

AdapterMapping = Mapping[int, float] | Mapping[str, float] | Mapping[int | str, float]
"""``{adapter: scale}`` a caller asks for: each adapter by id (int) or by name / alias (str),
zeros kept (the wire's ``AdapterMap``; the control plane resolves it into the product's
``AdapterScales``)."""

# Data chunk size of adapter uploads: well under gRPC's 4 MiB default message limit.


def adapter_ref(adapter: int | str) -> common_pb2.AdapterRef:
    """An `AdapterRef` by id (an int) or by name / alias (a str, resolved by the control plane;
    ASCII digits there read as an id)."""
    if isinstance(adapter, str):
        if not adapter:
            raise ValueError("adapter name must not be empty")
        return common_pb2.AdapterRef(name=adapter)
    if isinstance(adapter, bool) or not isinstance(adapter, int) or adapter < 0:
        raise ValueError(f"adapter id must be a non-negative integer or a name, got {adapter!r}")
    return common_pb2.AdapterRef(id=adapter)


def adapter_map(scales: AdapterMapping) -> common_pb2.AdapterMap:
    """An `AdapterMap` with one entry per adapter: ids (ints) in id order, then names (strs,
    resolved by the control plane) in the order given. Validates ids and scales."""
    amap = common_pb2.AdapterMap()
    ordered: list[tuple[int | str, float]] = sorted((k, v) for k, v in scales.items() if not isinstance(k, str))
    ordered += [(k, v) for k, v in scales.items() if isinstance(k, str)]
    for adapter, scale in ordered:
        ref = adapter_ref(adapter)
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale of adapter {adapter!r} must be finite, got {scale!r}")
        if ref.name:  # the id field stays absent: a name entry carries the name only
            amap.entries.add(name=ref.name, scale=scale)
        else:
            amap.entries.add(id=ref.id, scale=scale)
    return amap


def adapter_map_into(req: common_pb2.GenerateRequest, adapters: AdapterMapping | None) -> None:
    """Set ``req.adapters``: None leaves it unset, a mapping (even empty) sets it."""
    if adapters is None:
        return
    req.adapters.SetInParent()  # present even when there are no entries
    req.adapters.MergeFrom(adapter_map(adapters))


def generate_request(
    prompt: str | None = None,
    *,
    prompt_tokens: Sequence[int] | None = None,
    adapters: AdapterMapping | None = None,
    max_tokens: int = 16,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    logprobs: int = 0,
    prompt_logprobs: bool = False,
    ignore_eos: bool = False,
    request_id: str = "",
    stop: Sequence[str] = (),
    json_schema: Mapping[str, Any] | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    grammar: str | None = None,
    strict: bool = False,
) -> common_pb2.GenerateRequest:
    """A `GenerateRequest` from keyword arguments (exactly one of ``prompt``/``prompt_tokens``).
    ``min_p`` and the penalties follow vLLM (``repetition_penalty`` 1 and the others 0: off);
    the worker range-checks them (INVALID_ARGUMENT naming the field).

    Structured output (at most one): ``json_schema`` (a schema dict or its JSON text; ``strict``:
    no properties beyond the listed ones), ``json_object`` (any JSON object), ``regex``,
    ``grammar`` (Lark, or llama.cpp GBNF). The server compiles it: a bad one is INVALID_ARGUMENT.
    """
    if (prompt is None) == (prompt_tokens is None):
        raise ValueError("give exactly one of prompt (text) or prompt_tokens (ids)")
    req = common_pb2.GenerateRequest(request_id=request_id)
    if prompt is not None:
        req.text = prompt
    else:
        tokens = list(prompt_tokens or ())
        if not tokens:
            raise ValueError("prompt_tokens must not be empty")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in tokens):
            raise ValueError(f"prompt_tokens must be non-negative integers, got {tokens!r}")
        req.tokens.ids.extend(tokens)
    adapter_map_into(req, adapters)
    if max_tokens < 0 or top_k < 0 or logprobs < 0:
        raise ValueError("max_tokens, top_k and logprobs must be non-negative")
    sampling = req.sampling
    sampling.max_tokens = max_tokens
    sampling.temperature = temperature
    sampling.top_k = top_k
    sampling.top_p = top_p
    sampling.min_p = min_p
    sampling.presence_penalty = presence_penalty
    sampling.frequency_penalty = frequency_penalty
    sampling.repetition_penalty = repetition_penalty
    if seed is not None:
        sampling.seed = seed
    sampling.logprobs = logprobs
    sampling.prompt_logprobs = prompt_logprobs
    sampling.ignore_eos = ignore_eos
    if isinstance(stop, str):
        raise ValueError("stop must be a sequence of strings, not one string")
    if any(not isinstance(s, str) or not s for s in stop):
        raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
    sampling.stop.extend(stop)
    formats = [
        (common_pb2.ResponseFormat.TYPE_JSON_SCHEMA, json_schema is not None),
        (common_pb2.ResponseFormat.TYPE_JSON_OBJECT, json_object),
        (common_pb2.ResponseFormat.TYPE_REGEX, regex is not None),
        (common_pb2.ResponseFormat.TYPE_GRAMMAR, grammar is not None),
    ]
    chosen = [t for t, on in formats if on]
    if len(chosen) > 1:
        raise ValueError("give at most one of json_schema, json_object, regex, grammar")
    if chosen:
        rf = sampling.response_format
        rf.type = chosen[0]
        if json_schema is not None:
            rf.schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
            rf.strict = strict
        rf.regex = regex or ""
        rf.grammar = grammar or ""
    return req


def upload_chunks(
    path: str | os.PathLike[str],
    *,
    name: str | None = None,
    server_path: bool = False,
    source_format: str = "",
    progress: Callable[[int, int], None] | None = None,
) -> Iterator[common_pb2.AdapterChunk]:
    """The `AdapterChunk` stream of a ``RegisterAdapter`` call.

    ``server_path=True``: one chunk naming a file the server reads itself (no bytes sent).
    Otherwise the first chunk carries the header fields (name) with the first piece of the
    file, and the rest follows in `CHUNK_BYTES` pieces, read lazily so big files are
    never held whole in memory. ``source_format`` ("peft" for a converted folder) rides on the
    first chunk; ``progress(bytes_sent, total_bytes)`` is called after each chunk.
    """
    if server_path:
        yield common_pb2.AdapterChunk(name=name or "", server_path=os.fspath(path))
        return
    total = Path(path).stat().st_size
    sent = 0
    with Path(path).open("rb") as f:
        data = f.read(CHUNK_BYTES)
        yield common_pb2.AdapterChunk(name=name or "", data=data, source_format=source_format)
        sent += len(data)
        if progress is not None:
            progress(sent, total)
        while data := f.read(CHUNK_BYTES):
            yield common_pb2.AdapterChunk(data=data)
            sent += len(data)
            if progress is not None:
                progress(sent, total)


TENANT_LIMIT_FIELDS = ("weight", "priority", "max_concurrent", "tokens_per_minute", "requests_per_minute")


def tenant_limits(settings: Mapping[str, float | int | None]) -> Any:
    """A ``TenantLimits`` with the settings given (None or absent: unset, so the control plane
    keeps the value or takes the default).

    Raises:
        ValueError: an unknown setting name.
    """
    from loraplane.v1 import control_plane_pb2

    unknown = set(settings) - set(TENANT_LIMIT_FIELDS)
    if unknown:
        raise ValueError(f"unknown tenant settings {sorted(unknown)} (known: {', '.join(TENANT_LIMIT_FIELDS)})")
    given: dict[str, Any] = {k: v for k, v in settings.items() if v is not None}
    return control_plane_pb2.TenantLimits(**given)
