"""Qwen 3 dense (llama.cpp ``src/models/qwen3.cpp``).

Per layer: RMS norm → q/k/v (no biases) → per-head RMS norm of q and of k
(``attn_q_norm`` / ``attn_k_norm``, over each head's ``head_dim``) → NEOX-mode rope →
attention with scale 1/sqrt(head_dim), GQA → o → residual → RMS norm → SiLU-gated FFN →
residual. The output projection is ``output.weight`` when present, else tied to
``token_embd`` (Qwen3 0.6B–4B files are tied).
"""

from __future__ import annotations

import torch

from loraplane.formats.arch.qwen3 import HParams
from worker.runtime.arch import blocks, qwen2
from worker.runtime.graph import GraphContext, inv_sqrt


def build_attn_block(ctx: GraphContext, hp: HParams, il: int, x: torch.Tensor) -> torch.Tensor:
    """Layer ``il``'s attention on the residual stream x ``(n, d)``: norm, q/k/v, per-head q/k
    RMS norms, NEOX rope, attention, o. Returns ``(n, d)`` before the residual add."""
    b = f"blk.{il}."
    cur = ctx.build_norm(x, b + "attn_norm.weight", hp.eps)
    q, k, v = blocks.build_qkv(ctx, hp, b, cur)
    q = ctx.build_norm(q, b + "attn_q_norm.weight", hp.eps)
    k = ctx.build_norm(k, b + "attn_k_norm.weight", hp.eps)
    q = ctx.build_rope(q, n_rot=hp.n_rot, freq_base=hp.rope_freq_base, freq_scale=hp.rope_freq_scale, neox=True)
    k = ctx.build_rope(k, n_rot=hp.n_rot, freq_base=hp.rope_freq_base, freq_scale=hp.rope_freq_scale, neox=True)
    return ctx.build_attn(il, q, k, v, wo=b + "attn_output.weight", kq_scale=inv_sqrt(hp.n_embd_head_k))


def build_graph(ctx: GraphContext, hp: HParams) -> torch.Tensor:
    """Forward pass of one ubatch (Qwen 2's decoder with this attention block); returns logits
    ``(n_out, n_vocab)`` for the wanted rows."""
    return qwen2.build_layers(ctx, hp, build_attn_block)
