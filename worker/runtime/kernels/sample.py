"""Fused logits summary (``csrc/sample.cpp``): per row of f32 logits, one call computes the
max, the log of the sum of ``exp(x - max)`` and the top-k (ids + logits, descending, ties by
ascending id), so that greedy sampling, the chosen token's log-prob and top log-probs need no
full ``log_softmax`` (which writes a second ``n_vocab`` row) and no separate argmax / topk
passes.

``log_softmax(x)_j = (x_j - max) - logsum`` in f32 (torch's formula,
``aten/src/ATen/native/cpu/SoftMaxKernel.cpp`` ``_vec_log_softmax_lastdim``; llama.cpp's
``llama_sampler_softmax_impl`` also takes the max first). Results are deterministic: a row's
values are bit-identical alone or in any batch and with any thread count (fixed chunks of
16384 entries, merged in order); they differ between the avx2 and avx512 builds in the last
bits of ``logsum`` only (vector width changes the summation order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.runtime.kernels import library
from worker.runtime.kernels.cpu import KernelPathError, resolve_path

TOPK_MAX = 128  # csrc/sample.cpp LP_TOPK_MAX


@dataclass(frozen=True)
class LogitsSummary:
    """Per-row summary of ``n`` logits rows.

    Attributes:
        max: f32 ``(n,)``, each row's largest logit.
        logsum: f32 ``(n,)``, ``log(sum_j exp(x_j - max))``.
        top_ids: int32 ``(n, k)``, the ``k`` largest logits' token ids, descending by logit,
            equal logits by ascending id (``top_ids[:, 0]`` is ``torch.argmax``: the first
            maximum).
        top_logits: f32 ``(n, k)``, their logits.
    """

    max: torch.Tensor
    logsum: torch.Tensor
    top_ids: torch.Tensor
    top_logits: torch.Tensor


def logits_summary(
    x: torch.Tensor, k: int = 1, *, rows: list[int] | None = None, path: str | None = None
) -> LogitsSummary:
    """Max, log-sum-exp and top-``k`` of each row of ``x`` (or of ``x[rows]``) in one fused C
    call.

    Args:
        x: f32 CPU ``(m, n_vocab)`` (other float dtypes are converted; rows may be strided).
            NaN entries are not supported; ``-inf`` entries (masked tokens) are (their ``exp``
            is 0); an all ``-inf`` row gives ``max = logsum = -inf``.
        rows: the rows of ``x`` to summarize (read in place, no copy); None: all ``m``.
        k: top entries kept per row, ``1 <= k <= min(TOPK_MAX, n_vocab)``.
        path: 'avx512' | 'avx2' (default: :func:`resolve_path`).

    Raises:
        KernelPathError: the path is 'torch' (no C kernel) or one this CPU cannot run.
        ValueError: bad shape, device or ``k``.
        RuntimeError: the kernel failed (no memory).
    """
    path = resolve_path(path)
    if path == "torch":
        raise KernelPathError("logits_summary has no torch path; use torch.log_softmax / topk")
    if x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"logits_summary needs 2-D CPU logits, got {tuple(x.shape)} on {x.device}")
    m, v = x.shape
    n = m if rows is None else len(rows)
    if rows is not None and not all(0 <= r < m for r in rows):
        raise ValueError(f"rows must be in [0, {m}), got {rows}")
    if not 1 <= k <= min(TOPK_MAX, v):
        raise ValueError(f"k must be in [1, {min(TOPK_MAX, v)}], got {k}")
    if x.dtype != torch.float32:
        x = x.float()
    if x.stride(1) != 1 or (m > 1 and x.stride(0) < v):
        x = x.contiguous()
    idx = None if rows is None else torch.tensor(rows, dtype=torch.int64)
    mx = torch.empty(n, dtype=torch.float32)
    ls = torch.empty(n, dtype=torch.float32)
    ids = torch.empty((n, k), dtype=torch.int32)
    vals = torch.empty((n, k), dtype=torch.float32)
    fn = getattr(library.load(path), f"lp_{path}_logits_summary")
    ldx = x.stride(0) if m > 1 else v
    rc = fn(
        x.data_ptr(),
        ldx,
        None if idx is None else idx.data_ptr(),
        n,
        v,
        k,
        mx.data_ptr(),
        ls.data_ptr(),
        ids.data_ptr(),
        vals.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"lp_{path}_logits_summary failed (rc={rc})")
    return LogitsSummary(mx, ls, ids, vals)


__all__ = ["TOPK_MAX", "LogitsSummary", "logits_summary"]
