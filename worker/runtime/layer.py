"""One decoder layer, described by parameters (`LayerSpec`) and run by `build_layer`.

Every dense architecture of the table is the same layer with its own rules (llama.cpp
``src/models/{llama,qwen2,qwen3,gemma2,gemma3,phi3}.cpp``): q/k/v biases, per-head q/k norms,
rope mode, base, scale, frequency factors and attention factor, a q scale, the attention scale,
sliding window and soft-cap, sandwich norms around attention and FFN, SiLU or tanh-GELU, a fused
q/k/v or gate/up weight, or a mixture of experts. `build_layer` runs a layer one of two ways:

- the layer kernel (``worker.runtime.kernels.layer``, ``csrc/layer.cpp``): one C call per layer
  on the CPU kernel paths, wherever it takes the layer (`fused_layer_supported`);
- the op-by-op graph (`reference_layer`) from ``GraphContext`` blocks: CUDA, the torch path,
  float weights, and ``LORAPLANE_LAYER=torch``; the tests compare the kernel with it.

Both give the same rows: rows are independent, and the residual stream only ever gets ``+=``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from worker.runtime.graph import LORA_MODE, GraphContext
from worker.runtime.kernels import QuantLinear, resolve_path
from worker.runtime.kernels.attn import resolve_attn
from worker.runtime.kernels.attn import supports as attn_kernel_supports
from worker.runtime.kernels.layer import ACT_CODE, MAX_PARTS, MAX_SIDE_RANK, Experts, LayerKernel, Part, resolve_layer


@dataclass(frozen=True)
class Rope:
    """Rope of q and k (``ggml_rope_ext`` without YaRN): the first ``n_rot`` dims of each head,
    halves (``neox``) or adjacent pairs; ``freq_factors`` the name of an f32 ``(n_rot/2,)``
    weight or None; ``attn_factor`` multiplies cos and sin."""

    n_rot: int
    freq_base: float
    freq_scale: float = 1.0
    neox: bool = True
    freq_factors: str | None = None
    attn_factor: float = 1.0


@dataclass(frozen=True)
class MoeFFN:
    """A mixture-of-experts FFN (``GraphContext.build_moe_ffn``): tensor names and routing."""

    gate_inp: str
    up_exps: str
    gate_exps: str
    down_exps: str
    n_expert_used: int
    norm_w: bool


def moe_ffn(il: int, n_expert_used: int, *, norm_w: bool = True) -> MoeFFN:
    """Layer ``il``'s mixture of experts under the GGUF names every MoE architecture uses
    (``ffn_gate_inp``, ``ffn_{up,gate,down}_exps``)."""
    b = f"blk.{il}."
    return MoeFFN(
        gate_inp=b + "ffn_gate_inp.weight",
        up_exps=b + "ffn_up_exps.weight",
        gate_exps=b + "ffn_gate_exps.weight",
        down_exps=b + "ffn_down_exps.weight",
        n_expert_used=n_expert_used,
        norm_w=norm_w,
    )


@dataclass(frozen=True)
class LayerSpec:
    """Layer ``il``'s rules; tensor names are full GGUF names.

    Attributes:
        n_head, n_head_kv, dk, dv: attention shape; eps: every RMS norm's epsilon.
        qkv: ``(q, k, v)`` weights, or ``(qkv,)`` one fused weight whose output rows are
            ``[q | k | v]`` (Phi-3); qkv_bias: add ``attn_{q,k,v}.bias`` where the file has them.
        q_norm / k_norm: per-head RMS norm weights ``(dk,)`` or None.
        q_scale: q multiplied after rope (Gemma's ``f_attention_scale``, Phi-3's 1/sqrt(dk));
            kq_scale: the score scale; n_swa: sliding window (0: none); softcap: score soft-cap.
        post_attn_norm / post_ffw_norm: Gemma's sandwich norms or None.
        ffn_gate None: ``ffn_up`` is a fused ``(2·n_ff, d)`` weight, gate first (Phi-3).
        moe: a mixture of experts replaces the dense FFN (then ``ffn_*`` are unused).
    """

    prefix: str
    n_head: int
    n_head_kv: int
    dk: int
    dv: int
    eps: float
    rope: Rope
    qkv: tuple[str, ...]
    wo: str
    qkv_bias: bool = False
    q_norm: str | None = None
    k_norm: str | None = None
    q_scale: float = 1.0
    kq_scale: float = 1.0
    n_swa: int = 0
    softcap: float = 0.0
    post_attn_norm: str | None = None
    ffn_norm: str = ""
    ffn_gate: str | None = None
    ffn_up: str = ""
    ffn_down: str = ""
    act: str = "silu"
    post_ffw_norm: str | None = None
    moe: MoeFFN | None = None

    @property
    def attn_norm(self) -> str:
        return self.prefix + "attn_norm.weight"


def dense_spec(hp: Any, il: int, **rules: Any) -> LayerSpec:
    """Layer ``il``'s `LayerSpec` with the names and shapes every dense decoder shares (separate
    ``attn_{q,k,v}``, ``attn_output``, ``ffn_norm``, ``ffn_{gate,up,down}`` of ``blk.{il}.``; heads,
    head dims and epsilon from ``hp``), then ``rules`` (any field) over them."""
    b = f"blk.{il}."
    fields: dict[str, Any] = dict(
        prefix=b,
        n_head=hp.n_head,
        n_head_kv=hp.n_head_kv,
        dk=hp.n_embd_head_k,
        dv=hp.n_embd_head_v,
        eps=hp.eps,
        qkv=(b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"),
        wo=b + "attn_output.weight",
        ffn_norm=b + "ffn_norm.weight",
        ffn_gate=b + "ffn_gate.weight",
        ffn_up=b + "ffn_up.weight",
        ffn_down=b + "ffn_down.weight",
    )
    fields.update(rules)
    return LayerSpec(**fields)


def layer_specs(ctx: GraphContext, hp: Any, make: Callable[..., LayerSpec], *args: Any) -> list[LayerSpec]:
    """Every layer's spec, ``make(hp, il, *args)`` for ``il`` in ``range(hp.n_layer)``, built once
    per model, ``make`` and ``args`` (kept in ``ctx.layer_cache``: a spec depends on the file's
    hyper-parameters only, and ``args`` carry what a context chooses, such as Phi-3's LongRoPE
    factors); a context without that cache (the GPU's) builds them per ubatch."""
    cache = getattr(ctx, "layer_cache", None)
    key = ("specs", make, *args)
    specs = cache.get(key) if cache is not None else None
    if specs is None:
        specs = [make(hp, il, *args) for il in range(hp.n_layer)]
        if cache is not None:
            cache[key] = specs
    return specs


def _layer_env(ctx: GraphContext) -> tuple[bool, str | None, str]:
    """What the environment says for this ubatch's layers, read once per ubatch (a toggle between
    ubatches still takes effect): the layer kernel allowed (``LORAPLANE_LAYER`` and
    ``LORAPLANE_ATTN`` resolve to 'c'), ``$LORAPLANE_KERNEL_ACT``, the kernel path."""
    env = getattr(ctx, "layer_env", None)  # a subclass that skips GraphContext.__init__ has none
    if env is None:
        ok = resolve_layer() == "c" and resolve_attn() == "c"
        env = ctx.layer_env = (ok, os.environ.get("LORAPLANE_KERNEL_ACT"), resolve_path())
    return env


def build_layer(ctx: GraphContext, spec: LayerSpec, il: int, x: torch.Tensor, *, last: bool) -> torch.Tensor:
    """Layer ``il`` on the residual stream x ``(n, d)``; returns the next residual stream. On the
    last layer (``last``) only the rows whose logits are wanted continue
    (``GraphContext.build_inp_out_ids``). The layer kernel runs where
    :func:`fused_layer_supported` says so, else :func:`reference_layer`."""
    kern = fused_layer_kernel(ctx, spec, il, x)
    if kern is None:
        return reference_layer(ctx, spec, il, x, last=last)
    x = x if x.is_contiguous() else x.contiguous()
    names = [p.name for parts in kern.parts.values() for p in parts]
    lora = lora_branches(ctx, names)
    r = spec.rope
    cs = ctx.rope_tables(r.n_rot, r.freq_base, r.freq_scale, r.freq_factors, r.attn_factor)
    x = kern.forward(
        x,
        ctx.kv.k[il],
        ctx.kv.v[il],
        row_cache_rows(ctx),
        ctx.inp.pos,
        cs,
        lora,
        ctx.lora_pairs() if lora else None,
        path=_layer_env(ctx)[2],
        **_expert_lora(ctx, spec),
    )
    ctx.n_nodes += 30
    return ctx.build_inp_out_ids(x) if last else x


def _expert_lora(ctx: GraphContext, spec: LayerSpec) -> dict[str, Any]:
    """:meth:`LayerKernel.forward`'s ``expert_lora`` and ``row_slot`` for a mixture whose experts
    carry LoRA in this ubatch (``GraphContext.side_branches`` of gate, up, down); else nothing."""
    m = spec.moe
    if m is None or ctx.row_slot is None:
        return {}
    side = [ctx.side_branches(n) for n in (m.gate_exps, m.up_exps, m.down_exps)]
    if not any(side):
        return {}
    ctx.n_nodes += 4 * sum(len(s) for s in side)
    return {"expert_lora": side, "row_slot": ctx.row_slot.float().contiguous()}


def lora_branches(ctx: GraphContext, names: list[str]) -> dict[str, Any]:
    """The pool's slot buffers (``WeightSlots``) of the weights in ``names`` with a branch in a
    used slot, plus ``'_u'`` = the used slot count; empty when the ubatch has no LoRA."""
    if ctx.row_slot is None:
        return {}
    u = ctx.plan.s_used
    out: dict[str, Any] = {}
    for name in names:
        w = ctx.plan.pool.weights.get(name)
        if w is not None and any(w.rank_of[:u]):
            out[name] = w
    if out:
        out["_u"] = u
        ctx.n_nodes += 4 * (len(out) - 1)
    return out


def row_cache_rows(ctx: GraphContext) -> torch.Tensor:
    """int64 ``(n,)``: each ubatch row's KV-cache row (its sequence's), computed once per ubatch."""
    rows = ctx.layer_rows
    if rows is None:
        rows = torch.empty(ctx.inp.tokens.shape[0], dtype=torch.int64)
        for span in ctx.inp.spans:
            rows[span.rows] = ctx.kv.row_of[span.seq_id]
        ctx.layer_rows = rows
    return rows


def reference_layer(ctx: GraphContext, s: LayerSpec, il: int, x: torch.Tensor, *, last: bool) -> torch.Tensor:
    """The layer op by op from ``GraphContext`` blocks (the reference for the layer kernel)."""
    n = x.shape[0]
    cur = ctx.build_norm(x, s.attn_norm, s.eps)
    if len(s.qkv) == 1:
        qkv = ctx.build_lora_mm(s.qkv[0], cur)
        q_w, k_w = s.n_head * s.dk, s.n_head_kv * s.dk
        q, k, v = qkv[:, :q_w], qkv[:, q_w : q_w + k_w], qkv[:, q_w + k_w :]
    else:
        q, k, v = ctx.build_lora_mm_group(s.qkv, cur)
    if s.qkv_bias:
        q, k, v = (ctx.build_bias(t, s.prefix + f"attn_{c}.bias") for t, c in ((q, "q"), (k, "k"), (v, "v")))
    q = q.reshape(n, s.n_head, s.dk)
    k = k.reshape(n, s.n_head_kv, s.dk)
    v = v.reshape(n, s.n_head_kv, s.dv)
    if s.q_norm:
        q = ctx.build_norm(q, s.q_norm, s.eps)
    if s.k_norm:
        k = ctx.build_norm(k, s.k_norm, s.eps)
    r = s.rope
    q, k = (
        ctx.build_rope(
            t,
            n_rot=r.n_rot,
            freq_base=r.freq_base,
            freq_scale=r.freq_scale,
            neox=r.neox,
            freq_factors=r.freq_factors,
            attn_factor=r.attn_factor,
        )
        for t in (q, k)
    )
    if s.q_scale != 1.0:
        q = q * s.q_scale
    cur = ctx.build_attn(il, q, k, v, wo=s.wo, kq_scale=s.kq_scale, n_swa=s.n_swa, softcap=s.softcap)
    if last:
        cur, x = ctx.build_inp_out_ids(cur), ctx.build_inp_out_ids(x)
    if s.post_attn_norm:
        cur = ctx.build_norm(cur, s.post_attn_norm, s.eps)
    x = cur + x
    cur = ctx.build_norm(x, s.ffn_norm, s.eps)
    if s.moe is not None:
        m = s.moe
        cur = ctx.build_moe_ffn(
            cur,
            gate_inp=m.gate_inp,
            up_exps=m.up_exps,
            gate_exps=m.gate_exps,
            down_exps=m.down_exps,
            n_expert_used=m.n_expert_used,
            norm_w=m.norm_w,
            act=s.act,
        )
    else:
        cur = ctx.build_ffn(cur, up=s.ffn_up, gate=s.ffn_gate, down=s.ffn_down, act=s.act)
    if s.post_ffw_norm:
        cur = ctx.build_norm(cur, s.post_ffw_norm, s.eps)
    return cur + x


def fused_layer_supported(ctx: GraphContext, spec: LayerSpec, x: torch.Tensor) -> bool:
    """Whether the layer kernel takes this layer in this ubatch: the C kernel paths (and
    ``LORAPLANE_LAYER`` not 'torch', ``LORAPLANE_ATTN`` not 'torch', ``LORAPLANE_LORA`` not
    'dense'), f32 CPU activations, a known activation, every matmul (and every expert) a packed
    weight, no side-branch LoRA on the layer's weights, a KV cache the attention kernel takes,
    widths that are multiples of 32. A mixture of experts runs in the kernel with its router's
    LoRA and its experts' LoRA branches (f32, rank ≤ ``MAX_SIDE_RANK``; else the graph, for this
    ubatch)."""
    if not ctx.takes_layer_kernel or spec.act not in ACT_CODE or LORA_MODE == "dense":
        return False
    m = spec.moe
    if m is not None:
        for name in (m.gate_exps, m.up_exps, m.down_exps):
            for _, br in ctx.side_branches(name):
                a, b = br.lora_a, br.lora_b
                if a.dtype != torch.float32 or b.dtype != torch.float32 or a.shape[1] > MAX_SIDE_RANK:
                    return False
                if not (a.is_contiguous() and b.is_contiguous()):
                    return False
    if x.device.type != "cpu" or x.dtype != torch.float32 or ctx.dtype != torch.float32 or x.dim() != 2:
        return False
    return _layer_env(ctx)[0]


def fused_layer_kernel(ctx: GraphContext, spec: LayerSpec, il: int, x: torch.Tensor) -> LayerKernel | None:
    """The layer's kernel descriptor (built once per model, layer, precision override and path), or
    None where :func:`fused_layer_supported` refuses or the weights do not fit the kernel."""
    if not fused_layer_supported(ctx, spec, x):
        return None
    kv = ctx.kv
    if not attn_kernel_supports(kv.k[il], kv.v[il], spec.n_head):
        return None
    cache = ctx.layer_cache
    _, act, path = _layer_env(ctx)
    key = (il, act, path)
    if key in cache:
        return cache[key]
    kern = _make_kernel(ctx, spec, x.shape[1], path)
    cache[key] = kern
    return kern


def _units(ctx: GraphContext, names: tuple[str, ...]) -> list[tuple[tuple[str, ...], object]] | None:
    """``GraphContext.matmul_groups`` of ``names``; None when a name is missing or not packed."""
    if any(n not in ctx.w for n in names):
        return None
    out = ctx.matmul_groups(names)
    for _, w in out:
        if not isinstance(w, QuantLinear) or w.qw is None or w.scale is None:
            return None
    return out


def _make_kernel(ctx: GraphContext, s: LayerSpec, d: int, path: str) -> LayerKernel | None:
    w = ctx.w
    if any(ctx.has_side_branch(n) for n in (*s.qkv, s.wo, s.ffn_up, s.ffn_down, s.ffn_gate or "")):
        return None
    projections: dict[str, tuple[list[QuantLinear], list[Part]]] = {}

    def proj(role: str, names: tuple[str, ...], parts: list[Part] | None = None) -> bool:
        units = _units(ctx, names)
        if units is None or len(units) > MAX_PARTS:
            return False
        mms = [u for _, u in units]
        if parts is None:
            parts, col = [], 0
            for n in names:
                dn = w[n].d if isinstance(w[n], QuantLinear) else int(w[n].shape[0])
                bias = w.get(n.replace(".weight", ".bias")) if role == "qkv" and s.qkv_bias else None
                parts.append(Part(n, col, dn, bias))
                col += dn
        projections[role] = (mms, parts)  # type: ignore[assignment]
        return True

    dq, dkv, dvv = s.n_head * s.dk, s.n_head_kv * s.dk, s.n_head_kv * s.dv
    if len(s.qkv) == 1:
        # one fused weight: one LoRA-able name over all q|k|v columns
        if not proj("qkv", s.qkv, [Part(s.qkv[0], 0, dq + dkv + dvv, None)]):
            return None
    elif not proj("qkv", s.qkv):
        return None
    if not proj("wo", (s.wo,)):
        return None
    experts = None
    if s.moe is not None:
        experts = _experts(ctx, s.moe, d)
        if experts is None:
            return None
        n_ff = experts.gate[0].d
    elif s.ffn_gate is None:
        up = w.get(s.ffn_up)
        if not isinstance(up, QuantLinear):
            return None
        n_ff = up.d // 2
        if not proj("ffn_in", (s.ffn_up,), [Part(s.ffn_up, 0, up.d, None)]):
            return None
    else:
        gate = w.get(s.ffn_gate)
        if not isinstance(gate, QuantLinear):
            return None
        n_ff = gate.d
        if not proj("ffn_in", (s.ffn_gate, s.ffn_up)):
            return None
    if experts is None and not proj("down", (s.ffn_down,)):
        return None
    if projections["qkv"][0][0].k != d or (experts is None and projections["down"][0][0].k != n_ff):
        return None
    if d % 32 or n_ff % 32 or (s.n_head * s.dv) % 32 or s.rope.n_rot > s.dk or s.rope.n_rot % 2:
        return None
    norms = {
        "attn_norm": w.get(s.attn_norm),
        "q_norm": w.get(s.q_norm) if s.q_norm else None,
        "k_norm": w.get(s.k_norm) if s.k_norm else None,
        "post_attn_norm": w.get(s.post_attn_norm) if s.post_attn_norm else None,
        "ffn_norm": w.get(s.ffn_norm),
        "post_ffw_norm": w.get(s.post_ffw_norm) if s.post_ffw_norm else None,
    }
    for role, t in norms.items():
        if t is None and role in ("attn_norm", "ffn_norm"):
            return None
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 1):
            return None
    scalars = dict(
        eps=s.eps,
        n_rot=s.rope.n_rot,
        neox=s.rope.neox,
        n_swa=s.n_swa,
        act=s.act,
        q_scale=s.q_scale,
        kq_scale=s.kq_scale,
        softcap=s.softcap,
    )
    return LayerKernel((d, s.n_head, s.n_head_kv, s.dk, s.dv, n_ff), norms, projections, scalars, experts, path)


