"""Triton kernels of paged attention (``worker.gpu.kernels.attention`` calls them).

Imports Triton at import: only ``worker.gpu.kernels.attention`` imports this module, at
its first kernel call. Shapes, symbols and semantics are in that module's docstring; here only
the tiling.

Decode is split-K (flash-decoding): program (b, kv head, split) attends the ``G`` query heads of
one KV head (GQA: the K/V tile is read once for all of them; ``BLOCK_G`` ≥ 16 rows for
``tl.dot``) over one contiguous piece of the row's visible keys, with an online softmax in f32,
and writes its normalised partial output and log-sum-exp; the reduce kernel merges the pieces.
A row's pieces are cut from its own length (read on the device), so the grid depends only on
shapes and a CUDA graph stays valid as lengths and block tables change.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    block_size,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vct,
    stride_vch,
    stride_vcd,
    H_KV: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Row i's K ``(H_kv, D)`` and V ``(H_kv, DV)`` into cache position ``slot[i]`` (grid: rows);
    a negative slot (a padding row) writes nothing."""
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i)
    if slot >= 0:
        blk = slot.to(tl.int64) // block_size
        off = slot.to(tl.int64) % block_size
        h = tl.arange(0, BLOCK_H)
        h_ok = h < H_KV
        dk = tl.arange(0, BLOCK_D)
        ok = h_ok[:, None] & (dk < D)[None, :]
        kt = tl.load(k_ptr + i * stride_kn + h[:, None] * stride_kh + dk[None, :] * stride_kd, mask=ok)
        dst = k_cache_ptr + blk * stride_kcb + off * stride_kct + h[:, None] * stride_kch + dk[None, :] * stride_kcd
        tl.store(dst, kt.to(k_cache_ptr.dtype.element_ty), mask=ok)
        dv = tl.arange(0, BLOCK_DV)
        ok = h_ok[:, None] & (dv < DV)[None, :]
        vt = tl.load(v_ptr + i * stride_vn + h[:, None] * stride_vh + dv[None, :] * stride_vd, mask=ok)
        dst = v_cache_ptr + blk * stride_vcb + off * stride_vct + h[:, None] * stride_vch + dv[None, :] * stride_vcd
        tl.store(dst, vt.to(v_cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _page_tile(cache_ptr, blk, off, hk, stride_b, stride_t, stride_h, stride_d, cols, n_cols, p_ok):
    """The ``(BLOCK_N, len(cols))`` tile of KV head ``hk`` at the positions whose pages are
    ``blk`` (int64) and offsets ``off``; zeros where ``p_ok`` is false or past ``n_cols``."""
    rows = cache_ptr + blk[:, None] * stride_b + off[:, None] * stride_t + hk * stride_h
    return tl.load(rows + cols[None, :] * stride_d, mask=p_ok[:, None] & (cols < n_cols)[None, :], other=0.0)


@triton.jit
def _soft_cap(s, cap):
    """``cap · tanh(s / cap)`` with tanh(x) = 1 - 2 / (exp(2x) + 1): exactly ±1 at the limits
    (exp overflowing to inf or to 0), no NaN."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


@triton.jit
def _split_keys(seq_len, window, split, WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key positions ``[start, end)`` of split ``split`` of a row holding ``seq_len`` keys:
    the visible keys (the last ``window`` with WINDOW) cut into NUM_SPLITS pieces of whole
    BLOCK_N tiles; ``end <= start`` for a piece past the row's keys."""
    lo = 0
    if WINDOW:
        # the query sits at position seq_len - 1; a key at p is visible iff (seq_len - 1) - p < window
        lo = tl.maximum(seq_len - window, 0)
    n_keys = seq_len - lo
    per_split = tl.cdiv(tl.cdiv(n_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)
    return start, end


@triton.jit
def _tile_scores(q, kt, p_ok, scale, softcap, SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr):
    """The ``(BLOCK_G, BLOCK_N)`` logits of the queries ``q`` ``(BLOCK_G, BLOCK_D)`` against the
    K tile ``kt`` ``(BLOCK_N, BLOCK_D)``: ``scale · q·kᵀ`` in f32, soft-capped with SOFTCAP,
    -inf at the positions where ``p_ok`` is false."""
    if DOT_F32:
        s = tl.dot(q, tl.trans(kt.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(kt))
    s = s * scale
    if SOFTCAP:
        s = _soft_cap(s, softcap)
    return tl.where(p_ok[None, :], s, float("-inf"))


@triton.jit
def _online_softmax_step(s, vt, m_i, l_i, acc, DOT_F32: tl.constexpr):
    """Fold one tile's logits ``s`` ``(BLOCK_G, BLOCK_N)`` and its V tile ``vt``
    ``(BLOCK_N, BLOCK_DV)`` into the running max ``m_i`` and denominator ``l_i`` (f32,
    ``(BLOCK_G,)``) and the unnormalised output ``acc`` (f32, ``(BLOCK_G, BLOCK_DV)``); returns
    the three updated."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_F32:
        # on the 16-bit path the probabilities are rounded to V's dtype (FlashAttention's order)
        pv = tl.dot(p.to(vt.dtype).to(tl.float32), vt.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(vt.dtype), vt)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_len_ptr,
    o_ptr,
    lse_ptr,
    out_ptr,
    scale,
    softcap,
    window,
    block_size,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vct,
    stride_vch,
    stride_vcd,
    stride_btb,
    stride_btj,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    stride_outd,
    G: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Attention of row b's G query heads of KV head hk over split ``split`` of its visible keys
    (grid: B × H_kv × NUM_SPLITS). With one split the normalised output goes straight to
    ``out``; else the partial output (f32, normalised) and its log-sum-exp (-inf: no keys)."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_len_ptr + b)
    start, end = _split_keys(seq_len, window, split, WINDOW, NUM_SPLITS, BLOCK_N)

    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    heads = hk * G + g
    dk = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + dk[None, :] * stride_qd,
        mask=g_ok[:, None] & (dk < D)[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_DV), dtype=tl.float32)
    n_steps = tl.cdiv(tl.maximum(end - start, 0), BLOCK_N)
    for step in range(0, n_steps):
        pos = start + step * BLOCK_N + tl.arange(0, BLOCK_N)
        p_ok = pos < end
        blk = tl.load(block_table_ptr + b * stride_btb + (pos // block_size) * stride_btj, mask=p_ok, other=0)
        blk = blk.to(tl.int64)  # block × block stride can pass 2^31 elements in a large cache
        off = pos % block_size
        kt = _page_tile(k_cache_ptr, blk, off, hk, stride_kcb, stride_kct, stride_kch, stride_kcd, dk, D, p_ok)
        s = _tile_scores(q, kt, p_ok, scale, softcap, SOFTCAP, DOT_F32)
        vt = _page_tile(v_cache_ptr, blk, off, hk, stride_vcb, stride_vct, stride_vch, stride_vcd, dv, DV, p_ok)
        m_i, l_i, acc = _online_softmax_step(s, vt, m_i, l_i, acc, DOT_F32)
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + b * stride_outb + heads[:, None] * stride_outh + dv[None, :] * stride_outd,
            o.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & (dv < DV)[None, :],
        )
    else:
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_ok)
        tl.store(
            o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + dv[None, :],
            o,
            mask=g_ok[:, None] & (dv < DV)[None, :],
        )


@triton.jit
def decode_reduce_kernel(
    o_ptr,
    lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    stride_outd,
    DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Merge row b, head h's split outputs by their log-sum-exp (grid: B × H); a row with no
    visible key gets zeros."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    sp_ok = sp < NUM_SPLITS
    dv = tl.arange(0, BLOCK_DV)
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + sp, mask=sp_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m_safe))
    o = tl.load(
        o_ptr + b * stride_ob + h * stride_oh + sp[:, None] * stride_os + dv[None, :],
        mask=sp_ok[:, None] & (dv < DV)[None, :],
        other=0.0,
    )
    den = tl.sum(w, axis=0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(den > 0.0, den, 1.0)
    dst = out_ptr + b * stride_outb + h * stride_outh + dv * stride_outd
    tl.store(dst, res.to(out_ptr.dtype.element_ty), mask=dv < DV)
