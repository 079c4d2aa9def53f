"""GGUF block dequantization with torch ops, on any device (CPU for tests, CUDA at load).

A tensor's raw block bytes (``TensorRecord.raw``) go to the device once, `CHUNK_ELEMS` values
at a time, and are dequantized there in one pass into a preallocated tensor of the compute
dtype, each block type's fields unpacked with shifts and masks on whole tensors (no Python loop
over blocks). The f32 result equals ``loraplane.formats.gguf.reader.dequantize`` bit for bit; f16 / bf16
is that value rounded once. Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to Q6_K, F32, F16, BF16
(`PLAIN_DTYPES`).

The block layouts and the arithmetic: docs/gpu.md, "Inside the GPU engine" (Dequantization at
load).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from loraplane.formats.gguf.reader import GGUFError, TensorRecord

QK_K = 256

CHUNK_ELEMS = 1 << 24
"""Values dequantized per chunk (16 Mi): the f32 intermediates of one chunk are a few times
64 MiB, small beside a 3 GB output, and large enough that each torch op is one long launch."""

PLAIN_DTYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
"""Float storage types: the raw bytes viewed as this dtype, then cast (no f32 intermediate)."""


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian f16 at byte ``at`` of each block, as f32 ``(n, 1)``."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).to(torch.float32)


def _shifts(values: list[int], like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """uint8 shift amounts ``values`` shaped ``shape`` for broadcasting against ``like``, made
    once per device: a fresh ``torch.tensor`` on CUDA is a synchronous host-to-device copy that
    would stall the host on every chunk until the queued dequantization had run."""
    return _shift_tensor(tuple(values), shape, like.device)


@functools.lru_cache(maxsize=64)
def _shift_tensor(values: tuple[int, ...], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device).reshape(shape)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 ``(n, m)`` packed 4-bit values → ``(n, 2m)``: per run of ``group`` bytes, the low
    nibbles first, then the high ones (ggml's order in every 4-bit format)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group) >> _shifts([0, 4], qs, (1, 1, 2, 1))
    return (q & 0x0F).reshape(n, -1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """uint8 ``(n, m)`` bit planes → ``(n, 8, m)``: ``[:, j, l]`` is bit ``j`` of byte ``l``."""
    return (qh.unsqueeze(1) >> _shifts(list(range(8)), qh, (1, 8, 1))) & 1


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:18], 16).to(torch.float32) - 8
    return d * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:20], 16).to(torch.float32)
    return d * q + m


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """The 32 fifth bits of a Q5_0/Q5_1 block from its 4 ``qh`` bytes (a little-endian u32 whose
    bit ``j`` belongs to element ``j``) → uint8 ``(n, 32)`` of 0/16."""
    n = qh.shape[0]
    bits = (qh.unsqueeze(-1) >> _shifts(list(range(8)), qh, (1, 1, 8))) & 1  # (n, byte, bit)
    return bits.reshape(n, 32) << 4


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = (_nibbles(b[:, 6:22], 16) | _q5_high(b[:, 2:6])).to(torch.float32) - 16
    return d * q


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = (_nibbles(b[:, 8:24], 16) | _q5_high(b[:, 4:8])).to(torch.float32)
    return d * q + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return b[:, 2:34].view(torch.int8).to(torch.float32) * d


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs = b[:, 0:16], b[:, 16:80]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    # per 128 values, 32 bytes: the 2-bit fields at shifts 0, 2, 4, 6 are 4 runs of 32
    q = (qs.reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], b, (1, 1, 4, 1))) & 3
    q = q.reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, sc = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    # 16 6-bit scales: low 4 bits from bytes 0-7 (nibbles), high 2 bits from bytes 8-11 (pairs)
    lo = (sc[:, 0:8].reshape(n, 1, 8) >> _shifts([0, 4], b, (1, 2, 1))).reshape(n, 16) & 0x0F
    hi = (sc[:, 8:12].reshape(n, 1, 4) >> _shifts([0, 2, 4, 6], b, (1, 4, 1))).reshape(n, 16) & 0x03
    scale = ((lo | (hi << 4)).to(torch.float32) - 32).reshape(n, 16, 1)
    dl = d.reshape(n, 1, 1) * scale
    ql = ((qs.reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], b, (1, 1, 4, 1))) & 3).reshape(n, 16, 16)
    # the high bit set means +0, clear means -4 (ggml: ``(hm & m) ? 0 : 4``)
    qh = (hmask.reshape(n, 1, 1, 32) >> _shifts(list(range(8)), b, (1, 1, 8, 1))) & 1
    qh = qh.reshape(n, 16, 16) ^ 1
    q = ql.to(torch.float32) - (qh << 2).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


def _scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes → (scale, min) uint8 ``(n, 8)`` each, 6 bits: sub-blocks 0-3
    hold them in the low 6 bits of bytes 0-3 / 4-7; 4-7 split them between the nibbles of bytes
    8-11 and the top 2 bits of bytes 0-3 / 4-7 (ggml ``get_scale_min_k4``)."""
    s = sc.reshape(-1, 3, 4)
    d_, m_, md = s[:, 0], s[:, 1], s[:, 2]
    scale = torch.cat([d_ & 0x3F, (md & 0x0F) | ((d_ >> 2) & 0x30)], dim=1)
    mn = torch.cat([m_ & 0x3F, (md >> 4) | ((m_ >> 2) & 0x30)], dim=1)
    return scale, mn


