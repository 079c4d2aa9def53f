"""Qwen 3 mixture-of-experts (llama.cpp ``src/models/qwen3moe.cpp``).

Per layer: Qwen 3 attention (RMS norm → q/k/v → per-head q/k RMS norms → NEOX rope →
attention, scale 1/sqrt(head_dim) → o) → residual → RMS norm → mixture of experts:
softmax over ``ffn_gate_inp`` logits, top ``expert_used_count`` experts, their weights
renormalised to sum to 1 (llama.cpp passes ``norm_w = true`` for this arch), each a
SiLU-gated FFN of ``expert_feed_forward_length``; no shared expert → residual. Output
``output.weight`` or tied to ``token_embd``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.runtime.arch import base, qwen3
from worker.runtime.arch.base import TensorSpec, meta
from worker.runtime.errors import ModelError
from worker.runtime.graph import GraphContext


@dataclass(frozen=True)
class HParams(qwen3.HParams):
    """Qwen 3 MoE hyper-parameters: Qwen 3's plus the expert counts and expert FFN width."""

    n_expert: int
    n_expert_used: int
    n_ff_exp: int


def load_hparams(gguf) -> HParams:
    """``qwen3moe.*`` metadata (llama.cpp ``llama_model_qwen3moe::load_arch_hparams``); the
    expert width defaults to ``feed_forward_length / expert_used_count`` as llama.cpp does.

    Raises:
        worker.runtime.errors.ModelError: no experts or no used-expert count.
    """
    q = qwen3.load_hparams(gguf)
    n_expert = int(meta(gguf, "expert_count", 0))
    n_used = int(meta(gguf, "expert_used_count", 0))
    if n_expert <= 0 or n_used <= 0:
        raise ModelError(f"{gguf.path}: qwen3moe needs expert_count and expert_used_count > 0")
    n_ff_exp = int(meta(gguf, "expert_feed_forward_length", 0)) or q.n_ff // n_used
    return HParams(**vars(q), n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp)


def tensor_specs(hp: HParams) -> list[TensorSpec]:
    d, f, e = hp.n_embd, hp.n_ff_exp, hp.n_expert
    specs = base.output_specs(hp)
    for il in range(hp.n_layer):
        b = f"blk.{il}."
        specs += qwen3.attn_tensor_specs(hp, b)
        specs += [
            TensorSpec(b + "ffn_norm.weight", (d,)),
            TensorSpec(b + "ffn_gate_inp.weight", (d, e)),
            TensorSpec(b + "ffn_gate_exps.weight", (d, f, e)),
            TensorSpec(b + "ffn_up_exps.weight", (d, f, e)),
            TensorSpec(b + "ffn_down_exps.weight", (f, d, e)),
        ]
    return specs


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
