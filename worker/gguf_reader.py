"""Read a GGUF file into plain records: metadata key/values and a tensor index.

Knows no model and no adapter; `worker.model` and `worker.adapters` build on it.

Dimension order: ggml lists the fastest dimension first (``ne``); numpy and torch list it
last. A tensor with ``ne = [k, d]`` is a numpy/torch array of shape ``(d, k)``. Every
record keeps both so callers never have to reverse by hand.

Rule source: the GGUF format (ggml ``docs/gguf.md``) as read by the ``gguf`` package's
``GGUFReader``; which quant types we accept mirrors what ``gguf.quants.dequantize``
implements in numpy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, quants

# Types we turn into float: plain floats plus every block format gguf's numpy code handles.
FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
SUPPORTED_QUANT_TYPES = {
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
}


class GGUFError(ValueError):
    """A GGUF file cannot be used: not GGUF, truncated, or holding something we do not support.

    The message always names the file and, where one is at fault, the key or tensor.
    """


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of a GGUF file, not yet converted.

    Attributes:
        name: GGUF tensor name, e.g. ``blk.0.attn_q.weight``.
        ggml_type: storage type (F32, Q4_K, ...).
        ne: ggml shape, fastest dimension first (``ne[0]`` = row length).
        raw: the bytes as the reader mapped them (numpy view into the file).
    """

    name: str
    ggml_type: GGMLQuantizationType
    ne: tuple[int, ...]
    raw: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy/torch shape: ``ne`` reversed."""
        return tuple(reversed(self.ne))

    @property
    def n_bytes(self) -> int:
        return int(self.raw.nbytes)


@dataclass(frozen=True)
class GGUFFile:
    """Metadata and tensor index of one GGUF file."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorRecord]

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        """Metadata value for ``key``; raises GGUFError naming the file and key when absent."""
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: missing metadata key '{key}'")
        return self.metadata[key]


def _field_value(field: Any) -> Any:
    """Plain Python value of a reader field (arrays as lists, strings decoded)."""
    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]].tolist()[0]
    return value


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor index (tensor data stays mapped).

    Raises:
        GGUFError: missing file, bad magic (not GGUF), or truncated/corrupt content; the
            message names the file.
    """
    p = Path(path)
    if not p.is_file():
        raise GGUFError(f"{p}: no such file")
    with open(p, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{p}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = GGUFReader(p, "r")
    except Exception as exc:  # the reader raises bare ValueError/IndexError on truncation
        raise GGUFError(f"{p}: truncated or corrupt GGUF ({type(exc).__name__}: {exc})") from exc
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        metadata[key] = _field_value(field)
    tensors: dict[str, TensorRecord] = {}
    for t in reader.tensors:
        ne = tuple(int(n) for n in t.shape.tolist())
        tensors[t.name] = TensorRecord(t.name, GGMLQuantizationType(t.tensor_type), ne, t.data)
    return GGUFFile(p, metadata, tensors)


def dequantize(path: Path | str, rec: TensorRecord) -> np.ndarray:
    """Float32 numpy array of ``rec``, numpy shape ``rec.shape`` (= reversed ``ne``).

    Raises:
        GGUFError: the tensor's type is not one we can dequantize (names file, tensor, type).
    """
    t = rec.ggml_type
    if t == GGMLQuantizationType.F32:
        out = np.asarray(rec.raw, dtype=np.float32)
    elif t == GGMLQuantizationType.F16:
        out = np.asarray(rec.raw, dtype=np.float16).astype(np.float32)
    elif t == GGMLQuantizationType.BF16 or t in SUPPORTED_QUANT_TYPES:
        out = quants.dequantize(rec.raw, t)
    else:
        raise GGUFError(
            f"{path}: tensor '{rec.name}' has unsupported type {t.name} "
            f"(supported: F32, F16, BF16, {', '.join(sorted(q.name for q in SUPPORTED_QUANT_TYPES))})"
        )
    return out.reshape(rec.shape)