def _k4_affine(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K per-sub-block ``d·sc`` and ``dmin·m``, f32 ``(n, 8, 1)`` each."""
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    scale, mn = _scale_min_k4(b[:, 4:16])
    dl = (d * scale.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    return dl, ml


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    dl, ml = _k4_affine(b)
    q = _nibbles(b[:, 16:144], 32).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    dl, ml = _k4_affine(b)
    ql = _nibbles(b[:, 48:176], 32).reshape(n, 8, 32)
    q = (ql | (_bits(b[:, 16:48]) << 4)).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, sc = b[:, 0:128], b[:, 128:192], b[:, 192:208]
    d = _f16(b, 208)
    dl = (d * sc.view(torch.int8).to(torch.float32)).reshape(n, 16, 1)
    lo = _nibbles(ql, 64).reshape(n, 8, 32)
    hi = ((qh.reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], b, (1, 1, 4, 1))) & 3).reshape(n, 8, 32)
    q = (lo | (hi << 4)).to(torch.float32) - 32
    return (dl * q.reshape(n, 16, 16)).reshape(n, QK_K)


_BLOCK_FNS: dict[T, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}

DEVICE_DEQUANT_TYPES = frozenset(PLAIN_DTYPES) | frozenset(_BLOCK_FNS)
"""Every GGUF type this module dequantizes (the reader's ``FLOAT_TYPES`` and
``SUPPORTED_QUANT_TYPES``)."""


def _check_type(ggml_type: T, name: str = "") -> None:
    if ggml_type not in DEVICE_DEQUANT_TYPES:
        what = f"tensor '{name}': " if name else ""
        supported = ", ".join(sorted(t.name for t in DEVICE_DEQUANT_TYPES))
        raise GGUFError(f"{what}type {ggml_type.name} has no device dequantizer (supported: {supported})")


def dequantize_blocks(blocks: torch.Tensor, ggml_type: T) -> torch.Tensor:
    """Dequantize whole blocks of a block-quantized type.

    Args:
        blocks: uint8 ``(n_blocks, type_size)`` (e.g. ``(n, 144)`` for Q4_K), on any device.
        ggml_type: one of the block types of :data:`DEVICE_DEQUANT_TYPES` (not F32/F16/BF16).
    Returns:
        f32 ``(n_blocks, block_size)`` on ``blocks``' device, equal bit for bit to gguf-py's
        ``quants.dequantize`` of the same bytes.
    Raises:
        GGUFError: a type with no block rule here.
        ValueError: ``blocks`` not uint8 ``(n, type_size)``.
    """
    fn = _BLOCK_FNS.get(ggml_type)
    if fn is None:
        _check_type(ggml_type)
        raise GGUFError(f"type {ggml_type.name} is not block-quantized")
    type_size = GGML_QUANT_SIZES[ggml_type][1]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != type_size:
        raise ValueError(
            f"{ggml_type.name} blocks must be uint8 (n, {type_size}), got {blocks.dtype} {tuple(blocks.shape)}"
        )
    return fn(blocks)


def dequantize_rows(raw: torch.Tensor, ggml_type: T, k: int) -> torch.Tensor:
    """Dequantize rows of raw GGUF bytes to f32.

    Args:
        raw: uint8 ``(m, row_bytes)`` (``row_bytes = k / block_size * type_size``), any device.
        ggml_type: any of :data:`DEVICE_DEQUANT_TYPES`.
        k: values per row (ggml ``ne[0]``).
    Returns:
        f32 ``(m, k)`` on ``raw``'s device (a float type's values widened exactly).
    Raises:
        GGUFError: an unsupported type.
        ValueError: ``raw`` is not uint8 ``(m, row_bytes)``, or ``k`` not a multiple of the block.
    """
    _check_type(ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if k % block_size:
        raise ValueError(f"{ggml_type.name}: row length {k} is not a multiple of its block size {block_size}")
    row_bytes = k // block_size * type_size
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes:
        raise ValueError(f"{ggml_type.name} rows of {k} must be uint8 (m, {row_bytes}), got {tuple(raw.shape)}")
    m = raw.shape[0]
    plain = PLAIN_DTYPES.get(ggml_type)
    if plain is not None:
        return raw.contiguous().view(plain).to(torch.float32)
    return dequantize_blocks(raw.reshape(m * (k // block_size), type_size), ggml_type).reshape(m, k)


class Uploader:
    """Moves chunks of a GGUF's mapped bytes to ``device``: on CUDA through two pinned staging
    buffers used in turn (the host copy of the next chunk overlaps the upload and dequantization
    of this one; an event per buffer says when it may be refilled); on CPU a plain copy (the
    file's pages are mapped read-only, and torch tensors must own writable memory).

    One uploader serves a whole model load (pinned allocations are slow; its buffers grow to
    the largest chunk seen and are freed with it).
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.bytes_uploaded = 0

    def upload(self, host: np.ndarray) -> torch.Tensor:
        """A uint8 tensor on ``device`` with the bytes of ``host`` (a uint8 numpy array, any
        shape, C-contiguous or not), same shape."""
        self.bytes_uploaded += host.nbytes
        if not self._cuda:
            return torch.from_numpy(np.array(host, dtype=np.uint8, copy=True)).to(self.device)
        i, self._turn = self._turn, 1 - self._turn
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()  # the previous upload out of this buffer is done
        buf = self._bufs[i]
        if buf is None or buf.numel() < host.nbytes:
            buf = self._bufs[i] = torch.empty(max(host.nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
        stage = buf[: host.nbytes]
        np.copyto(stage.numpy().reshape(host.shape), host)
        out = stage.reshape(host.shape).to(self.device, non_blocking=True)
        ev = self._events[i] = torch.cuda.Event()
        ev.record()
        return out


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """``t`` is on ``device`` (a device named without an index, ``cuda``, means any of its type)."""
    return t.device.type == device.type and (device.index is None or t.device.index in (None, device.index))


def dequantize_tensor(
    rec: TensorRecord,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    uploader: Uploader | None = None,
    chunk_elems: int = CHUNK_ELEMS,
) -> torch.Tensor:
    """One GGUF tensor dequantized on ``device`` to ``dtype`` from its raw bytes.

    The bytes are uploaded once, ``chunk_elems // k`` rows at a time (at least one row), and
    each chunk is dequantized into its rows of the output, so the device holds the output plus
    one chunk's bytes and f32 intermediates at any time.

    Args:
        rec: the tensor (``rec.raw`` its mapped bytes, any reader form: byte rows for block
            types and BF16, float arrays for F32/F16).
        device: where the output lives and the arithmetic runs.
        dtype: output dtype (f32, bf16 or f16); values are the f32 dequantization rounded once.
        out: optional destination, ``rec.shape`` (torch order), ``dtype``, on ``device``, rows
            contiguous (a row slice of a larger tensor is fine: fused projections load into
            their slices of one tensor).
        uploader: shared staging for a whole load (default: one for this call).
        chunk_elems: values per chunk.
    Returns:
        ``out`` or a new tensor, torch order ``rec.shape``.
    Raises:
        GGUFError: a type with no device dequantizer (names the tensor).
        ValueError: ``out`` of another shape, dtype or device, or not contiguous.
    """
    _check_type(rec.ggml_type, rec.name)
    dev = torch.device(device)
    shape = tuple(int(n) for n in reversed(rec.ne))
    k = int(rec.ne[0]) if rec.ne else 1
    n_rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=dev)
    elif tuple(out.shape) != shape or out.dtype != dtype or not _on(out, dev) or not out.is_contiguous():
        raise ValueError(
            f"{rec.name}: out is {out.dtype} {tuple(out.shape)} on {out.device} (contiguous: {out.is_contiguous()}), "
            f"expected {dtype} {shape} on {dev}"
        )
    up = uploader if uploader is not None else Uploader(out.device)
    raw = np.ascontiguousarray(rec.raw).view(np.uint8).reshape(n_rows, -1)
    rows = out.view(n_rows, k)
    plain = PLAIN_DTYPES.get(rec.ggml_type)
    step = max(1, chunk_elems // max(k, 1))
    for r0 in range(0, n_rows, step):
        r1 = min(n_rows, r0 + step)
        chunk = up.upload(raw[r0:r1])
        if plain is not None:  # one cast from the stored float type
            rows[r0:r1].copy_(chunk.view(plain))
        else:
            rows[r0:r1].copy_(dequantize_rows(chunk, rec.ggml_type, k))
    return out


__all__ = [
    "CHUNK_ELEMS",
    "DEVICE_DEQUANT_TYPES",
    "PLAIN_DTYPES",
    "Uploader",
    "dequantize_blocks",
    "dequantize_rows",
    "dequantize_tensor",
]
