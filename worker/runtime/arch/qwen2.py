"""Qwen 2 / 2.5 (llama.cpp ``src/models/qwen2.cpp``).

Per layer: RMS norm → q/k/v, each plus its bias (``attn_{q,k,v}.bias``) → NEOX-mode rope
(halves rotated; the converter does not permute q/k for this arch) → attention with scale
1/sqrt(head_dim), GQA → o → residual → RMS norm → SiLU-gated FFN → residual. The output
projection is ``output.weight`` when the file has it, else tied to ``token_embd`` (stock
Qwen2.5 0.5–3B files are tied).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from loraplane.formats.arch.qwen2 import HParams
from worker.runtime.arch import blocks
from worker.runtime.graph import GraphContext, inv_sqrt


def build_attn_block(ctx: GraphContext, hp: HParams, il: int, x: torch.Tensor) -> torch.Tensor:
    """Layer ``il``'s attention on the residual stream x ``(n, d)``: norm, q/k/v plus biases,
    NEOX rope, attention, o. Returns ``(n, d)`` before the residual add."""
    b = f"blk.{il}."
    cur = ctx.build_norm(x, b + "attn_norm.weight", hp.eps)
    q, k, v = blocks.build_qkv(ctx, hp, b, cur, biases=True)
    q = ctx.build_rope(q, n_rot=hp.n_rot, freq_base=hp.rope_freq_base, freq_scale=hp.rope_freq_scale, neox=True)
    k = ctx.build_rope(k, n_rot=hp.n_rot, freq_base=hp.rope_freq_base, freq_scale=hp.rope_freq_scale, neox=True)
    return ctx.build_attn(il, q, k, v, wo=b + "attn_output.weight", kq_scale=inv_sqrt(hp.n_embd_head_k))


AttnBlock = Callable[[GraphContext, Any, int, torch.Tensor], torch.Tensor]


def build_layers(ctx: GraphContext, hp: HParams, attn_block: AttnBlock) -> torch.Tensor:
    """The Qwen 2 / Qwen 3 decoder around ``attn_block``: per layer attention → residual → RMS
    norm → SiLU-gated FFN → residual; then the output norm and head. Returns logits
    ``(n_out, n_vocab)`` for the wanted rows."""
    x = ctx.build_inp_embd("token_embd.weight")
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        cur = attn_block(ctx, hp, il, x)
        if il == hp.n_layer - 1:
            cur, x = ctx.build_inp_out_ids(cur), ctx.build_inp_out_ids(x)
        ffn_inp = cur + x
        cur = ctx.build_norm(ffn_inp, b + "ffn_norm.weight", hp.eps)
        cur = ctx.build_ffn(
            cur, up=b + "ffn_up.weight", gate=b + "ffn_gate.weight", down=b + "ffn_down.weight", act="silu"
        )
        x = cur + ffn_inp
    x = ctx.build_norm(x, "output_norm.weight", hp.eps)
    return ctx.build_output(x)


def build_graph(ctx: GraphContext, hp: HParams) -> torch.Tensor:
    """Forward pass of one ubatch; returns logits ``(n_out, n_vocab)`` for the wanted rows."""
    return build_layers(ctx, hp, build_attn_block)
