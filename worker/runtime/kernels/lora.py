"""Multi-LoRA products over the adapter slot pool: dense masked (all used slots) and gathered
(BGMV: per row, only the slots its adapter set holds).

Both compute, for a ubatch of ``n`` rows over the slot buffers of one weight
(``worker.lora.pool.WeightSlots``: ``a`` ``(S, R, k)``, ``bt`` ``(S, R, d)``, ``factor`` f32
``(S,)`` = alpha / r, ``rank_of``), with ``S_row`` f32 ``(n, u)`` the per-row slot scales
(``adapter_scale``, 0 where the row's set lacks the slot)::

    y[i] += Σ_s  S_row[i, s] · factor[s] · B_s (A_s x[i])       (llama.cpp ``build_lora_mm``)

- :func:`lora_dense`: two matmuls over the used slot prefix with the scale mask between them;
  its work grows with ``n · u``.
- :func:`lora_bgmv`: the C kernel ``csrc/lora.cpp`` (punica/S-LoRA BGMV) over the (row, slot)
  pairs with a nonzero scale (:func:`lora_pairs`); its work grows with the pairs, i.e. with
  the adapters the rows actually use. f32 on the C kernel paths only.

Which one the graph uses is decided in ``worker.runtime.graph.GraphContext._add_lora`` (measured:
``python -m bench.lora``, numbers in this package's README).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from worker.runtime.kernels import cpu, library

PARALLEL_MIN_MACS = 1 << 20
PARALLEL_MIN_SLOT_FLOATS = 1 << 17
"""A ``lora_bgmv`` call runs on one thread unless it has at least ``PARALLEL_MIN_MACS``
multiply-adds (pairs × R × (k + d)) or reads at least ``PARALLEL_MIN_SLOT_FLOATS`` floats of
distinct slots (slots × R × (k + d)): a B=16 rank-8 decode product over 1–4 adapters is a few µs
of work, less than waking a second thread costs on a busy machine, while over 16 adapters it
streams 1.4 MB of A/B and two threads read it faster (``bench.lora``; 2-core machine). The
thread count never changes a value."""

_FN: dict[str, Any] = {}


@dataclass(frozen=True)
class LoraPairs:
    """The (row, slot) pairs of a ubatch with a nonzero per-row slot scale, sorted by row then
    slot (vLLM/punica's ``token_lora_indices``, generalised to sets of several adapters).

    Attributes:
        n: rows of the ubatch.
        row: int32 ``(P,)`` the pair's row.
        slot: int32 ``(P,)`` the pair's slot.
        scale: f32 ``(P,)`` the row's ``adapter_scale`` of the slot (the alpha / r factor is
            per weight and applied by the kernel).
        row_ptr: int32 ``(n + 1,)``: row i's pairs are ``row_ptr[i]..row_ptr[i+1]-1``.
        n_slots: distinct slots among the pairs.
    """

    n: int
    row: torch.Tensor
    slot: torch.Tensor
    scale: torch.Tensor
    row_ptr: torch.Tensor
    n_slots: int


def lora_pairs(row_slot: torch.Tensor) -> LoraPairs:
    """The nonzero entries of the per-row slot scales ``row_slot`` f32 ``(n, u)`` (CPU) as
    :class:`LoraPairs`."""
    rs = row_slot.float().contiguous()
    nz = torch.nonzero(rs)  # row-major order: by row, then slot
    rows, slots = nz[:, 0], nz[:, 1]
    n = rs.shape[0]
    ptr = torch.zeros(n + 1, dtype=torch.int32)
    if rows.numel():
        ptr[1:] = torch.bincount(rows, minlength=n).cumsum(0).to(torch.int32)
    return LoraPairs(
        n,
        rows.to(torch.int32).contiguous(),
        slots.to(torch.int32).contiguous(),
        rs[rows, slots].contiguous(),
        ptr,
        int((rs != 0).any(0).sum()),
    )


def lora_dense(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, factor: torch.Tensor, row_slot: torch.Tensor
) -> torch.Tensor:
    """``y + Σ_s S[:, s] · B_s (A_s x)`` as two dense matmuls over all ``u`` used slots.

    x ``(n, k)``; y ``(n, d)``; a ``(u, R, k)``, bt ``(u, R, d)`` (the used slot prefix, contiguous);
    factor f32 ``(u,)``; row_slot f32 ``(n, u)``. Zero-padded rank rows and slots a row does not
    use contribute exact zeros. Returns a new ``(n, d)`` tensor in y's dtype.
    """
    n, (u, rk) = x.shape[0], a.shape[:2]
    s = (row_slot * factor).to(x.dtype)  # (n, u)
    xa = (x @ a.reshape(u * rk, -1).T).view(n, u, rk) * s.unsqueeze(2)  # (n, u, R)
    return y + (xa.view(n, u * rk) @ bt.reshape(u * rk, -1)).to(y.dtype)


def lora_bgmv(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    rank: torch.Tensor,
    factor: torch.Tensor,
    pairs: LoraPairs,
    *,
    path: str | None = None,
) -> torch.Tensor:
    """Gathered LoRA (BGMV) with the C kernel: ``y[i] += Σ_{(i,s)} scale·factor[s] · B_s (A_s x[i])``
    over the pairs of row i only; adds into ``y`` in place and returns it.

    x f32 ``(n, k)`` (rows contiguous); y f32 ``(n, d)`` with unit column stride (a column slice
    of a fused output is fine); a f32 ``(S', R, k)``, bt f32 ``(S', R, d)`` contiguous with
    ``S'`` > every pair's slot; rank int32 ``(S',)`` (rows past r_s are skipped); factor f32
    ``(S',)`` alpha / r (0: no branch). A row's result is bit-identical whatever the other rows
    or the thread count (``csrc/lora.cpp``).

    Raises:
        KernelPathError: ``path`` is 'torch' or not runnable on this CPU.
        ValueError: dtypes/devices/layouts the kernel does not take.
    """
    p = cpu.resolve_path(path)
    fn = _FN.get(p)
    if fn is None:
        if p == "torch":
            raise cpu.KernelPathError("lora_bgmv is for the C kernel paths, not 'torch'")
        fn = _FN[p] = getattr(library.load(p), f"lp_{p}_lora_bgmv")
    if not (x.dtype == y.dtype == a.dtype == bt.dtype == factor.dtype == torch.float32):
        raise ValueError("lora_bgmv takes f32 x, y, a, bt, factor")
    if x.device.type != "cpu" or y.device.type != "cpu":
        raise ValueError("lora_bgmv runs on CPU tensors")
    n, k = x.shape
    R, d = int(a.shape[1]), int(bt.shape[2])
    if y.shape != (n, d) or y.stride(1) != 1 or x.stride(1) != 1 or a.shape[2] != k or R > 256:
        raise ValueError(f"lora_bgmv: bad shapes x {tuple(x.shape)}, y {tuple(y.shape)}, a {tuple(a.shape)}")
    if not (a.is_contiguous() and bt.is_contiguous() and rank.dtype == torch.int32 and pairs.n == n):
        raise ValueError("lora_bgmv: a/bt must be contiguous, rank int32, pairs for these rows")
    P = int(pairs.row.shape[0])
    if P == 0:
        return y
    # threads only where the work pays for waking them (values never depend on the count)
    big = P * R * (k + d) >= PARALLEL_MIN_MACS or pairs.n_slots * R * (k + d) >= PARALLEL_MIN_SLOT_FLOATS
    nt = torch.get_num_threads() if big else 1
    fn(
        x.data_ptr(),
        x.stride(0),
        n,
        k,
        a.data_ptr(),
        bt.data_ptr(),
        R,
        d,
        rank.data_ptr(),
        factor.data_ptr(),
        pairs.slot.data_ptr(),
        pairs.scale.data_ptr(),
        pairs.row_ptr.data_ptr(),
        y.data_ptr(),
        y.stride(0),
        nt,
    )
    return y


def lora_sgmv_torch(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    rank_of: list[int],
    factor: torch.Tensor,
    pairs: LoraPairs,
) -> torch.Tensor:
    """Segment-grouped LoRA in torch (SGMV's idea without a kernel): for each slot, one dense
    product over the rows that use it (``index_select``, ``A_s`` at its true rank, scaled,
    ``B_s``, ``index_add_``). Same shapes as :func:`lora_bgmv`; returns a new tensor.
    Kept for measurement (``bench.lora``)."""
    out = y.clone()
    for s in torch.unique(pairs.slot).tolist():
        r = rank_of[s]
        if r == 0:
            continue
        sel = pairs.slot == s
        rows = pairs.row[sel].long()
        c = (pairs.scale[sel] * factor[s]).to(x.dtype).unsqueeze(1)
        xa = (x.index_select(0, rows) @ a[s, :r].T) * c
        out.index_add_(0, rows, (xa @ bt[s, :r]).to(y.dtype))
    return out


__all__ = ["LoraPairs", "lora_bgmv", "lora_dense", "lora_pairs", "lora_sgmv_torch"]
