"""The layer kernel (``csrc/layer.cpp``): one decoder layer of a ubatch in one C call.

:class:`LayerKernel` holds one layer's descriptor (``csrc/layer.h`` ``LpLayer``, mirrored here with
ctypes) built once from the packed weights, and :meth:`LayerKernel.forward` fills what changes per
ubatch (the KV cache tensors, the rope tables, the LoRA branches of the slots in use) and runs
the layer on the residual stream in place. ``worker.runtime.layer`` decides when it applies and
keeps the torch form of the same layer as the reference.

``LORAPLANE_LAYER`` = ``auto`` (default: the kernel wherever it takes the layer) | ``c`` (the
same, named) | ``torch`` (always the op-by-op graph; for measurement and as the reference).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from worker.runtime.kernels import cpu, library
from worker.runtime.kernels.attn import MIN_PARALLEL_WORK
from worker.runtime.kernels.linear import KernelError, QuantLinear
from worker.runtime.kernels.lora import PARALLEL_MIN_MACS, PARALLEL_MIN_SLOT_FLOATS, LoraPairs
from worker.runtime.kernels.norm import MIN_PARALLEL as NORM_MIN_PARALLEL

LAYER_PATHS = ("auto", "c", "torch")
ACT_CODE = {"silu": 0, "gelu": 1}
KV_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
MAX_PARTS = 3  # matmuls or logical weights per projection (csrc/layer.h LpProj)

_P = ctypes.c_void_p
_I = ctypes.c_int
_F = ctypes.c_float
_L = ctypes.c_int64


class LpMatmul(ctypes.Structure):
    _fields_ = [("qw", _P), ("sc", _P), ("bias", _P), ("off", _F), ("d", _I), ("k", _I), ("bs", _I),
                ("is_signed", _I), ("act", _I)]  # fmt: skip


class LpLora(ctypes.Structure):
    _fields_ = [("col", _I), ("d", _I), ("lora_a", _P), ("lora_bt", _P), ("lora_R", _I), ("lora_nthreads", _I),
                ("lora_rank", _P), ("lora_factor", _P), ("add_bias", _P)]  # fmt: skip


class LpProj(ctypes.Structure):
    _fields_ = [("mm", LpMatmul * MAX_PARTS), ("n_mm", _I), ("d", _I), ("part", LpLora * MAX_PARTS),
                ("n_part", _I), ("pad_", _I)]  # fmt: skip


class LpPairs(ctypes.Structure):
    _fields_ = [("slot", _P), ("scale", _P), ("row_ptr", _P)]


class LpSide(ctypes.Structure):
    _fields_ = [("a", _P), ("b", _P), ("r", _I), ("slot", _I), ("factor", _F), ("pad_", _I)]  # fmt: skip


class LpLayer(ctypes.Structure):
    _fields_ = [
        ("n_embd", _I), ("n_head", _I), ("n_head_kv", _I), ("dk", _I), ("dv", _I), ("n_ff", _I),
        ("eps", _F),
        ("n_rot", _I), ("neox", _I), ("n_swa", _I), ("act", _I), ("kv_dtype", _I),
        ("q_scale", _F), ("kq_scale", _F), ("softcap", _F), ("pad_", _I),
        ("attn_norm", _P), ("q_norm", _P), ("k_norm", _P), ("post_attn_norm", _P), ("ffn_norm", _P),
        ("post_ffw_norm", _P), ("k_cache", _P), ("v_cache", _P),
        ("ks0", _L), ("ks1", _L), ("ks2", _L), ("vs0", _L), ("vs1", _L), ("vs2", _L),
        ("norm_min_parallel", _L), ("attn_min_parallel_work", _L),
        ("qkv", LpProj), ("wo", LpProj), ("ffn_in", LpProj), ("down", LpProj),
        ("n_expert", _I), ("n_expert_used", _I), ("moe_norm_w", _I), ("pad2_", _I),
        ("gate_inp", _P), ("exp_in", _P), ("exp_down", _P),
        ("side", _P * 3), ("row_slot", _P), ("n_side", _I * 3), ("n_slot_cols", _I),
        ("router", LpProj),
    ]  # fmt: skip


MAX_SIDE_RANK = 256
"""Largest rank of an expert LoRA branch the kernel takes (``csrc/layer.cpp`` ``expert_lora``);
a larger one keeps the layer on the graph."""


_FN: dict[str, Any] = {}
_CHECKED: set[str] = set()


def resolve_layer(want: str | None = None) -> str:
    """'c' or 'torch': ``want``, else ``$LORAPLANE_LAYER``, else auto ('c' on the C kernel paths).

    Raises:
        KernelPathError: unknown name.
    """
    w = want or os.environ.get("LORAPLANE_LAYER", "auto")
    if w not in LAYER_PATHS:
        raise cpu.KernelPathError(f"unknown layer path '{w}' (expected {', '.join(LAYER_PATHS)})")
    if w == "torch":
        return "torch"
    return "c" if cpu.resolve_path() != "torch" else "torch"


def _fn(path: str) -> Any:
    """The ``layer_forward`` export of ``path``'s library; checks once that the ctypes mirror has
    the C structs' sizes (``layer_abi``).

    Raises:
        KernelError: the mirror and the library disagree (a stale library or an edited header).
    """
    f = _FN.get(path)
    if f is None:
        lib = library.load(path)
        sizes = (ctypes.c_int64 * 6)()
        getattr(lib, f"lp_{path}_layer_abi")(ctypes.addressof(sizes))
        want = [ctypes.sizeof(t) for t in (LpMatmul, LpLora, LpProj, LpPairs, LpLayer, LpSide)]
        if list(sizes) != want:
            raise KernelError(f"layer kernel ABI mismatch: library struct sizes {list(sizes)}, ctypes {want}")
        f = _FN[path] = getattr(lib, f"lp_{path}_layer_forward")
    return f


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass
class Experts:
    """A layer's mixture of experts for the kernel (``csrc/layer.h`` ``LpLayer``'s MoE fields).

    gate_inp: the router, f32 ``(n_expert, n_embd)``, under the weight name ``router_name`` (its
    LoRA, a pool weight, is the ``'router'`` part); gate / up / down: each expert's packed
    weights, ``(n_ff, n_embd)``, ``(n_ff, n_embd)``, ``(n_embd, n_ff)`` in torch order; n_used:
    experts per row (``n_expert_used``); norm_w: renormalise the chosen weights to sum 1
    (llama.cpp ``build_moe_ffn``'s ``norm_w``).
    """

    router_name: str
    gate_inp: torch.Tensor
    gate: list[QuantLinear]
    up: list[QuantLinear]
    down: list[QuantLinear]
    n_used: int
    norm_w: bool


@dataclass
class Part:
    """One logical weight of a projection (a name the LoRA pool and the adapters know)."""

    name: str
    col: int
    d: int
    bias: torch.Tensor | None


ACT_KERNEL_CODE = {"i16": 0, "i8": 1, "bf16": 2}  # csrc/layer.h LpMatmul.act


def _fill_matmul(dst: LpMatmul, w: QuantLinear, path: str | None) -> None:
    assert w.qw is not None and w.scale is not None
    dst.qw, dst.sc, dst.bias = w.qw.data_ptr(), w.scale.data_ptr(), _ptr(w.bias)
    dst.off, dst.d, dst.k, dst.bs, dst.is_signed = w.offset, w.d, w.k, w.bs, int(w.signed)
    dst.act = ACT_KERNEL_CODE[w.resolved_act(path=path)]


class LayerKernel:
    """One layer's descriptor for ``layer_forward``, built once per model and layer.

    Args:
        dims: n_embd, n_head, n_head_kv, dk, dv, n_ff.
        norms: tensor by role ('attn_norm', 'q_norm', 'k_norm', 'post_attn_norm', 'ffn_norm',
            'post_ffw_norm'), f32 ``(n_embd,)`` or ``(dk,)``; absent roles are None.
        projections: per projection ('qkv', 'wo', 'ffn_in', 'down') its packed matmuls (outputs
            side by side) and its logical weights (:class:`Part`, columns over those outputs).
        scalars: eps, n_rot, neox, n_swa, act, q_scale, kq_scale, softcap.
        experts: the layer's mixture of experts (then 'ffn_in' and 'down' are absent and n_ff is
            an expert's width), or None for a dense FFN.
        path: the kernel path the descriptor is for (each matmul's activation precision is
            resolved for it, :meth:`QuantLinear.resolved_act`); default the process's.
    Raises:
        KernelError: more than 3 matmuls or parts in a projection, or widths that do not add up.
    """

    def __init__(
        self,
        dims: Sequence[int],
        norms: dict[str, torch.Tensor | None],
        projections: dict[str, tuple[list[QuantLinear], list[Part]]],
        scalars: dict[str, Any],
        experts: Experts | None = None,
        path: str | None = None,
    ):
        L = self.desc = LpLayer()
        L.n_embd, L.n_head, L.n_head_kv, L.dk, L.dv, L.n_ff = dims
        L.eps = scalars["eps"]
        L.n_rot, L.neox, L.n_swa = scalars["n_rot"], int(scalars["neox"]), scalars["n_swa"]
        L.act = ACT_CODE[scalars["act"]]
        L.q_scale, L.kq_scale, L.softcap = scalars["q_scale"], scalars["kq_scale"], scalars["softcap"]
        L.norm_min_parallel, L.attn_min_parallel_work = NORM_MIN_PARALLEL, MIN_PARALLEL_WORK
        self._keep: list[Any] = []  # tensors whose pointers the descriptor holds
        for role, t in norms.items():
            if t is not None:
                t = t.float().contiguous()
                self._keep.append(t)
            setattr(L, role, _ptr(t))
        self.parts: dict[str, list[Part]] = {}
        for role, (mms, parts) in projections.items():
            proj: LpProj = getattr(L, role)
            if len(mms) > MAX_PARTS or len(parts) > MAX_PARTS:
                raise KernelError(f"{role}: {len(mms)} matmuls / {len(parts)} parts, at most {MAX_PARTS}")
            for i, w in enumerate(mms):
                _fill_matmul(proj.mm[i], w, path)
            proj.n_mm, proj.d, proj.n_part = len(mms), sum(w.d for w in mms), len(parts)
            if sum(p.d for p in parts) != proj.d:
                raise KernelError(f"{role}: parts cover {sum(p.d for p in parts)} of {proj.d} columns")
            for i, p in enumerate(parts):
                proj.part[i].col, proj.part[i].d = p.col, p.d
                if p.bias is not None:
                    b = p.bias.float().contiguous()
                    self._keep.append(b)
                    proj.part[i].add_bias = b.data_ptr()
            self.parts[role] = parts
        if experts is not None:
            self._set_experts(experts, path)
        self._pairs = LpPairs()
        self._kv: tuple[Any, ...] | None = None  # the cache fields set last (data pointers, strides, dtype)
        self._lora_set = True  # parts may point at slots: the next call without LoRA clears them
        self._side_set = True

    def _set_experts(self, ex: Experts, path: str | None) -> None:
        L = self.desc
        n = len(ex.gate)
        if not (len(ex.up) == len(ex.down) == n == ex.gate_inp.shape[0]) or not 1 <= ex.n_used <= n:
            raise KernelError(f"experts: {n} gate, {len(ex.up)} up, {len(ex.down)} down, router {ex.gate_inp.shape}")
        exp_in, exp_down = (LpProj * n)(), (LpProj * n)()
        for e in range(n):
            for dst, mms in ((exp_in[e], (ex.gate[e], ex.up[e])), (exp_down[e], (ex.down[e],))):
                for i, w in enumerate(mms):
                    _fill_matmul(dst.mm[i], w, path)
                dst.n_mm, dst.d, dst.n_part = len(mms), sum(w.d for w in mms), 0
        router = ex.gate_inp.float().contiguous()
        self._keep += [router, exp_in, exp_down]
        L.n_expert, L.n_expert_used, L.moe_norm_w = n, ex.n_used, int(ex.norm_w)
        L.gate_inp, L.exp_in, L.exp_down = router.data_ptr(), ctypes.addressof(exp_in), ctypes.addressof(exp_down)
        L.router.n_mm, L.router.d, L.router.n_part = 0, n, 1
        L.router.part[0].col, L.router.part[0].d = 0, n
        self.parts["router"] = [Part(ex.router_name, 0, n, None)]

    def forward(
        self,
        x: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_rows: torch.Tensor,
        pos: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        lora: dict[str, Any] | None,
        pairs: LoraPairs | None,
        *,
        path: str,
        expert_lora: Sequence[Sequence[tuple[int, Any]]] = (),
        row_slot: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the layer on x f32 ``(n, n_embd)`` (contiguous; updated in place and returned).

        k_cache / v_cache: the layer's cache tensors ``(n_rows, cap, Hkv, d)``; cache_rows / pos:
        int64 ``(n,)``; cos_sin: f32 ``(n, 1, n_rot/2)`` each (None when n_rot is 0); lora: weight
        name → the pool's ``WeightSlots`` for the weights with a branch in use (``u`` used slots
        as ``lora['_u']``); pairs: the ubatch's (row, slot) pairs; expert_lora: with experts, per
        expert weight (gate, up, down) the ``(slot, SideBranch)`` of this ubatch's slots
        (``GraphContext.side_branches``: A ``(E, r, k)``, B ``(E, d, r)`` f32, r ≤
        :data:`MAX_SIDE_RANK`), read with row_slot f32 ``(n, slots)``.

        Raises:
            KernelError: the kernel refused the layer (its code in the message).
        """
        L = self.desc
        n = x.shape[0]
        kv = (k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(), v_cache.stride(), k_cache.dtype)
        if kv != self._kv:  # the descriptor keeps the last call's cache fields (one context: every call)
            L.k_cache, L.v_cache = kv[0], kv[1]
            L.kv_dtype = KV_DTYPE_CODE[k_cache.dtype]
            L.ks0, L.ks1, L.ks2 = kv[2][:3]
            L.vs0, L.vs1, L.vs2 = kv[3][:3]
            self._kv = kv
        keep: list[Any] = []  # what the descriptor points at, alive until the call returns
        have_lora = bool(lora) and pairs is not None and int(pairs.row.shape[0]) > 0
        nt = torch.get_num_threads()
        if have_lora or self._lora_set:
            self._set_lora(lora if have_lora else None, pairs, nt, keep)
        if expert_lora or self._side_set:
            self._set_sides(expert_lora, row_slot, keep)
        cs = sn = None
        if cos_sin is not None:
            cs, sn = cos_sin[0].contiguous(), cos_sin[1].contiguous()
        rc = _fn(path)(
            ctypes.addressof(L),
            x.data_ptr(),
            n,
            cache_rows.data_ptr(),
            pos.data_ptr(),
            _ptr(cs),
            _ptr(sn),
            ctypes.addressof(self._pairs),
            nt,
        )
        if rc != 0:
            raise KernelError(f"layer kernel refused the layer (code {rc})")
        return x

    def _set_lora(self, lora: dict[str, Any] | None, pairs: LoraPairs | None, nt: int, keep: list[Any]) -> None:
        """Point each part at its pool slots (None: clear every part and the pairs)."""
        L = self.desc
        for role, parts in self.parts.items():
            proj: LpProj = getattr(L, role)
            k = proj.mm[0].k if proj.n_mm else L.n_embd  # the router: no matmul of its own, reads n_embd
            for i, p in enumerate(parts):
                dst = proj.part[i]
                ws = lora.get(p.name) if lora is not None else None
                if ws is None:
                    dst.lora_a = None
                    continue
                assert pairs is not None and lora is not None
                u = lora["_u"]
                rank = torch.tensor(ws.rank_of[:u], dtype=torch.int32)
                keep.append(rank)
                R = int(ws.a.shape[1])
                P = int(pairs.row.shape[0])
                span = R * (k + p.d)
                big = P * span >= PARALLEL_MIN_MACS or pairs.n_slots * span >= PARALLEL_MIN_SLOT_FLOATS
                dst.lora_a, dst.lora_bt, dst.lora_R = ws.a.data_ptr(), ws.bt.data_ptr(), R
                dst.lora_rank, dst.lora_factor = rank.data_ptr(), ws.factor.data_ptr()
                dst.lora_nthreads = nt if big else 1
        pr = self._pairs
        if lora is not None:
            assert pairs is not None
            pr.slot, pr.scale, pr.row_ptr = pairs.slot.data_ptr(), pairs.scale.data_ptr(), pairs.row_ptr.data_ptr()
        else:
            pr.slot = pr.scale = pr.row_ptr = None
        self._lora_set = lora is not None

    def _set_sides(
        self, expert_lora: Sequence[Sequence[tuple[int, Any]]], row_slot: torch.Tensor | None, keep: list[Any]
    ) -> None:
        """The experts' LoRA branches of this call (none: cleared)."""
        L = self.desc
        L.row_slot, L.n_slot_cols = None, 0
        for w in range(3):
            L.side[w], L.n_side[w] = None, 0
        for w, branches in enumerate(expert_lora):
            if not branches:
                continue
            assert row_slot is not None and row_slot.dtype == torch.float32 and row_slot.is_contiguous()
            arr = (LpSide * len(branches))()
            for j, (slot, br) in enumerate(branches):
                arr[j].a, arr[j].b, arr[j].r = br.lora_a.data_ptr(), br.lora_b.data_ptr(), int(br.lora_a.shape[1])
                arr[j].slot, arr[j].factor = slot, br.factor
            keep.append(arr)
            L.side[w], L.n_side[w] = ctypes.addressof(arr), len(branches)
            L.row_slot, L.n_slot_cols = row_slot.data_ptr(), int(row_slot.shape[1])
        self._side_set = any(expert_lora)


__all__ = ["LAYER_PATHS", "MAX_SIDE_RANK", "Experts", "LayerKernel", "Part", "resolve_layer"]
