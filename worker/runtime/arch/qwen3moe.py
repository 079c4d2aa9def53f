"""Qwen 3 mixture-of-experts (llama.cpp ``src/models/qwen3moe.cpp``).

Per layer: Qwen 3 attention (RMS norm → q/k/v → per-head q/k RMS norms → NEOX rope →
attention, scale 1/sqrt(head_dim) → o) → residual → RMS norm → mixture of experts:
softmax over ``ffn_gate_inp`` logits, top ``expert_used_count`` experts, their weights
renormalised to sum to 1 (llama.cpp passes ``norm_w = true`` for this arch), each a
SiLU-gated FFN of ``expert_feed_forward_length``; no shared expert → residual. Output
``output.weight`` or tied to ``token_embd``.
"""

from __future__ import annotations

import torch

from loraplane.formats.arch.qwen3moe import HParams
from worker.runtime.arch import qwen3
from worker.runtime.graph import GraphContext


def build_graph(ctx: GraphContext, hp: HParams) -> torch.Tensor:
    """Forward pass of one ubatch; returns logits ``(n_out, n_vocab)`` for the wanted rows."""
    x = ctx.build_inp_embd("token_embd.weight")
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        cur = qwen3.build_attn_block(ctx, hp, il, x)
        if il == hp.n_layer - 1:
            cur, x = ctx.build_inp_out_ids(cur), ctx.build_inp_out_ids(x)
        ffn_inp = cur + x
        cur = ctx.build_norm(ffn_inp, b + "ffn_norm.weight", hp.eps)
        cur = ctx.build_moe_ffn(
            cur,
            gate_inp=b + "ffn_gate_inp.weight",
            up_exps=b + "ffn_up_exps.weight",
            gate_exps=b + "ffn_gate_exps.weight",
            down_exps=b + "ffn_down_exps.weight",
            n_expert_used=hp.n_expert_used,
            norm_w=True,
        )
        x = cur + ffn_inp
    x = ctx.build_norm(x, "output_norm.weight", hp.eps)
    return ctx.build_output(x)
