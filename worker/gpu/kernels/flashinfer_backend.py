"""FlashInfer's paged attention as an optional backend (the ``cuda`` extra), Triton's beside it.

FlashInfer (``flashinfer-python``, JIT-compiled with the machine's nvcc; ``flashinfer-cubin`` of
the same release for its precompiled kernels) covers what ``worker.gpu.kernels.attention``
does, on the same cache layout: ``BatchDecodeWithPagedKVCacheWrapper`` and
``BatchPrefillWithPagedKVCacheWrapper`` take ``(k_cache, v_cache)`` pages in the "NHD" layout
``(n_blocks, block_size, H_kv, D)``, GQA, head dims 64/128/256, a sliding window
(``window_left`` = our ``window - 1``: FlashInfer's window counts the keys left of the query,
inclusive) and logit soft-capping (``logits_soft_cap``: ``cap · tanh(sm_scale · q·k / cap)``,
ours). It reads a page list in CSR form rather than a block table (:func:`paged_kv_csr`), and
its ``plan`` reads lengths on the host, so with CUDA graphs ``plan`` runs before each replay and
only ``run`` is captured (FlashInfer's graph mode: fixed batch, buffers given at construction).

Which backend runs is :func:`select_backend`: ``LORAPLANE_GPU_ATTN`` = ``auto`` (FlashInfer on
CUDA when importable, else Triton), ``triton`` or ``flashinfer``. Our Triton kernels stay the
fallback and the reference the GPU tests hold FlashInfer to. Nothing here runs without CUDA,
apart from :func:`paged_kv_csr`.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

BACKENDS = ("auto", "triton", "flashinfer")
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace for split-K partials


def flashinfer_available(device: torch.device) -> bool:
    """Whether FlashInfer can serve ``device``: a CUDA device and the package importable
    (found without importing it)."""
    return device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None


def select_backend(device: torch.device, choice: str | None = None) -> str:
    """``"flashinfer"`` or ``"triton"`` for the attention of a worker on ``device``.

    ``choice`` (default ``LORAPLANE_GPU_ATTN``, else ``auto``): ``auto`` takes FlashInfer where
    :func:`flashinfer_available`, else Triton.

    Raises:
        ValueError: an unknown choice, or ``flashinfer`` where it is not available.
    """
    choice = (choice or os.environ.get("LORAPLANE_GPU_ATTN") or "auto").strip().lower()
    if choice not in BACKENDS:
        raise ValueError(f"LORAPLANE_GPU_ATTN must be one of {', '.join(BACKENDS)}; got {choice!r}")
    if choice == "triton":
        return "triton"
    if flashinfer_available(device):
        return "flashinfer"
    if choice == "flashinfer":
        raise ValueError(f"FlashInfer attention needs CUDA and the 'cuda' extra (device {device})")
    return "triton"


def paged_kv_csr(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block table as FlashInfer's CSR page list.

    block_tables int32 ``(B, max_blocks)``, seq_lens int ``(B,)`` keys per row → ``indptr`` int32
    ``(B + 1,)`` (row b's pages are ``indices[indptr[b]:indptr[b+1]]``), ``indices`` int32
    ``(Σ pages,)``, ``last_page_len`` int32 ``(B,)`` (positions used in the last page, 1..block_size;
    0 for an empty row). Reads the lengths on the host (a boolean gather), as ``plan`` does.
    """
    lens = seq_lens.to(torch.int64)
    n_pages = (lens + block_size - 1) // block_size
    indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=block_tables.device)
    indptr[1:] = torch.cumsum(n_pages, 0).to(torch.int32)
    cols = torch.arange(block_tables.shape[1], device=block_tables.device)
    indices = block_tables[cols[None, :] < n_pages[:, None]].to(torch.int32)
    last = torch.where(n_pages > 0, lens - (n_pages - 1) * block_size, torch.zeros_like(lens)).to(torch.int32)
    return indptr, indices, last


def _window_left(window: int) -> int:
    # ours: visible iff p_q - p_k < window; FlashInfer's: p_q - p_k <= window_left
    return window - 1 if window > 0 else -1


class FlashInferDecode:
    """Batch decode over the paged cache with FlashInfer (one query per row).

    Args:
        device: the CUDA device.
        use_tensor_cores: FlashInfer's tensor-core decode (faster for GQA groups ≥ 4).
        graph_batch: with a batch size, a wrapper for CUDA graphs at that fixed batch
            (``max_pages`` then bounds the pages of one plan).
        max_pages: page-list capacity for graph mode.

    Raises:
        ImportError: FlashInfer is not installed.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        use_tensor_cores: bool = False,
        graph_batch: int | None = None,
        max_pages: int | None = None,
    ):
        import flashinfer

        self.device = device
        self._ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        kw: dict[str, Any] = {}
        if graph_batch is not None:
            if max_pages is None:
                raise ValueError("FlashInferDecode: graph mode needs max_pages")
            kw = dict(
                use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(graph_batch + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=device),
                paged_kv_last_page_len_buffer=torch.zeros(graph_batch, dtype=torch.int32, device=device),
            )
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._ws, "NHD", use_tensor_cores=use_tensor_cores, **kw
        )

    def plan(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        n_head: int,
        n_head_kv: int,
        head_dim: int,
        block_size: int,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
    ) -> None:
        """Plan a step (host work, outside any graph): the attention module's semantics for rows
        with ``seq_lens`` keys in ``block_tables``."""
        indptr, indices, last = paged_kv_csr(block_tables, seq_lens, block_size)
        self._wrapper.plan(
            indptr,
            indices,
            last,
            n_head,
            n_head_kv,
            head_dim,
            block_size,
            window_left=_window_left(window),
            logits_soft_cap=softcap if softcap > 0 else None,
            q_data_type=q_dtype,
            kv_data_type=kv_dtype,
            sm_scale=scale,
        )

    def run(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q ``(B, H, D)`` → ``(B, H, D)`` over the planned rows (capturable)."""
        return self._wrapper.run(q, (k_cache, v_cache), out=out)


class FlashInferPrefill:
    """Batch prefill over the paged cache with FlashInfer (several new rows per sequence,
    causal: the new rows are the last of each sequence's keys). Eager (no graph mode here).

    Raises:
        ImportError: FlashInfer is not installed.
    """

    def __init__(self, device: torch.device):
        import flashinfer

        self.device = device
        self._ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._ws, "NHD")

    def plan(
        self,
        qo_indptr: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        n_head: int,
        n_head_kv: int,
        head_dim: int,
        block_size: int,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
    ) -> None:
        """Plan: sequence b's new rows are ``q[qo_indptr[b]:qo_indptr[b+1]]`` (int32 ``(B + 1,)``),
        its keys ``seq_lens[b]`` positions (the new ones included, written) in ``block_tables[b]``."""
        indptr, indices, last = paged_kv_csr(block_tables, seq_lens, block_size)
        self._wrapper.plan(
            qo_indptr,
            indptr,
            indices,
            last,
            n_head,
            n_head_kv,
            head_dim,
            block_size,
            causal=True,
            sm_scale=scale,
            window_left=_window_left(window),
            logits_soft_cap=softcap if softcap > 0 else None,
            q_data_type=q_dtype,
            kv_data_type=kv_dtype,
        )

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q ``(Σ new rows, H, D)`` → ``(Σ new rows, H, D)``."""
        return self._wrapper.run(q, (k_cache, v_cache))


__all__ = [
    "FlashInferDecode",
    "FlashInferPrefill",
    "flashinfer_available",
    "paged_kv_csr",
    "select_backend",
]
