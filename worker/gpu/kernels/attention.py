"""Attention over a paged KV cache: K/V writes, decode (Triton), prefill (torch SDPA).

`kv_write` writes a step's new K/V rows into the pages by ``slot_mapping`` (a Triton kernel that
skips padding rows); `paged_decode_attention` is split-K decode, one query per row
(`decode_splits`, `MAX_SPLITS`, `MIN_KEYS_PER_SPLIT`); `prefill_attention` runs one sequence's
new rows over its pages with SDPA (``worker.gpu.kernels.flashinfer_backend`` is the faster
option where installed). GQA, sliding window and logit soft-capping as llama.cpp's
``build_attn_mha``; `kv_write_reference`, `attention_reference` and
`decode_attention_reference` are the torch references.

The cache layout and the semantics: docs/gpu.md, "Inside the GPU engine" (Attention).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from worker.gpu.kernels import triton_env

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_SPLITS = 16  # split-K pieces of a decode row at most
MIN_KEYS_PER_SPLIT = 128  # ... each over at least this many key positions of the table's capacity


def _check_cache(what: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"{what}: k_cache (n_blocks, block_size, H_kv, D) and v_cache (n_blocks, block_size, H_kv, DV); "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype not in FLOAT_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{what}: caches must share one of f32/bf16/f16; got {k_cache.dtype}, {v_cache.dtype}")


def kv_write(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write the K/V of ``n`` new tokens into their pages, in place.

    k ``(n, H_kv, D)``, v ``(n, H_kv, DV)`` (any float dtype, cast to the cache's); slot_mapping
    int64 ``(n,)`` flat positions ``page · block_size + offset``; a negative entry is a padding
    row and writes nothing. One Triton launch, no host read of ``slot_mapping``.

    Raises:
        ValueError: shapes, dtypes or devices that disagree.
        KernelUnavailableError: no Triton, or CPU tensors without the interpreter.
    """
    _check_cache("kv_write", k_cache, v_cache)
    n = k.shape[0]
    _, block_size, h_kv, d = k_cache.shape
    dv = v_cache.shape[3]
    if k.shape != (n, h_kv, d) or v.shape != (n, h_kv, dv) or slot_mapping.shape != (n,):
        raise ValueError(
            f"kv_write: k (n, {h_kv}, {d}), v (n, {h_kv}, {dv}), slot_mapping (n,); got k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}, slot_mapping {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"kv_write: slot_mapping must be int64, got {slot_mapping.dtype}")
    triton_env.check_device("kv_write", k_cache, v_cache, slot_mapping, k, v)
    if n == 0:
        return
    kern = triton_env.load("_attention_triton").kv_write_kernel
    kern[(n,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        block_size,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        H_KV=h_kv,
        D=d,
        DV=dv,
        BLOCK_H=triton_env.next_pow2(h_kv),
        BLOCK_D=triton_env.next_pow2(d),
        BLOCK_DV=triton_env.next_pow2(dv),
    )


def kv_write_reference(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """:func:`kv_write` in torch ops (``index_copy_`` on the flattened pages; padding rows
    dropped with a boolean index, which reads the mask on the host)."""
    keep = slot_mapping >= 0
    idx = slot_mapping[keep]
    nb, bs, h_kv, _ = k_cache.shape
    k_cache.view(nb * bs, h_kv, -1).index_copy_(0, idx, k[keep].to(k_cache.dtype))
    v_cache.view(nb * bs, h_kv, -1).index_copy_(0, idx, v[keep].to(v_cache.dtype))


def decode_splits(batch: int, n_head_kv: int, max_keys: int, device: torch.device) -> int:
    """Split-K pieces per decode row: enough (row, KV head, piece) programs to fill the GPU
    twice over, at most ``MAX_SPLITS`` and at most one per ``MIN_KEYS_PER_SPLIT`` positions of
    ``max_keys`` (the block table's capacity). Depends only on shapes, so a graph captured for a
    batch bucket keeps it. 1 on the CPU interpreter."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-2 * sms // max(1, batch * n_head_kv))
    return max(1, min(MAX_SPLITS, want, max_keys // MIN_KEYS_PER_SPLIT))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one query per row over the paged cache (the module's semantics).

    q ``(B, H, D)``; caches, ``block_tables`` int32 ``(B, max_blocks)`` and ``seq_lens`` int32
    ``(B,)`` as in the module docstring (row b's query is at position ``seq_lens[b] - 1``, its
    own K/V already written); ``window`` 0 = none; ``softcap`` 0 = none. H a multiple of H_kv;
    any D and DV (64–256 in the models). Returns ``out`` ``(B, H, DV)`` in q's dtype (or the
    given ``out``, any strides). A row with ``seq_lens`` 0 gets zeros.

    Split-K: ``num_splits`` pieces per row (default :func:`decode_splits`), each over an equal
    share of the row's visible keys, merged by log-sum-exp in a second launch (none when 1).
    The lengths and tables are read only on the device: the launches depend on shapes alone.

    Raises:
        ValueError: shapes, dtypes or devices that disagree.
        KernelUnavailableError: no Triton, or CPU tensors without the interpreter.
    """
    _check_cache("paged_decode_attention", k_cache, v_cache)
    if q.dim() != 3:
        raise ValueError(f"paged_decode_attention: q (B, H, D); got {tuple(q.shape)}")
    B, H, D = q.shape
    _, block_size, h_kv, dk = k_cache.shape
    DV = v_cache.shape[3]
    if dk != D or H % h_kv != 0:
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)} vs k_cache {tuple(k_cache.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or block_tables.dtype != torch.int32:
        raise ValueError(f"paged_decode_attention: block_tables int32 (B, max_blocks); got {block_tables.dtype}")
    if seq_lens.shape != (B,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"paged_decode_attention: seq_lens int32 (B,); got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"paged_decode_attention: q is {q.dtype}")
    if out is None:
        out = torch.empty((B, H, DV), dtype=q.dtype, device=q.device)
    elif out.shape != (B, H, DV):
        raise ValueError(f"paged_decode_attention: out must be {(B, H, DV)}, got {tuple(out.shape)}")
    triton_env.check_device("paged_decode_attention", q, k_cache, v_cache, block_tables, seq_lens, out)
    if B == 0:
        return out
    G = H // h_kv
    ns = num_splits or decode_splits(B, h_kv, block_tables.shape[1] * block_size, q.device)
    if ns > 1:
        o_part = torch.empty((B, H, ns, DV), dtype=torch.float32, device=q.device)
        lse = torch.empty((B, H, ns), dtype=torch.float32, device=q.device)
    else:  # the split kernel writes ``out`` directly; these are not read
        o_part = lse = out
    block_d, block_dv = max(16, triton_env.next_pow2(D)), max(16, triton_env.next_pow2(DV))
    mod = triton_env.load("_attention_triton")
    mod.decode_split_kernel[(B, h_kv, ns)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        o_part,
        lse,
        out,
        float(scale),
        float(softcap) if softcap > 0 else 1.0,
        int(window),
        block_size,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *(o_part.stride()[:3] if ns > 1 else (0, 0, 0)),
        *(lse.stride()[:2] if ns > 1 else (0, 0)),
        *out.stride(),
        G=G,
        D=D,
        DV=DV,
        NUM_SPLITS=ns,
        SOFTCAP=softcap > 0,
        WINDOW=window > 0,
        DOT_F32=triton_env.dot_in_f32(q.dtype, k_cache.dtype, device=q.device),
        BLOCK_G=max(16, triton_env.next_pow2(G)),
        BLOCK_N=16 if max(block_d, block_dv) >= 256 else 32,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
    )
    if ns > 1:
        mod.decode_reduce_kernel[(B, H)](
            o_part,
            lse,
            out,
            *o_part.stride()[:3],
            *lse.stride()[:2],
            *out.stride(),
            DV=DV,
            NUM_SPLITS=ns,
            BLOCK_S=triton_env.next_pow2(ns),
            BLOCK_DV=block_dv,
        )
    return out


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """Positions ``0..n-1`` of one sequence from its pages: cache ``(n_blocks, block_size, H_kv,
    D)``, block_table int ``(≥ ceil(n / block_size),)`` → ``(n, H_kv, D)`` (a gather, on the
    cache's device)."""
    bs = cache.shape[1]
    pages = block_table[: -(-n // bs)].long()
    return cache.index_select(0, pages).flatten(0, 1)[:n]


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The module's semantics in f64 for one sequence: q ``(t, H, D)`` at positions ``q_pos``
    ``(t,)``, k ``(L, H_kv, D)`` / v ``(L, H_kv, DV)`` at ``k_pos`` ``(L,)`` → ``(t, H, DV)`` f64
    (a query with no visible key gets zeros)."""
    rep = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(rep, dim=1)  # (L, H, D)
    vv = v.double().repeat_interleave(rep, dim=1)
    s = torch.einsum("thd,lhd->htl", q.double(), kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    dist = q_pos[:, None].long() - k_pos[None, :].long()  # (t, L)
    vis = dist >= 0
    if window > 0:
        vis = vis & (dist < window)
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no visible key: zeros
    return torch.einsum("htl,lhd->thd", p, vv)


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """:func:`paged_decode_attention` in f64 torch ops, row by row (reads the lengths on the
    host): returns ``(B, H, DV)`` f64."""
    B, H, _ = q.shape
    out = torch.zeros((B, H, v_cache.shape[3]), dtype=torch.float64, device=q.device)
    for b in range(B):
        n = int(seq_lens[b])
        if n == 0:
            continue
        k = gather_pages(k_cache, block_tables[b], n)
        v = gather_pages(v_cache, block_tables[b], n)
        pos = torch.arange(n, device=q.device)
        out[b] = attention_reference(
            q[b : b + 1], k, v, pos[n - 1 :], pos, scale=scale, window=window, softcap=softcap
        ).squeeze(0)
    return out


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    pos0: int,
    *,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of one sequence's ``t`` new rows at positions ``pos0..pos0+t-1`` over its pages
    (their K/V already written), the module's semantics.

    q ``(t, H, D)``; block_table int ``(max_blocks,)``. Keys from ``max(0, pos0 - window + 1)``
    (window) or 0 up to ``pos0 + t - 1`` are gathered from the pages, then torch SDPA with a
    boolean causal/window mask and GQA; when ``softcap > 0`` an explicit f32 masked softmax
    (SDPA has no soft-cap). Returns ``(t, H, DV)`` in q's dtype. Host ints only (eager prefill).
    """
    t, H, D = q.shape
    end = pos0 + t
    lo = max(0, pos0 - window + 1) if window > 0 else 0
    k = gather_pages(k_cache, block_table, end)[lo:].to(q.dtype)
    v = gather_pages(v_cache, block_table, end)[lo:].to(q.dtype)
    q_pos = torch.arange(pos0, end, device=q.device)[:, None]
    k_pos = torch.arange(lo, end, device=q.device)[None, :]
    mask = k_pos <= q_pos
    if window > 0:
        mask = mask & (q_pos - k_pos < window)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (H, t, D), (H_kv, L, D)
    if softcap <= 0:
        o = F.scaled_dot_product_attention(
            qh.unsqueeze(0), kh.unsqueeze(0), vh.unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=H != kh.shape[0]
        ).squeeze(0)
        return o.transpose(0, 1)
    rep = H // kh.shape[0]
    kh, vh = kh.repeat_interleave(rep, dim=0).float(), vh.repeat_interleave(rep, dim=0).float()
    s = (qh.float() @ kh.transpose(-1, -2)) * scale
    s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, dim=-1) @ vh).transpose(0, 1).to(q.dtype)


def default_scale(head_dim: int) -> float:
    """``1 / sqrt(head_dim)``, the usual attention scale (Gemma passes
    ``1 / sqrt(query_pre_attn_scalar)`` instead)."""
    return 1.0 / math.sqrt(head_dim)


__all__ = [
    "attention_reference",
    "decode_attention_reference",
    "decode_splits",
    "default_scale",
    "gather_pages",
    "kv_write",
    "kv_write_reference",
    "paged_decode_attention",
    "prefill_attention",
]
