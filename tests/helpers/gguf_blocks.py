"""Random GGUF weights in every matmul type, for the kernel tests: quantized with
``gguf.quants.quantize`` where the gguf package can (``QUANTIZABLE``), crafted as random valid
block bytes where it cannot (Q4_K, Q5_K, Q6_K). Shapes are numpy order ``(d, k)``."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T

QUANTIZABLE = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16}
"""Types ``gguf.quants.quantize`` writes."""


def _f16_bytes(rng: np.random.Generator, n: int, lo: float, hi: float) -> np.ndarray:
    """``n`` uniform f16 values in ``[lo, hi)`` as an ``(n, 2)`` uint8 array (their bytes)."""
    return rng.uniform(lo, hi, size=(n, 1)).astype(np.float16).view(np.uint8)


def k_blocks(t: T, nblk: int, rng: np.random.Generator) -> np.ndarray:
    """Random but valid K-quant blocks: finite f16 scales, every other byte random."""
    _, tsz = GGML_QUANT_SIZES[t]
    b = rng.integers(0, 256, size=(nblk, tsz), dtype=np.uint8)
    if t == T.Q6_K:  # ql 128, qh 64, scales int8 16, d f16
        b[:, 208:210] = _f16_bytes(rng, nblk, -0.02, 0.02)
    else:  # d, dmin f16, then 6-bit scales/mins and quants
        b[:, 0:2] = _f16_bytes(rng, nblk, 0.001, 0.02)
        b[:, 2:4] = _f16_bytes(rng, nblk, 0.0, 0.02)
    return b


def weight_array(t: T, d: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A random ``(d, k)`` weight (values ~ N(0, 0.05²)) as the array to hand ``GGUFWriter``: float
    for F32/F16, gguf's quantizer's block bytes for ``QUANTIZABLE`` types, random valid blocks
    (``k_blocks``) for the K-quants; ``k`` a multiple of the type's block size."""
    w = rng.standard_normal((d, k)).astype(np.float32) * 0.05
    if t == T.F32:
        return w
    if t == T.F16:
        return w.astype(np.float16)
    if t in QUANTIZABLE:
        return quants.quantize(w, t)
    blk, tsz = GGML_QUANT_SIZES[t]
    return k_blocks(t, d * k // blk, rng).reshape(d, k // blk * tsz)
