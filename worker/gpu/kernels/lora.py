"""Multi-LoRA on the device: the gathered per-row product over the adapter slot pool.

`add_lora` adds, for one patched weight, every row's adapters read by slot from the pool's
buffers (``worker.lora.pool.WeightSlots``) at the per-row slot scales of the graph
(``GraphContext.row_slot``): `lora_shrink` then `lora_expand`, the Triton kernels of
``_lora_triton`` (BGMV for decode rows, SGMV segments for prompts; launch shapes independent of
which slots rows use, so a captured CUDA graph survives paging). `lora_reference` is the torch
reference; `add_lora_embedding` and `add_lora_experts` apply the embedding's and the MoE
experts' side branches slot by slot in torch.

Shapes, the semantics loop, tiling and dtypes: docs/gpu.md, "Inside the GPU engine"
(Multi-LoRA).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from worker.gpu.kernels import triton_env

if TYPE_CHECKING:
    from worker.lora.pool import SideBranch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_RANK = 256  # padded rank R a kernel tile takes (the pool's max_lora_rank is far below)
SPLIT_K_MAX_ROWS = 64  # the shrink splits k only for ubatches of at most this many rows
SPLIT_K_CHUNK = 1024  # ... into pieces of about this many columns (at most 8)


def block_m(n: int) -> int:
    """Row tile of both kernels for ``n`` rows: 16 (``tl.dot``'s smallest), 32, or 64."""
    return 16 if n <= 16 else 32 if n <= 32 else 64


def split_k_for(n: int, k: int) -> int:
    """K splits of the shrink for ``n`` rows of width ``k``: with few rows the grid has few
    (row tile, slot) programs, so ``k`` is cut into up to 8 pieces of ~1024 columns whose f32
    partial sums the expand adds in a fixed order (no atomics: deterministic)."""
    if n > SPLIT_K_MAX_ROWS:
        return 1
    return max(1, min(8, k // SPLIT_K_CHUNK))


def _check(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, factor, row_slot, rank) -> None:
    """Shapes, dtypes and devices of :func:`add_lora`'s arguments (metadata only: no device read)."""
    if x.dim() != 2 or y.dim() != 2 or a.dim() != 3 or bt.dim() != 3 or row_slot.dim() != 2:
        raise ValueError(
            f"add_lora: x (n, k), y (n, d), a (S, R, k), bt (S, R, d), row_slot (n, U); got x {tuple(x.shape)}, "
            f"y {tuple(y.shape)}, a {tuple(a.shape)}, bt {tuple(bt.shape)}, row_slot {tuple(row_slot.shape)}"
        )
    n, k = x.shape
    S, R, d = bt.shape
    if a.shape != (S, R, k) or y.shape != (n, d) or row_slot.shape[0] != n or row_slot.shape[1] > S:
        raise ValueError(
            f"add_lora: shapes disagree: x {tuple(x.shape)}, y {tuple(y.shape)}, a {tuple(a.shape)}, "
            f"bt {tuple(bt.shape)}, row_slot {tuple(row_slot.shape)} (want a (S, R, k), bt (S, R, d), "
            "y (n, d), row_slot (n, U ≤ S))"
        )
    if R > MAX_RANK:
        raise ValueError(f"add_lora: padded rank {R} > {MAX_RANK}")
    for name, t in (("x", x), ("y", y), ("a", a), ("bt", bt)):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"add_lora: {name} is {t.dtype}; want f32, bf16 or f16")
    if factor.shape != (S,) or factor.dtype != torch.float32 or row_slot.dtype != torch.float32:
        raise ValueError(f"add_lora: factor f32 (S,) and row_slot f32 (n, U); got {factor.dtype} {tuple(factor.shape)}")
    if rank is not None and (rank.shape != (S,) or rank.dtype != torch.int32):
        raise ValueError(f"add_lora: rank int32 (S,); got {rank.dtype} {tuple(rank.shape)}")
    extra = () if rank is None else (rank,)
    triton_env.check_device("add_lora", x, y, a, bt, factor, row_slot, *extra)


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    factor: torch.Tensor,
    row_slot: torch.Tensor,
    *,
    rank: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """The A product of :func:`add_lora` (shapes in the module docstring).

    Returns f32 ``t`` ``(split_k, n, U, BLOCK_R)`` (``BLOCK_R`` = R rounded up to a power of two,
    at least 16): ``t[:, i, s, :r_s]`` summed over the first dim is ``a[s, :r_s] @ x[i]`` for
    every (row tile, slot) with a nonzero scale; entries of other pairs are left unwritten (the
    expand never reads them).
    """
    n, k = x.shape
    S, R, _ = a.shape
    U = row_slot.shape[1]
    sk = split_k or split_k_for(n, k)
    br = max(16, triton_env.next_pow2(R))
    t = torch.empty((sk, n, U, br), dtype=torch.float32, device=x.device)
    if n == 0 or U == 0:
        return t
    kern = triton_env.load("_lora_triton").lora_shrink_kernel
    bm, bk = block_m(n), 64 if br <= 64 else 32
    k_per_split = -(-k // sk)
    k_per_split = -(-k_per_split // bk) * bk  # whole BLOCK_K steps per split
    rank_arg = rank if rank is not None else factor
    kern[(-(-n // bm), U, sk)](
        x,
        a,
        row_slot,
        factor,
        rank_arg,
        t,
        n,
        k,
        R,
        k_per_split,
        x.stride(0),
        x.stride(1),
        a.stride(0),
        a.stride(1),
        a.stride(2),
        row_slot.stride(0),
        row_slot.stride(1),
        t.stride(0),
        t.stride(1),
        t.stride(2),
        HAS_RANK=rank is not None,
        DOT_F32=triton_env.dot_in_f32(x.dtype, a.dtype, device=x.device),
        BLOCK_M=bm,
        BLOCK_R=br,
        BLOCK_K=bk,
    )
    return t


def lora_expand(
    t: torch.Tensor,
    y: torch.Tensor,
    bt: torch.Tensor,
    factor: torch.Tensor,
    row_slot: torch.Tensor,
    *,
    rank: torch.Tensor | None = None,
    round_t: bool = False,
) -> torch.Tensor:
    """The B product of :func:`add_lora`: ``y[i] += Σ_s row_slot[i, s]·factor[s] · t[i, s] @ bt[s]``
    in place (``t`` from :func:`lora_shrink`, summed over its splits); returns ``y``.

    ``round_t``: round ``c · t`` to bt's dtype before the product (the 16-bit path).
    """
    sk, n, U, br = t.shape
    S, R, d = bt.shape
    if n == 0 or U == 0 or d == 0:
        return y
    kern = triton_env.load("_lora_triton").lora_expand_kernel
    bm = block_m(n)
    bn = 64
    rank_arg = rank if rank is not None else factor
    kern[(-(-n // bm), -(-d // bn))](
        t,
        bt,
        row_slot,
        factor,
        rank_arg,
        y,
        n,
        d,
        R,
        U,
        t.stride(0),
        t.stride(1),
        t.stride(2),
        bt.stride(0),
        bt.stride(1),
        bt.stride(2),
        row_slot.stride(0),
        row_slot.stride(1),
        y.stride(0),
        y.stride(1),
        SPLIT_K=sk,
        HAS_RANK=rank is not None,
        ROUND_T=round_t,
        DOT_F32=(not round_t) or triton_env.dot_in_f32(bt.dtype, device=y.device),
        BLOCK_M=bm,
        BLOCK_R=br,
        BLOCK_N=bn,
    )
    return y


def add_lora(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    factor: torch.Tensor,
    row_slot: torch.Tensor,
    *,
    rank: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """``y[i] += Σ_s row_slot[i, s] · factor[s] · bt[s, :r_s].T @ (a[s, :r_s] @ x[i])`` in place
    (the module docstring's semantics and shapes); returns ``y``.

    x ``(n, k)`` and y ``(n, d)`` may have any strides: ``y`` may be a column slice of a fused
    output (the qkv or gate_up product), written in place through its view. ``row_slot`` f32
    ``(n, U)``, ``factor`` f32 ``(S,)``, ``rank`` int32 ``(S,)`` are device tensors read only by
    the kernels (no host sync), so the call can be captured in a CUDA graph whose inputs are
    rewritten between replays. Two kernel launches (shrink, expand).

    Raises:
        ValueError: shapes, dtypes or devices that disagree.
        KernelUnavailableError: no Triton, or CPU tensors without the interpreter.
    """
    _check(x, y, a, bt, factor, row_slot, rank)
    half = x.dtype in (torch.bfloat16, torch.float16) and bt.dtype in (torch.bfloat16, torch.float16)
    t = lora_shrink(x, a, factor, row_slot, rank=rank, split_k=split_k)
    return lora_expand(t, y, bt, factor, row_slot, rank=rank, round_t=half)


def lora_reference(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    factor: torch.Tensor,
    row_slot: torch.Tensor,
    *,
    rank: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`add_lora`'s semantics in f64 torch ops (any device): returns a new f64 tensor
    ``y + Σ ...`` (not rounded to y's dtype); the reference the kernels are tested against."""
    U = row_slot.shape[1]
    S, R, _ = a.shape
    keep = torch.ones(S, R, dtype=torch.float64, device=a.device)
    if rank is not None:
        keep = (torch.arange(R, device=a.device)[None, :] < rank.to(a.device).long()[:, None]).double()
    av = a[:U].double() * keep[:U, :, None]
    bv = bt[:U].double() * keep[:U, :, None]
    xa = torch.einsum("nk,srk->nsr", x.double(), av)
    c = row_slot.double() * factor[:U].double()
    # a zero scale contributes nothing even where the slot holds non-finite values
    xa = torch.where(c[:, :, None] != 0, xa * c[:, :, None], torch.zeros((), dtype=torch.float64, device=x.device))
    return y.double() + torch.einsum("nsr,srd->nd", xa, bv)


def add_lora_embedding(
    ids: torch.Tensor, y: torch.Tensor, branches: Sequence[tuple[int, SideBranch]], row_slot: torch.Tensor
) -> torch.Tensor:
    """The embedding LoRA of ``GraphContext.build_inp_embd``, added into ``y`` in place:
    ``y += Σ_(s, br) (row_slot[:, s] · br.factor) ⊙ (br.lora_a[ids] @ br.lora_b.T)``.

    ids int64 ``(n,)``; y ``(n, d)``; per used slot ``s`` its side branch ``br`` with A ``(V, r)``
    (gathered by token id, the token_embd exception of ggml ne ``[r, V]``) and B ``(d, r)``;
    row_slot f32 ``(n, U)``. Products in f32, added once in y's dtype. Torch ops, one gather
    and one product per slot: the side tensors are the slots' own (a padded ``(S, V, R)`` buffer
    would be hundreds of MiB), so the ops follow the host's list of used slots and are not for
    capture in a graph; the embedding precedes the first layer, so an engine runs it before a
    replay. Returns ``y``.
    """
    if not branches:
        return y
    acc = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
    for s, br in branches:
        scale = (row_slot[:, s] * br.factor).unsqueeze(1)  # f32 (n, 1)
        acc += (br.lora_a.index_select(0, ids).float() * scale) @ br.lora_b.float().T
    y += acc.to(y.dtype)
    return y


def add_lora_experts(
    x: torch.Tensor,
    y: torch.Tensor,
    expert_ids: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """One slot's LoRA on a routed expert matmul (``GraphContext.build_lora_mm_id``), added into
    ``y`` in place: for each row i and choice j, with e = ``expert_ids[i, j]``,
    ``y[i, j] += scale[i] · lora_b[e] @ (lora_a[e] @ x[i, j])``.

    x ``(n, k)`` (the same input for every choice) or ``(n, K, k)``; y ``(n, K, d)``; expert_ids
    int64 ``(n, K)``; lora_a ``(E, r, k)``, lora_b ``(E, d, r)`` (the slot's side branch, routed by
    the same ids as the base experts, never one expert's A/B for all tokens); scale f32 ``(n,)``
    = ``row_slot[:, s] · factor``. Returns ``y``.

    Torch ops in f32 with static shapes and no host sync: the A product of every expert, a
    one-hot routing mask, the B product of every expert (E times the routed work, small next to
    the base experts at LoRA ranks; a grouped kernel reading only the chosen experts is not
    written). Called once per used slot.
    """
    n, top_k = expert_ids.shape
    E, r, k = lora_a.shape
    d = lora_b.shape[1]
    xk = x.unsqueeze(1).expand(n, top_k, k) if x.dim() == 2 else x
    t = (xk.reshape(n * top_k, k).float() @ lora_a.reshape(E * r, k).float().T).view(n * top_k, E, r)
    route = torch.nn.functional.one_hot(expert_ids.reshape(-1), E).float()  # (nK, E)
    route = route * scale.float().repeat_interleave(top_k).unsqueeze(1)
    t = t * route.unsqueeze(2)
    b = lora_b.float().permute(0, 2, 1).reshape(E * r, d)  # (E·r, d): expert e's rows are lora_b[e].T
    y += (t.view(n * top_k, E * r) @ b).view(n, top_k, d).to(y.dtype)
    return y


__all__ = [
    "add_lora",
    "add_lora_embedding",
    "add_lora_experts",
    "block_m",
    "lora_expand",
    "lora_reference",
    "lora_shrink",
    "split_k_for",
]
