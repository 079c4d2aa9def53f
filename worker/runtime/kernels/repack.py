"""Repack GGUF block-quantized rows into one exact affine int form (numpy, at load time).

Every supported block type (`REPACK_TYPES`) is, per sub-block of 16 or 32 elements, an affine
map of a small integer, ``w = s * u + c``. `decode` turns a tensor's GGUF bytes into that form
(an `Affine`: ``u`` integers, ``s`` scales, ``c`` offsets where they are not a fixed multiple of
``s``), exact: ``s * u + c`` in f32 equals ``gguf.quants.dequantize`` bit for bit.
`interleave` interleaves `R` (16) rows for the kernels. Shapes are torch order: a weight with
ggml ``ne = [k, d]`` is ``d`` rows of ``k`` elements.

The per-type table and why the form is exact: ``worker/runtime/kernels/README.md``, "Weight
form".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

QK_K = 256
R = 16  # rows per interleaved group (one zmm of 16 x 4 bytes; two ymm halves on AVX2)

REPACK_TYPES = {T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K}


@dataclass(frozen=True)
class Affine:
    """Decoded rows: ``W[r, b*bs + j] = s[r, b] * u[r, b*bs + j] + c[r, b]``.

    Attributes:
        u: uint8 ``(d, k)`` integer values (int8 bit patterns when ``signed``).
        s: f32 ``(d, k/bs)``.
        c: f32 ``(d, k/bs)``, or None when ``c = offset * s`` (0 for the signed Q8_0 form).
        bs: sub-block size, 16 or 32.
        signed: True when ``u`` holds int8 values (Q8_0).
        offset: the implicit ``c / s`` when ``c`` is None.
    """

    u: np.ndarray
    s: np.ndarray
    c: np.ndarray | None
    bs: int
    signed: bool
    offset: float = 0.0


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """(N, 16) bytes -> (N, 32): low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _qh_bits(qh: np.ndarray) -> np.ndarray:
    """(N, 4) bytes of a little-endian uint32 -> (N, 32) bits (bit j = element j)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12-byte packed 6-bit scales and mins -> two (N, 8) uint8 arrays
    (ggml-quants.c ``get_scale_min_k4``)."""
    sc3 = scales.reshape(-1, 3, 4)
    d, m, md = sc3[:, 0], sc3[:, 1], sc3[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode(raw: np.ndarray, gtype: T, d: int, k: int) -> Affine:
    """Decode a quantized tensor's bytes into the affine form.

    Args:
        raw: uint8 bytes of the tensor, any shape with ``d * k / block * type_size`` bytes.
        gtype: its GGML type (one of ``REPACK_TYPES``).
        d, k: rows and row length (ggml ``ne = [k, d]``).

    Raises:
        ValueError: unsupported type, or ``k`` not a multiple of the type's block size.
    """
    if gtype not in REPACK_TYPES:
        raise ValueError(f"no repack rule for GGML type {gtype.name}")
    blk, tsz = GGML_QUANT_SIZES[gtype]
    if k % blk:
        raise ValueError(f"{gtype.name}: row length {k} is not a multiple of its block size {blk}")
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, tsz)
    nblk = b.shape[0]
    if nblk != d * (k // blk):
        raise ValueError(f"{gtype.name}: {nblk} blocks for a ({d}, {k}) tensor")
    if gtype == T.Q8_0:
        s = _f16(b[:, :2])
        u, c, bs, signed = b[:, 2:], None, 32, True
    elif gtype in (T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1):
        s = _f16(b[:, :2])
        if gtype in (T.Q4_1, T.Q5_1):
            c = _f16(b[:, 2:4])
            rest = b[:, 4:]
        else:
            rest = b[:, 2:]
        if gtype in (T.Q5_0, T.Q5_1):
            u = _nibbles32(rest[:, 4:]) | (_qh_bits(rest[:, :4]) << 4)
        else:
            u = _nibbles32(rest)
        if gtype in (T.Q4_0, T.Q5_0):
            c, offset = None, (-8.0 if gtype == T.Q4_0 else -16.0)
        bs, signed = 32, False
    elif gtype in (T.Q4_K, T.Q5_K):
        dd, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _k_scale_min(b[:, 4:16])
        s = dd * sc.astype(np.float32)  # (N, 8)
        c = -(dmin * mn.astype(np.float32))  # (N, 8)
        if gtype == T.Q4_K:
            qs = b[:, 16:144].reshape(-1, 4, 32)  # 4 chunks of 32 bytes -> sub-blocks 2j, 2j+1
        else:
            qs = b[:, 48:176].reshape(-1, 4, 32)
        u = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, QK_K)
        if gtype == T.Q5_K:
            qh = b[:, 16:48]  # bit i of qh[l] -> high bit of sub-block i, elem l
            hb = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            u = (u | (hb.reshape(-1, QK_K) << 4)).astype(np.uint8)
        bs, signed = 32, False
    else:  # Q6_K: ql 128, qh 64, scales 16 (int8), d f16
        ql, qh = b[:, :128], b[:, 128:192]
        sc = b[:, 192:208].view(np.int8).astype(np.float32)
        dd = _f16(b[:, 208:210])
        lo = np.stack([ql.reshape(-1, 2, 64) & 0x0F, ql.reshape(-1, 2, 64) >> 4], axis=2).reshape(-1, 8, 32)
        hi = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        u = (lo | (hi.reshape(-1, 8, 32) << 4)).reshape(-1, QK_K)
        s = dd * sc  # (N, 16)
        c, offset = None, -32.0
        bs, signed = 16, False
    if gtype not in (T.Q4_0, T.Q5_0, T.Q6_K):
        offset = 0.0
    nb = k // bs
    u = np.ascontiguousarray(u, dtype=np.uint8).reshape(d, k)
    s = np.ascontiguousarray(s, dtype=np.float32).reshape(d, nb)
    if c is not None:
        c = np.ascontiguousarray(c, dtype=np.float32).reshape(d, nb)
    return Affine(u, s, c, bs, signed, offset)


def interleave(a: Affine) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The kernels' layout: rows padded to a multiple of 16 (zeros) and interleaved.

    Returns:
        qw: uint8 ``(G, nb, bs/4, 16, 4)``; ``qw[g, b, j // 4, r, j % 4]`` is element
            ``b*bs + j`` of row ``16 g + r``.
        scale: f32 ``(G, nb, 16)``.
        bias: f32 ``(G, nb, 16)`` or None.
    """
    d, k = a.u.shape
    nb = k // a.bs
    G = -(-d // R)
    pad = G * R - d

    def rows(x: np.ndarray) -> np.ndarray:
        return np.concatenate([x, np.zeros((pad, x.shape[1]), x.dtype)]) if pad else x

    qw = np.ascontiguousarray(rows(a.u).reshape(G, R, nb, a.bs // 4, 4).transpose(0, 2, 3, 1, 4))
    scale = np.ascontiguousarray(rows(a.s).reshape(G, R, nb).transpose(0, 2, 1))
    bias = None if a.c is None else np.ascontiguousarray(rows(a.c).reshape(G, R, nb).transpose(0, 2, 1))
    return qw, scale, bias


__all__ = ["Affine", "REPACK_TYPES", "R", "decode", "interleave"]
