"""Decode attention over the KV cache in place (``csrc/attn.cpp``), and when it is used.

``attn_decode`` runs the C kernel on one layer's cache tensors for one query row per sequence;
``worker.runtime.graph.attn_decode_batch`` calls it on CPU and keeps its torch (f64 SDPA) path for
CUDA, for shapes/dtypes the kernel does not take, and when ``LORAPLANE_ATTN`` says so.

``LORAPLANE_ATTN`` = ``auto`` (default: the C kernel on CPU where the ISA path of
:func:`~worker.runtime.kernels.cpu.resolve_path` is avx512/avx2, else torch) | ``c`` (the
same, named) | ``torch`` (always the torch path; for measurement and as the reference).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from worker.runtime.kernels import cpu, library
from worker.runtime.kernels.linear import KernelError

ATTN_PATHS = ("auto", "c", "torch")
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
MAX_HEAD_DIM = 512  # csrc/attn.cpp MAX_D
MIN_PARALLEL_WORK = 1 << 18
"""Multiply-adds (keys × H × (dk + dv) over the batch) each thread of the kernel must get: the
kernel runs on ``min(threads, work / MIN_PARALLEL_WORK)`` threads (at least one), so threads
follow the work (waking a pool thread costs microseconds). In a decode step the K/V rows come
from memory, not cache: Gemma 3's B=16 step at 40 tokens (1.3 M per layer) took 131 µs per layer
on one thread and 91 µs on two (AMX Xeon, 18 layers' caches cycled), so threads start at 512 K.
The old fixed threshold (8 M) kept Qwen2.5-0.5B's attention at 3 000 tokens (5.4 M per layer)
on one core."""
_FN: dict[str, Any] = {}


def resolve_attn(want: str | None = None) -> str:
    """'c' or 'torch' for CPU decode attention: ``want``, else ``$LORAPLANE_ATTN``, else auto.

    Raises:
        KernelPathError: unknown name.
    """
    w = want or os.environ.get("LORAPLANE_ATTN", "auto")
    if w not in ATTN_PATHS:
        raise cpu.KernelPathError(f"unknown attention path '{w}' (expected {', '.join(ATTN_PATHS)})")
    if w == "torch":
        return "torch"
    return "c" if cpu.resolve_path() != "torch" else "torch"


def supports(k_cache: torch.Tensor, v_cache: torch.Tensor, n_head: int) -> bool:
    """Whether the kernel takes this layer: CPU f32/f16/bf16 caches ``(n_rows, cap, Hkv, d)``
    of one dtype with a contiguous last dim, head dims multiples of 16 up to 512, and
    ``n_head`` a multiple of ``Hkv``."""
    if k_cache.device.type != "cpu" or v_cache.device.type != "cpu" or k_cache.dim() != 4 or v_cache.dim() != 4:
        return False
    if k_cache.dtype not in _DTYPE_CODE or v_cache.dtype != k_cache.dtype:
        return False
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return False
    hkv, dk, dv = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
    return (
        v_cache.shape[2] == hkv
        and hkv > 0
        and n_head % hkv == 0
        and dk % 16 == 0
        and dv % 16 == 0
        and 0 < dk <= MAX_HEAD_DIM
        and 0 < dv <= MAX_HEAD_DIM
    )


def attn_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_rows: torch.Tensor,
    pos: torch.Tensor,
    *,
    kq_scale: float,
    n_swa: int = 0,
    softcap: float = 0.0,
    path: str | None = None,
    nthreads: int | None = None,
    head_block: int | None = None,
    check: bool = True,
    min_parallel_work: int = MIN_PARALLEL_WORK,
) -> torch.Tensor:
    """Attention of one query row per sequence over its KV-cache row, read in place.

    Sequence b (query ``q[b]`` at position ``pos[b]``, cache row ``cache_rows[b]``) attends
    keys at positions ``lo..pos[b]`` of that row, ``lo = max(0, pos[b] - n_swa + 1)`` when
    ``n_swa > 0`` else 0 (causal + llama.cpp ``is_masked_swa`` standard window); score
    ``s = kq_scale · q·k``, then ``softcap · tanh(s / softcap)`` when ``softcap > 0``
    (llama.cpp ``build_attn_mha``, Gemma 2); softmax; weighted sum of V. Query head h uses KV
    head ``h // (H / Hkv)`` (GQA). Online softmax in a fixed key order, f32 accumulation
    (llama.cpp ggml-cpu ``ggml_compute_forward_flash_attn_ext_f16``'s scheme): a row's result
    is bit-identical alone or batched and for any thread count.

    Args:
        q: ``(B, H, dk)`` any float dtype (converted to f32).
        k_cache, v_cache: one layer of ``KVCache.k`` / ``.v``: ``(n_rows, cap, Hkv, dk|dv)``
            f32/f16/bf16 CPU, the positions ``0..pos[b]`` of each used row written.
        cache_rows, pos: int64 ``(B,)``.
        path: ISA 'avx512' | 'avx2' (default :func:`~worker.runtime.kernels.cpu.resolve_path`).
        nthreads: default ``torch.get_num_threads()``.
        head_block: query heads per task (default: a KV head's query heads together, split
            only when there are fewer (row, KV head) pairs than threads); splits work only,
            never changes a result. A second thread joins from ``2 · min_parallel_work``
            multiply-adds (a wake-up costs more than a short attention).
        min_parallel_work: see :data:`MIN_PARALLEL_WORK` (0: always ``nthreads``).
        check: verify that rows and positions lie inside the cache (False: the caller
            guarantees it, as ``GraphContext`` does from the context's own row map).
    Returns:
        ``(B, H, dv)`` f32.
    Raises:
        KernelError: a shape/dtype :func:`supports` rejects, or positions outside the cache.
        KernelPathError: ``path`` is 'torch' or not runnable here.
    """
    p = cpu.resolve_path(path)
    if p == "torch":
        raise cpu.KernelPathError("attn_decode is a C kernel; the torch path is GraphContext's SDPA")
    b, n_head, dk = q.shape
    if not supports(k_cache, v_cache, n_head) or k_cache.shape[3] != dk:
        raise KernelError(
            f"attn_decode: unsupported q {tuple(q.shape)} / cache {tuple(k_cache.shape)} {k_cache.dtype}, "
            f"{tuple(v_cache.shape)} {v_cache.dtype}"
        )
    if k_cache.shape[:2] != v_cache.shape[:2]:
        raise KernelError("attn_decode: K and V caches differ in rows or capacity")
    rows = cache_rows.to(torch.int64).contiguous()
    ps = pos.to(torch.int64).contiguous()
    if rows.shape != (b,) or ps.shape != (b,):
        raise KernelError(f"attn_decode: cache_rows/pos must be ({b},)")
    if (
        check
        and b
        and (
            int(rows.min()) < 0
            or int(rows.max()) >= k_cache.shape[0]
            or int(ps.min()) < 0
            or int(ps.max()) >= k_cache.shape[1]
        )
    ):
        raise KernelError("attn_decode: a cache row or position lies outside the cache")
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    nt = torch.get_num_threads() if nthreads is None else nthreads
    qf = q.to(torch.float32).contiguous()
    out = torch.empty((b, n_head, dv), dtype=torch.float32)
    fn = _FN.get(p)
    if fn is None:
        fn = _FN[p] = getattr(library.load(p), f"lp_{p}_attn_decode")
    ks, vs = k_cache.stride(), v_cache.stride()
    rc = fn(
        qf.data_ptr(),
        n_head * dk,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        _DTYPE_CODE[k_cache.dtype],
        ks[0],
        ks[1],
        ks[2],
        vs[0],
        vs[1],
        vs[2],
        rows.data_ptr(),
        ps.data_ptr(),
        b,
        n_head,
        hkv,
        dk,
        dv,
        float(kq_scale),
        float(softcap),
        int(n_swa),
        0 if head_block is None else int(head_block),
        int(min_parallel_work),
        out.data_ptr(),
        nt,
    )
    if rc != 0:
        raise KernelError(f"attn_decode: kernel returned {rc}")
    return out
