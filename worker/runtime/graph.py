"""Graph building blocks shared by every architecture (llama.cpp ``llm_graph_context``).

Architecture builders in ``worker.runtime.arch`` call only these methods; every base-weight matmul
goes through ``build_lora_mm`` / ``build_lora_mm_id`` / ``build_inp_embd``, so LoRA is
applied in exactly one place.

Scaling rule (one place, like llama.cpp ``build_lora_mm``): the base product first, then
``y += B · (S ⊙ (A x))`` where A/B are the weight's slot buffers of the adapter slot pool
(``worker.lora.pool``: every slot's branch stacked along rank, padded with zero rows) and S
holds, per row and slot, ``adapter_scale · alpha / rank`` (or ``adapter_scale`` when alpha
is 0): the row's set's ``adapter_scale`` of the slot's adapter (the routing input,
``worker.lora.plan``) times the slot's ``alpha / rank`` on this weight. Scaling after the A
product equals llama.cpp's scaling after B·A·x. Which adapters a mixed ubatch holds changes
only the input S; rows whose set lacks a slot's adapter get zero scales there. On the CPU
kernel paths (f32) the product is gathered (BGMV, ``worker.runtime.kernels.lora``): each row
multiplies only by the slots with a nonzero scale, so the work grows with the rows' adapters,
not with the used slots; elsewhere it is one dense matmul pair over the used slots.

Shapes are torch order. Symbols: ``n`` = token rows in the ubatch, ``d`` = n_embd,
``k`` = a matmul's input width, ``r`` = LoRA rank, ``E`` = experts, ``V`` = vocab.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from worker.lora.plan import LoraPlan
from worker.lora.pool import SideBranch
from worker.runtime.kernels import QuantLinear, quantize_activations, resolve_path
from worker.runtime.kernels.attn import attn_decode, resolve_attn
from worker.runtime.kernels.attn import supports as attn_kernel_supports
from worker.runtime.kernels.lora import LoraPairs, lora_bgmv, lora_dense, lora_pairs
from worker.runtime.kernels.norm import rms_norm
from worker.runtime.kv_cache import KVCache

LORA_MODE = os.environ.get("LORAPLANE_LORA", "auto")
"""``auto``: gathered LoRA (BGMV kernel) where it applies, else dense; ``dense``: always the
dense masked product (``GraphContext._add_lora``; for measurement and comparison)."""


@dataclass
class SeqSpan:
    """Rows of one sequence in a ubatch: ``rows`` int64 ``(t,)`` at positions ``pos0..pos0+t-1``."""

    seq_id: int
    rows: torch.Tensor
    pos0: int
    n: int


@dataclass
class DecodeRows:
    """The single-row sequences of a ubatch, for batched decode attention (all int64 on the
    compute device): ``rows`` ``(B,)`` ubatch rows, ``cache_rows`` ``(B,)`` their KV-cache
    rows, ``pos`` ``(B,)`` their positions; ``key_pos`` = ``arange(pos_max + 1)``;
    ``contiguous_from`` = r when ``cache_rows`` is ``r..r+B-1`` (KV read as a view)."""

    rows: torch.Tensor
    cache_rows: torch.Tensor
    pos: torch.Tensor
    pos_min: int
    pos_max: int
    key_pos: torch.Tensor
    contiguous_from: int | None


@dataclass
class GraphInputs:
    """Inputs of one ubatch (llama.cpp ``llm_graph_input_*``), all on the compute device.

    Attributes:
        tokens: int64 ``(n,)``.
        pos: int64 ``(n,)``.
        spans: rows grouped per sequence, positions contiguous within each.
        out_rows: int64 ``(n_out,)`` rows whose logits are wanted (``build_inp_out_ids``).
        decode_rows: the sequences that feed exactly one row (None: there are none).
        row_set: int64 ``(n,)`` the LoRA routing: each row's index into the plan's adapter
            sets (vLLM ``token_lora_indices``), expanded to per-row slot scales.
    """

    tokens: torch.Tensor
    pos: torch.Tensor
    spans: list[SeqSpan]
    out_rows: torch.Tensor
    row_set: torch.Tensor
    decode_rows: DecodeRows | None = None


class GraphContext:
    """Builds (executes) one ubatch's forward pass.

    Args:
        weights: base tensors by GGUF name (torch order).
        inputs: the ubatch.
        plan: the LoRA routing of the ubatch over the slot pool; rows are routed to its sets
            by ``inputs.row_set``, giving ``self.row_slot`` f32 ``(n, s_used)`` per-row slot
            scales (it follows the output-row cut).
        kv: the context's KV cache (K/V of this ubatch are appended to it).
        dtype: compute dtype.
        fused: ``(names...) -> QuantLinear`` packed weights that share an input, concatenated
            along the output rows (``worker.runtime.model.fuse_projections``); used by
            ``build_lora_mm_group``.
        layer_cache: the model's layer-kernel descriptors (``worker.runtime.layer``), kept
            between ubatches; a fresh dict when None.
    """

    takes_layer_kernel = True
    """Whether ``worker.runtime.layer`` may run this context's layers with the layer kernel (its KV
    cache is a ``KVCache``); the GPU context says no."""

    def __init__(
        self,
        weights: dict[str, Any],
        inputs: GraphInputs,
        plan: LoraPlan,
        kv: KVCache,
        dtype: torch.dtype,
        fused: dict[tuple[str, ...], QuantLinear] | None = None,
        layer_cache: dict[Any, Any] | None = None,
    ):
        self.w = weights
        self.layer_cache = {} if layer_cache is None else layer_cache  # worker.runtime.layer's kernels
        self.fused = fused or {}
        self.inp = inputs
        self.plan = plan
        self.kv = kv
        self.dtype = dtype
        # f32 (rows alive now, s_used) adapter_scale per row and slot; cut by build_inp_out_ids
        self.row_slot: torch.Tensor | None = None
        if not plan.empty:
            self.row_slot = plan.set_slot_scale.to(inputs.row_set.device).index_select(0, inputs.row_set)
        self._rows_reduced = False
        self._pairs: LoraPairs | None = None  # (row, slot) pairs of row_slot for the gathered LoRA
        self._lora_rank: dict[str, torch.Tensor] = {}  # int32 (s_used,) rank_of per weight
        self._rope_cache: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.layer_rows: torch.Tensor | None = None  # each row's KV-cache row (worker.runtime.layer)
        self.layer_env: tuple[bool, str | None, str] | None = None  # worker.runtime.layer, once per ubatch
        self.n_nodes = 0  # ggml-equivalent node count of what was built (reported)

    # --- inputs -----------------------------------------------------------------------
    def build_inp_embd(self, name: str = "token_embd.weight") -> torch.Tensor:
        """``get_rows(W, ids)`` plus the embedding LoRA of every slot the ubatch uses:
        ``Σ_s (S[:, s] · f_s) ⊙ (get_rows(A_s, ids) · B_sᵀ)``.

        W ``(V, d)``; per slot A_s ``(V, r)`` (ggml ne ``[r, V]``, the token_embd exception),
        B_s ``(d, r)``, f_s = alpha / r (a side branch, ``worker.lora.pool.SideBranch``);
        S ``(n, s_used)`` the per-row slot scales. Returns ``(n, d)``.
        """
        ids = self.inp.tokens
        w = self.w[name]
        x = (w.get_rows(ids) if isinstance(w, QuantLinear) else w.index_select(0, ids)).to(self.dtype)
        self.n_nodes += 1
        for slot, br in self.side_branches(name):
            assert self.row_slot is not None
            s = (self.row_slot[:, slot] * br.factor).to(br.lora_a.dtype).unsqueeze(1)  # (n, 1)
            a = br.lora_a.index_select(0, ids)  # (n, r)
            x = x + ((a * s) @ br.lora_b.T).to(x.dtype)
            self.n_nodes += 4
        return x

    def side_branches(self, name: str) -> list[tuple[int, SideBranch]]:
        """(slot, branch) of the side weight ``name`` for each slot this ubatch uses."""
        if self.row_slot is None:
            return []
        side = self.plan.pool.side
        return [(s, side[s][name]) for s in self.plan.side_slots if name in side[s]]

    def has_side_branch(self, name: str) -> bool:
        """Whether a slot in use holds a side branch (``SideBranch``) on weight ``name``."""
        return bool(self.side_branches(name))

    def lora_pairs(self) -> LoraPairs | None:
        """The (row, slot) pairs of the per-row slot scales for the rows alive now (None: no LoRA)."""
        if self.row_slot is None:
            return None
        if self._pairs is None:
            self._pairs = lora_pairs(self.row_slot)
        return self._pairs

    def build_inp_out_ids(self, x: torch.Tensor) -> torch.Tensor:
        """Keep only the rows whose logits are wanted (``ggml_get_rows(cur, inp_out_ids)``).

        Called on every tensor that continues past the cut; the first call also cuts the LoRA
        routing input so later branches see the reduced rows.
        """
        out = self.inp.out_rows
        if out.shape[0] == self.inp.tokens.shape[0]:
            return x
        if not self._rows_reduced:
            self._rows_reduced = True
            if self.row_slot is not None:
                self.row_slot = self.row_slot.index_select(0, out)
                self._pairs = None
        self.n_nodes += 1
        return x.index_select(0, out)

    # --- basic ops ----------------------------------------------------------------------
    def build_norm(self, x: torch.Tensor, name: str, eps: float) -> torch.Tensor:
        """RMS norm over the last dim times weight ``name`` (``LLM_NORM_RMS``).

        The mean of squares is accumulated in f64: torch splits a reduction differently with the
        number of rows (threads over the reduced dim when there are few rows), so in f32 a row's
        norm would depend on what else is in the ubatch; on the packed path such a last-bit
        difference can move int16 activation roundings downstream. On the C kernel paths (f32 on
        CPU) one call does it (``worker.runtime.kernels.norm.rms_norm``, the same double sum in a
        fixed order per row).
        """
        self.n_nodes += 2
        w = self.w[name]
        if (
            x.device.type == "cpu"
            and x.dtype == torch.float32
            and isinstance(w, torch.Tensor)
            and w.dtype == torch.float32
            and w.shape == (x.shape[-1],)
            and resolve_path() != "torch"
        ):
            # the same rule in one C call, its sum of squares in a fixed order per row
            # (worker.runtime.kernels.norm); 5-6 ms of a B=16 Gemma step in torch ops
            return rms_norm(x, w.contiguous(), eps).to(self.dtype)
        xf = x.float()
        ms = xf.double().pow(2).mean(-1, keepdim=True)
        y = xf * torch.rsqrt(ms + eps).float()
        return (y * self.w[name]).to(self.dtype)

    def build_bias(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``x + b`` for the optional bias vector ``name`` ``(d,)`` (f32) broadcast over the rows of
        x ``(n, d)``; x unchanged when the model has no such tensor (llama.cpp adds ``bq``/``bk``/
        ``bv`` after ``build_lora_mm`` when the layer has them, e.g. ``src/models/qwen2.cpp``)."""
        b = self.w.get(name)
        if b is None:
            return x
        self.n_nodes += 1
        return (x + b).to(x.dtype)

    def base_mm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for base weight ``name`` ``(d, k)``; x ``(n, k)`` → ``(n, d)`` in x's dtype.

        A packed weight (``QuantLinear``) is multiplied by our quantized kernels straight from
        its GGUF form (``worker.runtime.kernels``); a float weight by torch.
        """
        w = self.w[name]
        if isinstance(w, QuantLinear):
            return w.matmul(x).to(x.dtype)
        return x @ w.T

    def build_lora_mm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``W x`` plus the LoRA of every slot the ubatch uses, read from the pool by slot.

        W ``(d, k)``, x ``(n, k)`` → ``(n, d)``. With ``u`` = ``plan.s_used`` slots and the
        weight's padded rank ``R``: A = pool ``a[:u]`` viewed ``(u·R, k)``, B = pool
        ``bt[:u]`` viewed ``(u·R, d)`` (both contiguous), S ``(n, u)`` = per-row slot scale ×
        the slot's ``alpha / r`` on this weight.

        Semantics:
            for each row i, slot s < u:  y[i] += S[i, s] · B_s (A_s x[i])
        computed by the gathered kernel over the (row, slot) pairs with S ≠ 0, or as two dense
        matmuls with the mask between them (zero-padded rank rows and slots a row does not use
        contribute exact zeros); see ``_add_lora``.
        """
        y = self.base_mm(name, x)
        self.n_nodes += 1
        return self._add_lora(name, x, y)

    def _add_lora(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y + Σ_s S[:, s] · B_s (A_s x)`` over the used slots (``build_lora_mm``'s branch).

        Two forms with the same semantics (``worker.runtime.kernels.lora``): on the C kernel
        paths with f32 activations and slot buffers, the gathered product (BGMV,
        ``lora_bgmv``: each row reads only the slots its set holds, added into ``y`` in place;
        ``y`` is a fresh product owned by the caller, possibly a column slice of a fused one);
        otherwise (CUDA, bf16, the torch path, or ``LORA_MODE = "dense"``) the dense masked
        product over every used slot (``lora_dense``).
        """
        if self.row_slot is None:
            return y
        w = self.plan.pool.weights.get(name)
        u = self.plan.s_used
        if w is None or not any(w.rank_of[:u]):
            return y
        self.n_nodes += 4
        if (
            LORA_MODE != "dense"
            and x.device.type == "cpu"
            and x.dtype == y.dtype == w.a.dtype == torch.float32
            and x.dim() == 2
            and y.stride(-1) == 1
            and resolve_path() != "torch"
        ):
            rank = self._lora_rank.get(name)
            if rank is None:
                rank = self._lora_rank[name] = torch.tensor(w.rank_of[:u], dtype=torch.int32)
            pairs = self.lora_pairs()
            assert pairs is not None
            xc = x if x.is_contiguous() else x.contiguous()
            return lora_bgmv(xc, y, w.a, w.bt, rank, w.factor, pairs)
        return lora_dense(x, y, w.a[:u], w.bt[:u], w.factor[:u], self.row_slot)

    def matmul_groups(self, names: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
        """``names`` as the matmuls that compute them side by side: each longest run fused at
        load (``self.fused``) is one ``(run, fused weight)``, every other name ``((name,), weight)``."""
        calls: list[tuple[tuple[str, ...], Any]] = []
        i = 0
        while i < len(names):
            for j in range(len(names), i + 1, -1):
                fw = self.fused.get(tuple(names[i:j]))
                if fw is not None:
                    calls.append((tuple(names[i:j]), fw))
                    i = j
                    break
            else:
                calls.append(((names[i],), self.w[names[i]]))
                i += 1
        return calls

    def build_lora_mm_group(self, names: tuple[str, ...], x: torch.Tensor) -> list[torch.Tensor]:
        """``build_lora_mm(name, x)`` for several weights that read the same ``x``, with as few
        kernel calls as their packed forms allow: a run of ``names`` fused at load
        (``self.fused``) is one matmul whose output is split; when more than one packed call
        remains, ``x`` is quantized once per activation precision those weights use
        (``quantize_activations``; each weight's own ``QuantLinear.act``) and shared. Results equal
        the separate calls bit for bit (rows and output rows are independent in the kernels).
        Each weight's LoRA branch is then added as in ``build_lora_mm``.
        """
        calls = self.matmul_groups(names)
        n_by_act: dict[str, int] = {}
        for _, w in calls:
            if isinstance(w, QuantLinear) and w.qw is not None:
                a = w.resolved_act()
                if a != "bf16":  # read from f32 by each call: nothing to share
                    n_by_act[a] = n_by_act.get(a, 0) + 1
        xq: dict[str, Any] = {}
        if x.device.type == "cpu" and x.dim() == 2 and x.shape[-1] % 32 == 0 and resolve_path() != "torch":
            # one quantization per precision that more than one packed weight here uses
            xq = {a: quantize_activations(x, act=a) for a, c in n_by_act.items() if c > 1}
        out: list[torch.Tensor] = []
        for group, w in calls:
            if isinstance(w, QuantLinear):
                y = w.matmul(xq.get(w.resolved_act(), x) if w.qw is not None else x).to(x.dtype)
            else:
                y = x @ w.T
            if len(group) == 1:
                out.append(y)
            else:
                out += list(torch.split(y, [self.w[n].d for n in group], dim=-1))
        for idx, name in enumerate(names):
            self.n_nodes += 1
            out[idx] = self._add_lora(name, x, out[idx])
        return out

    def build_lora_mm_id(self, name: str, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Expert matmul routed by ``expert_ids`` (``ggml_mul_mat_id``) plus the experts' LoRA.

        W ``(E, d, k)``; x ``(n, k)`` or ``(n, K, k)`` (per selected expert); expert_ids
        int64 ``(n, K)``. Each used slot's A ``(E, r, k)`` and B ``(E, d, r)`` (a side branch,
        ``worker.lora.pool.SideBranch``) are routed by the same ids as W — never one expert's
        A/B for all tokens. Returns ``(n, K, d)``.
        """
        w = self.w[name]
        n, top_k = expert_ids.shape
        xk = x.unsqueeze(1).expand(n, top_k, x.shape[-1]) if x.dim() == 2 else x
        d_out = w[0].d if isinstance(w, list) else w.shape[1]
        out = torch.zeros((n, top_k, d_out), dtype=x.dtype, device=x.device)
        branches = self.side_branches(name)
        self.n_nodes += 1 + 4 * len(branches)
        for e in torch.unique(expert_ids).tolist():
            tok, k_idx = torch.nonzero(expert_ids == e, as_tuple=True)
            xe = xk[tok, k_idx]
            we = w[e]
            ye = we.matmul(xe).to(xe.dtype) if isinstance(we, QuantLinear) else xe @ we.T
            for lora_slot, br in branches:
                assert self.row_slot is not None
                s = (self.row_slot.index_select(0, tok)[:, lora_slot] * br.factor).to(xe.dtype).unsqueeze(1)
                ye = ye + ((xe @ br.lora_a[e].T) * s) @ br.lora_b[e].T
            out[tok, k_idx] = ye
        return out

    def build_output(self, x: torch.Tensor, *, tied_to: str = "token_embd.weight") -> torch.Tensor:
        """lm_head: f32 logits ``(n_out, V)`` from the final hidden rows ``x`` ``(n_out, d)``.

        With ``output.weight`` present it is an ordinary (LoRA-able) matmul. When tied to
        ``tied_to``, the base embedding matrix is used without the embedding adapter: we follow
        PEFT, where the embedding LoRA patches the input lookup only (llama.cpp instead applies
        it flipped here and aborts in ``build_lora_mm``).
        """
        if "output.weight" in self.w:
            return self.build_lora_mm("output.weight", x).float()
        self.n_nodes += 1
        return self.base_mm(tied_to, x).float()

    # --- attention --------------------------------------------------------------------
    def build_attn(
        self,
        il: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        wo: str,
        kq_scale: float,
        n_swa: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Store K/V in the cache, attend, project with ``wo``.

        q ``(n, H, dk)``, k ``(n, Hkv, dk)``, v ``(n, Hkv, dv)``; causal; when ``n_swa > 0``
        a key at position p_k is visible from p_q only if ``p_q - p_k < n_swa``
        (llama.cpp ``is_masked_swa``, LLAMA_SWA_TYPE_STANDARD). Returns ``(n, d)``.

        ``softcap > 0``: attention logit soft-capping, each score ``s = kq_scale · q·k``
        becomes ``softcap · tanh(s / softcap)`` before the mask and softmax (llama.cpp
        ``build_attn_mha`` with ``hparams.attn_soft_cap``, Gemma 2; the two coincide with
        llama.cpp's non-flash order whenever ``kq_scale`` is 1, as Gemma 2 passes it). The
        scores are then computed explicitly; with 0 the fused SDPA path is used unchanged.

        Sequences that feed one row (decode) are attended together in one batched op over
        the unified KV cache (``attn_decode_batch``); multi-row spans (prompts) one by one.
        """
        n, n_head, _ = q.shape
        dv = v.shape[-1]
        out = torch.empty((n, n_head, dv), dtype=q.dtype, device=q.device)
        dec = self.inp.decode_rows
        if dec is not None:
            out.index_copy_(0, dec.rows, attn_decode_batch(self.kv, il, q, k, v, dec, kq_scale, n_swa, softcap))
        for span in self.inp.spans:
            if dec is not None and span.n == 1:
                continue
            ks, vs = self.kv.store(
                il, span.seq_id, span.pos0, k.index_select(0, span.rows), v.index_select(0, span.rows)
            )
            qs = q.index_select(0, span.rows)
            k_lo = max(0, span.pos0 - n_swa + 1) if n_swa > 0 else 0
            ks, vs = ks[k_lo:].to(q.dtype), vs[k_lo:].to(q.dtype)
            q_pos = torch.arange(span.pos0, span.pos0 + span.n, device=q.device).unsqueeze(1)
            k_pos = torch.arange(k_lo, span.pos0 + span.n, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if n_swa > 0:
                mask = mask & (q_pos - k_pos < n_swa)
            o = _sdpa(
                qs.transpose(0, 1).unsqueeze(0),
                ks.transpose(0, 1).unsqueeze(0),
                vs.transpose(0, 1).unsqueeze(0),
                mask,
                kq_scale,
                softcap,
            )
            out.index_copy_(0, span.rows, o.squeeze(0).transpose(0, 1))
        self.n_nodes += 8
        return self.build_lora_mm(wo, out.reshape(n, n_head * dv))

    def build_rope(
        self,
        x: torch.Tensor,
        *,
        n_rot: int,
        freq_base: float,
        freq_scale: float = 1.0,
        neox: bool,
        freq_factors: str | None = None,
        attn_factor: float = 1.0,
    ) -> torch.Tensor:
        """Rope x ``(n, H, d_head)`` at the ubatch positions; cos/sin are computed once per
        ubatch for each (n_rot, base, scale, factors, attn_factor) and shared by every layer
        and by q and k.

        ``freq_factors``: name of an f32 ``(n_rot/2,)`` weight dividing each pair's frequency
        (``ggml_rope_ext``'s ``freq_factors``: Llama 3 ``rope_freqs.weight``, Phi-3 LongRoPE
        ``rope_factors_short/long.weight``); ``attn_factor`` multiplies cos and sin (ggml's
        ``mscale`` with no YaRN ramp; llama.cpp ``rope.scaling.attn_factor``)."""
        cs = self.rope_tables(n_rot, freq_base, freq_scale, freq_factors, attn_factor)
        self.n_nodes += 1
        return apply_rope(x, cs[0], cs[1], neox=neox)

    def rope_tables(
        self, n_rot: int, freq_base: float, freq_scale: float, freq_factors: str | None, attn_factor: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """f32 cos and sin ``(n, 1, n_rot/2)`` at the ubatch positions (``rope_cos_sin``, times
        ``attn_factor``), computed once per ubatch and parameter set (see ``build_rope``)."""
        key = (n_rot, freq_base, freq_scale, freq_factors, attn_factor)
        cs = self._rope_cache.get(key)
        if cs is None:
            cs = rope_cos_sin(
                self.inp.pos,
                n_rot=n_rot,
                freq_base=freq_base,
                freq_scale=freq_scale,
                freq_factors=None if freq_factors is None else self.w[freq_factors],
            )
            if attn_factor != 1.0:
                cs = (cs[0] * attn_factor, cs[1] * attn_factor)
            self._rope_cache[key] = cs
        return cs

    # --- feed-forward -------------------------------------------------------------------
    def build_ffn(self, x: torch.Tensor, *, up: str, gate: str | None, down: str, act: str) -> torch.Tensor:
        """Gated FFN ``down(act(gate x) * up x)`` (``LLM_FFN_PAR``); act "silu" or "gelu"
        (ggml_gelu = tanh approximation).

        ``gate=None``: ``up`` is a fused ``(2·n_ff, d)`` weight whose first ``n_ff`` output rows
        are the gate and the rest the up projection; one (LoRA-able) matmul, then the split
        (llama.cpp ``build_ffn`` with no gate and ``LLM_FFN_SWIGLU``/``LLM_FFN_SEQ``, i.e.
        ``ggml_swiglu``: act on the first half times the second; Phi-3)."""
        if gate is None:
            h = self.build_lora_mm(up, x)
            g, u = h.chunk(2, dim=-1)
        else:
            g, u = self.build_lora_mm_group((gate, up), x)
        self.n_nodes += 2
        return self.build_lora_mm(down, _act(g, act) * u)

    def build_moe_ffn(
        self,
        x: torch.Tensor,
        *,
        gate_inp: str,
        up_exps: str,
        gate_exps: str,
        down_exps: str,
        n_expert_used: int,
        norm_w: bool,
        act: str = "silu",
    ) -> torch.Tensor:
        """Top-k mixture of experts (llama.cpp ``build_moe_ffn``, softmax gating).

        x ``(n, d)`` → ``(n, d)``: probs = softmax(gate_inp x), top-k experts, weights
        renormalised over the chosen k when ``norm_w``, each expert a gated FFN.
        """
        logits = self.build_lora_mm(gate_inp, x).float()
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, n_expert_used, dim=-1)
        if norm_w:
            weights = weights / weights.sum(-1, keepdim=True)
        g = self.build_lora_mm_id(gate_exps, x, ids)
        u = self.build_lora_mm_id(up_exps, x, ids)
        h = _act(g, act) * u
        y = self.build_lora_mm_id(down_exps, h, ids)
        self.n_nodes += 8
        return (y * weights.to(y.dtype).unsqueeze(-1)).sum(1)


def attn_decode_batch(
    kv: KVCache,
    il: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dec: DecodeRows,
    kq_scale: float,
    n_swa: int,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Decode attention of ``GraphContext.build_attn``: one row per sequence, all sequences at
    once; store their K/V in ``kv`` (layer ``il``) with one indexed write, then attend.
    Returns ``(B, H, dv)`` in ``dec.rows`` order.

    CPU (default, ``LORAPLANE_ATTN`` auto|c): the C kernel ``attn_decode``
    (``worker.runtime.kernels.attn``) reads each row's keys ``lo..pos`` from the cache
    in place, online softmax in a fixed key order, f32. Otherwise (CUDA, a shape or
    dtype the kernel does not take, ``LORAPLANE_ATTN=torch``): read
    ``K/V[cache rows, lo:hi]`` ``(B, L, Hkv, d)`` (a view when the cache rows are
    consecutive), mask per row (causal + sliding window), one f64 SDPA call. Both make a
    row's result independent of the other rows of the ubatch."""
    kv.store_rows(il, dec.cache_rows, dec.pos, k.index_select(0, dec.rows), v.index_select(0, dec.rows))
    kc, vc = kv.k[il], kv.v[il]
    if q.device.type == "cpu" and resolve_attn() == "c" and attn_kernel_supports(kc, vc, q.shape[1]):
        o = attn_decode(
            q.index_select(0, dec.rows),
            kc,
            vc,
            dec.cache_rows,
            dec.pos,
            kq_scale=kq_scale,
            n_swa=n_swa,
            softcap=softcap,
            check=False,
        )
        return o.to(q.dtype)
    lo = max(0, dec.pos_min - n_swa + 1) if n_swa > 0 else 0
    ks, vs = kv.rows_view(il, dec.cache_rows, lo, dec.pos_max + 1, dec.contiguous_from)
    k_pos = dec.key_pos[lo : dec.pos_max + 1].unsqueeze(0)  # (1, L)
    q_pos = dec.pos.unsqueeze(1)  # (B, 1)
    mask = k_pos <= q_pos
    if n_swa > 0:
        mask = mask & (q_pos - k_pos < n_swa)
    # f64: the padded length L and the batch size change how SDPA splits its reductions, so in
    # f32 a row's result would depend on the other rows of the ubatch (see build_norm)
    qs = q.index_select(0, dec.rows).unsqueeze(2).double()  # (B, H, 1, dk)
    ks, vs = ks.transpose(1, 2).double(), vs.transpose(1, 2).double()
    o = _sdpa(qs, ks, vs, mask[:, None, None, :], kq_scale, softcap)
    return o.squeeze(2).to(q.dtype)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """Masked attention ``softmax(cap(scale · q kᵀ) + mask) v`` over q ``(B, H, Lq, dk)``,
    k ``(B, Hkv, Lk, dk)``, v ``(B, Hkv, Lk, dv)`` (GQA: each KV head serves H/Hkv query
    heads), mask bool broadcastable to ``(B, H, Lq, Lk)``; ``cap`` is ``c·tanh(s/c)`` for
    ``softcap = c > 0`` (explicit scores), the identity for 0 (fused SDPA)."""
    gqa = q.shape[1] != k.shape[1]
    if softcap <= 0.0:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _act(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return F.silu(x)
    if act == "gelu":
        return F.gelu(x, approximate="tanh")
    raise ValueError(f"unknown activation '{act}'")


def rope_cos_sin(
    pos: torch.Tensor,
    *,
    n_rot: int,
    freq_base: float,
    freq_scale: float = 1.0,
    freq_factors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """f32 ``(n, 1, n_rot/2)`` cos and sin of theta_i = pos · freq_scale · base^(-2i/n_rot) / f_i
    (``ggml_rope_ext`` without YaRN; f_i = ``freq_factors[i]`` ``(n_rot/2,)``, 1 when None),
    computed in f64 for accuracy at large positions."""
    half = n_rot // 2
    inv = freq_base ** (-torch.arange(0, half, device=pos.device, dtype=torch.float64) * 2.0 / n_rot)
    if freq_factors is not None:
        inv = inv / freq_factors.to(device=pos.device, dtype=torch.float64).reshape(half)
    theta = (pos.to(torch.float64) * freq_scale).unsqueeze(1) * inv.unsqueeze(0)
    return torch.cos(theta).float().unsqueeze(1), torch.sin(theta).float().unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, neox: bool) -> torch.Tensor:
    """Rotate x ``(n, H, d_head)`` by ``cos``/``sin`` from ``rope_cos_sin``. ``neox``: rotate
    halves (dims i and i+n_rot/2, LLAMA_ROPE_TYPE_NEOX); else adjacent pairs (2i, 2i+1,
    LLAMA_ROPE_TYPE_NORM). Dims past n_rot pass through."""
    xf = x.float()
    n_rot = 2 * cos.shape[-1]
    half = n_rot // 2
    rot, rest = xf[..., :n_rot], xf[..., n_rot:]
    if neox:
        x1, x2 = rot[..., :half], rot[..., half:]
        r = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        r = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return (torch.cat([r, rest], dim=-1) if rest.numel() else r).to(x.dtype)


def inv_sqrt(x: float) -> float:
    return 1.0 / math.sqrt(x)