def _experts(ctx: GraphContext, m: MoeFFN, d: int) -> Experts | None:
    """The kernel's view of a mixture of experts: every expert a packed weight of one width, the
    router a float ``(n_expert, d)``; None where the weights do not fit."""
    w = ctx.w
    lists: list[list[QuantLinear]] = []
    for name in (m.gate_exps, m.up_exps, m.down_exps):
        ws = w.get(name)
        if not isinstance(ws, list) or not ws:
            return None
        if not all(isinstance(e, QuantLinear) and e.qw is not None and e.scale is not None for e in ws):
            return None
        lists.append(ws)
    gate, up, down = lists
    n_ff = gate[0].d
    if any(e.d != n_ff or e.k != d for e in (*gate, *up)) or any(e.d != d or e.k != n_ff for e in down):
        return None
    r = w.get(m.gate_inp)
    if isinstance(r, QuantLinear):
        r = r.weight if r.qw is None else r.dequantize()
    if not isinstance(r, torch.Tensor) or tuple(r.shape) != (len(gate), d):
        return None
    return Experts(m.gate_inp, r, gate, up, down, m.n_expert_used, m.norm_w)


__all__ = [
    "LayerSpec",
    "MoeFFN",
    "Rope",
    "build_layer",
    "dense_spec",
    "fused_layer_supported",
    "moe_ffn",
    "reference_layer",
]
