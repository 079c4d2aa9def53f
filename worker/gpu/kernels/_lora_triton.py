"""Triton kernels of the gathered multi-LoRA product (``worker.gpu.kernels.lora`` calls them).

Imports Triton at import: only ``worker.gpu.kernels.lora`` imports this module, at its
first kernel call. Shapes, symbols and semantics are in that module's docstring; here only the
tiling.

Both kernels tile the rows by ``BLOCK_M`` and loop or grid over the ``U`` slot columns of
``row_slot``; a (row tile, slot) pair whose rows all have a zero scale there, or whose slot has
no branch (``factor`` 0, rank 0), does nothing. The grids depend on shapes only, never on which
slots are used, so a CUDA graph captured once stays valid while ``row_slot`` changes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def lora_shrink_kernel(
    x_ptr,
    a_ptr,
    row_slot_ptr,
    factor_ptr,
    rank_ptr,
    t_ptr,
    n,
    k,
    R,
    k_per_split,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_rm,
    stride_rs,
    stride_tsplit,
    stride_tm,
    stride_ts,
    HAS_RANK: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """t[split, i, s, :r_s] = x[i, K_split] · A_s[:r_s, K_split]ᵀ for the rows of one tile, one
    slot, one K split (grid: row tiles × U × SPLIT_K), f32."""
    pid_m = tl.program_id(0)
    s = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    scale = tl.load(row_slot_ptr + rows * stride_rm + s * stride_rs, mask=row_ok, other=0.0)
    f = tl.load(factor_ptr + s)
    r_s = R
    if HAS_RANK:
        r_s = tl.minimum(tl.load(rank_ptr + s), R)
    used = tl.sum((scale != 0.0).to(tl.int32), axis=0)
    if (used > 0) & (f != 0.0) & (r_s > 0):
        j = tl.arange(0, BLOCK_R)
        j_ok = j < r_s
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        k0 = split * k_per_split
        # k_per_split is a whole number of BLOCK_K steps, so a step never crosses into the next split
        for kk in range(0, k_per_split, BLOCK_K):
            cols = k0 + kk + tl.arange(0, BLOCK_K)
            c_ok = cols < k
            xt = tl.load(
                x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk,
                mask=row_ok[:, None] & c_ok[None, :],
                other=0.0,
            )
            at = tl.load(
                a_ptr + s * stride_as + j[:, None] * stride_ar + cols[None, :] * stride_ak,
                mask=j_ok[:, None] & c_ok[None, :],
                other=0.0,
            )
            if DOT_F32:
                acc += tl.dot(xt.to(tl.float32), tl.trans(at.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(xt, tl.trans(at))
        tl.store(
            t_ptr + split * stride_tsplit + rows[:, None] * stride_tm + s * stride_ts + j[None, :],
            acc,
            mask=row_ok[:, None],
        )


@triton.jit
def lora_expand_kernel(
    t_ptr,
    bt_ptr,
    row_slot_ptr,
    factor_ptr,
    rank_ptr,
    y_ptr,
    n,
    d,
    R,
    U,
    stride_tsplit,
    stride_tm,
    stride_ts,
    stride_bs,
    stride_br,
    stride_bd,
    stride_rm,
    stride_rs,
    stride_ym,
    stride_yd,
    SPLIT_K: tl.constexpr,
    HAS_RANK: tl.constexpr,
    ROUND_T: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """y[i, cols] += Σ_s c[i,s] · t[i, s, :r_s] · B_s[:r_s, cols] for one row tile and one
    column tile (grid: row tiles × column tiles), c = row_slot · factor; the slots in a fixed
    order, so a row's result does not depend on the other rows. Rows with no used slot are not
    written."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < d
    j = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    hits = 0
    for s in range(0, U):
        scale = tl.load(row_slot_ptr + rows * stride_rm + s * stride_rs, mask=row_ok, other=0.0)
        c = scale * tl.load(factor_ptr + s)
        r_s = R
        if HAS_RANK:
            r_s = tl.minimum(tl.load(rank_ptr + s), R)
        use = (c != 0.0) & row_ok
        if (tl.sum(use.to(tl.int32), axis=0) > 0) & (r_s > 0):
            j_ok = j < r_s
            # rows with a zero scale here may hold no shrink result: never read them
            tt = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                tt += tl.load(
                    t_ptr + split * stride_tsplit + rows[:, None] * stride_tm + s * stride_ts + j[None, :],
                    mask=use[:, None] & j_ok[None, :],
                    other=0.0,
                )
            tt = tt * c[:, None]
            b = tl.load(
                bt_ptr + s * stride_bs + j[:, None] * stride_br + cols[None, :] * stride_bd,
                mask=j_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            if ROUND_T:
                # the 16-bit path multiplies B in its own dtype (punica/vLLM expand)
                tt = tt.to(bt_ptr.dtype.element_ty)
            if DOT_F32:
                acc += tl.dot(tt.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(tt, b)
            hits += 1
    if hits > 0:
        y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yd
        ok = row_ok[:, None] & col_ok[None, :]
        y = tl.load(y_ptrs, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=ok)
