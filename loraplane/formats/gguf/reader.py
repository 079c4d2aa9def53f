"""Read a GGUF file into plain records: metadata key/values and a tensor index.

Knows no model and no adapter; `worker.runtime.model` and `worker.lora.adapter` build on it.

Dimension order: ggml lists the fastest dimension first (``ne``); numpy and torch list it
last. A tensor with ``ne = [k, d]`` is a numpy/torch array of shape ``(d, k)``. Every
record keeps both so callers never have to reverse by hand.

Rule source: the GGUF format (ggml ``docs/gguf.md``); the type tables and the block
dequantizers come from the ``gguf`` package (which quant types we accept mirrors what
``gguf.quants.dequantize`` implements in numpy).
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, quants
from gguf.quants import quant_shape_to_byte_shape

# Types we turn into float: plain floats plus every block format gguf's numpy code handles.
FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
SUPPORTED_QUANT_TYPES = {
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q3_K,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
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
        offset: absolute byte offset of the data in the file (-1: not from a file).
    """

    name: str
    ggml_type: GGMLQuantizationType
    ne: tuple[int, ...]
    raw: np.ndarray
    offset: int = -1

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


# GGUF scalar value types → struct format (docs/gguf.md "gguf_metadata_value_type").
_SCALAR_FMT = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NP_DTYPE = {
    GGUFValueType.UINT8: np.uint8,
    GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32,
    GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32,
    GGUFValueType.BOOL: np.bool_,
    GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT64: np.float64,
}
_PLAIN_TENSOR_DTYPE = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class _Cursor:
    """Little-endian reader over the file's bytes; raises IndexError past the end."""

    def __init__(self, buf: memoryview):
        self.buf = buf
        self.off = 0

    def scalar(self, vtype: GGUFValueType) -> Any:
        fmt = _SCALAR_FMT[vtype]
        size = struct.calcsize(fmt)
        if self.off + size > len(self.buf):
            raise IndexError(f"read past end of file at offset {self.off}")
        (v,) = struct.unpack_from(fmt, self.buf, self.off)
        self.off += size
        return v

    def string(self) -> str:
        n = self.scalar(GGUFValueType.UINT64)
        if self.off + n > len(self.buf):
            raise IndexError(f"string of {n} bytes runs past end of file at offset {self.off}")
        v = bytes(self.buf[self.off : self.off + n]).decode("utf-8", errors="replace")
        self.off += n
        return v

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            itype = GGUFValueType(self.scalar(GGUFValueType.UINT32))
            n = self.scalar(GGUFValueType.UINT64)
            if itype == GGUFValueType.STRING:
                return [self.string() for _ in range(n)]
            if itype == GGUFValueType.ARRAY:
                return [self.value(GGUFValueType.ARRAY) for _ in range(n)]
            dt = np.dtype(_NP_DTYPE[itype]).newbyteorder("<")
            end = self.off + n * dt.itemsize
            if end > len(self.buf):
                raise IndexError(f"array of {n} items runs past end of file at offset {self.off}")
            arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.off)
            self.off = end
            return arr.tolist()
        return self.scalar(vtype)


def _parse(path: Path, data: np.ndarray) -> tuple[dict[str, Any], dict[str, TensorRecord]]:
    """Parse header, key/values and tensor infos (docs/gguf.md, versions 2 and 3).

    Why not ``gguf.GGUFReader``: it builds a numpy view for every array element, which for a
    262k-token vocabulary takes 10–40 s on two cores; this reads the same layout in well under
    a second and hands tensor data out as views of the same memory map.
    """
    cur = _Cursor(memoryview(data))  # type: ignore[arg-type]  # np.memmap is a buffer
    cur.off = 4
    version = cur.scalar(GGUFValueType.UINT32)
    if version not in (2, 3):
        raise GGUFError(f"{path}: unsupported GGUF version {version} (expected 2 or 3)")
    n_tensors = cur.scalar(GGUFValueType.UINT64)
    n_kv = cur.scalar(GGUFValueType.UINT64)
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(GGUFValueType(cur.scalar(GGUFValueType.UINT32)))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar(GGUFValueType.UINT32)
        ne = tuple(int(cur.scalar(GGUFValueType.UINT64)) for _ in range(n_dims))
        gtype = GGMLQuantizationType(cur.scalar(GGUFValueType.UINT32))
        offset = cur.scalar(GGUFValueType.UINT64)
        infos.append((name, ne, gtype, offset))
    align = int(metadata.get("general.alignment", 32))
    if align <= 0 or align & (align - 1):
        raise GGUFError(f"{path}: general.alignment {align} is not a power of two")
    start = cur.off + (-cur.off) % align
    tensors: dict[str, TensorRecord] = {}
    for name, ne, gtype, offset in infos:
        if name in tensors:
            raise GGUFError(f"{path}: duplicate tensor '{name}'")
        block, type_size = GGML_QUANT_SIZES[gtype]
        n_elems = int(np.prod(ne)) if ne else 1
        n_bytes = n_elems * type_size // block
        lo = start + offset
        if lo + n_bytes > data.shape[0]:
            raise GGUFError(
                f"{path}: tensor '{name}' data runs past the end of the file "
                f"(needs bytes {lo}..{lo + n_bytes}, file has {data.shape[0]}): truncated or corrupt GGUF"
            )
        shape = tuple(reversed(ne))
        if gtype in _PLAIN_TENSOR_DTYPE:
            raw = data[lo : lo + n_bytes].view(_PLAIN_TENSOR_DTYPE[gtype]).reshape(shape)
        else:
            raw = data[lo : lo + n_bytes].reshape(quant_shape_to_byte_shape(shape, gtype))
        tensors[name] = TensorRecord(name, gtype, ne, raw, lo)
    return metadata, tensors


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
    data = np.memmap(p, mode="r")
    try:
        metadata, tensors = _parse(p, data)
    except GGUFError:
        raise
    except (IndexError, ValueError, KeyError, struct.error) as exc:
        raise GGUFError(f"{p}: truncated or corrupt GGUF ({type(exc).__name__}: {exc})") from exc
    return GGUFFile(p, metadata, tensors)


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes (adapter and model identity: content, never the name)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_tensor(
    fh: io.BufferedIOBase, path: Path | str, ggml_type: GGMLQuantizationType, ne: tuple[int, ...], offset: int
) -> np.ndarray:
    """Read one tensor's data with plain reads (no mapping kept): F32/F16 in their own dtype,
    every other supported type dequantized to f32; numpy shape = reversed ``ne``.

    Used to re-read a validated adapter's tensors at page-in (``worker.lora.adapter``): a
    read of a file that shrank since raises instead of faulting the way a stale mapping does.

    Raises:
        GGUFError: short read (the file changed), or a type we cannot convert.
    """
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    n_elems = int(np.prod(ne)) if ne else 1
    n_bytes = n_elems * type_size // block
    fh.seek(offset)
    raw_buf = bytearray(n_bytes)
    got = fh.readinto(raw_buf)
    buf = np.frombuffer(raw_buf, dtype=np.uint8)
    if got != n_bytes:
        raise GGUFError(f"{path}: tensor data at offset {offset} is truncated ({got} of {n_bytes} bytes)")
    shape = tuple(reversed(ne))
    if ggml_type == GGMLQuantizationType.F32:
        return buf.view(np.float32).reshape(shape)
    if ggml_type == GGMLQuantizationType.F16:
        return buf.view(np.float16).reshape(shape)
    rec = TensorRecord("", ggml_type, ne, buf.reshape(quant_shape_to_byte_shape(shape, ggml_type)), offset)
    return dequantize(path, rec)


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
