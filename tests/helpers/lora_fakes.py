"""Synthetic in-memory LoRA adapters for unit tests of the pool, the plan and the scheduler's
pieces (no GGUF file behind them): one pair per weight name, A ``(rank, K)``, B ``(D, rank)``
in torch order, seeded random values."""

from __future__ import annotations

import types

import torch

from worker.lora.adapter import LoraAdapter, LoraPair

K, D = 8, 6
"""Input and output width of every synthetic weight."""


def adapter(
    name: str,
    *,
    rank: int = 2,
    alpha: float = 0.0,
    invocation: tuple[int, ...] = (),
    weights: tuple[str, ...] = ("w",),
    seed: int = 0,
) -> LoraAdapter:
    """A LoRA adapter ``name`` (sha256 ``name * 8``) with a pair on each of ``weights``."""
    g = torch.Generator().manual_seed(seed)
    pairs = {w: LoraPair(w, torch.randn(rank, K, generator=g), torch.randn(D, rank, generator=g)) for w in weights}
    return LoraAdapter(
        path=f"/x/{name}.gguf",
        sha256=name * 8,
        arch="llama",
        name=name,
        alpha=alpha,
        pairs=types.MappingProxyType(pairs),
        alora_invocation_tokens=invocation,
        task_name="",
        prompt_prefix="",
        size_bytes=0,
    )
