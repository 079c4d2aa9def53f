"""Graph pieces several architectures' builders share (torch side of the architecture table)."""

from __future__ import annotations

import torch

from loraplane.formats.arch import HParams
from worker.runtime.graph import GraphContext


def build_qkv(
    ctx: GraphContext, hp: HParams, b: str, cur: torch.Tensor, *, biases: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer ``b``'s q/k/v from the normed input cur ``(n, d)`` through the one LoRA entry point
    (``GraphContext.build_lora_mm_group``), plus ``attn_{q,k,v}.bias`` when ``biases``, split
    into heads: q ``(n, H, dk)``, k ``(n, Hkv, dk)``, v ``(n, Hkv, dv)``."""
    n = cur.shape[0]
    q, k, v = ctx.build_lora_mm_group((b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"), cur)
    if biases:
        q, k, v = (ctx.build_bias(t, b + f"attn_{x}.bias") for t, x in ((q, "q"), (k, "k"), (v, "v")))
    return (
        q.reshape(n, hp.n_head, hp.n_embd_head_k),
        k.reshape(n, hp.n_head_kv, hp.n_embd_head_k),
        v.reshape(n, hp.n_head_kv, hp.n_embd_head_v),
    )
