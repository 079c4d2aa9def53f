"""Graph builders: the forward pass of each architecture of the table in
``loraplane.formats.arch`` (which holds their hyper-parameters, tensors and LoRA targets).

Each builder module implements `GraphBuilder`: ``build_graph(ctx: GraphContext, hparams) ->
logits``, built only from ``GraphContext`` blocks (llama.cpp ``build_graph`` split per arch in
``src/models/<arch>.cpp``). `get` reads the table first, so an unknown architecture is refused
with the table's list; `BUILDERS` has one entry per table entry (a test compares them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from loraplane.formats import arch as arch_table
from loraplane.formats.arch import ArchError, ArchSpec, HParams
from loraplane.formats.gguf.reader import GGUFFile
from worker.runtime.arch import gemma2, gemma3, llama, phi3, qwen2, qwen3, qwen3moe
from worker.runtime.errors import ModelError
from worker.runtime.graph import GraphContext

H_contra = TypeVar("H_contra", bound=HParams, contravariant=True)


class GraphBuilder(Protocol[H_contra]):
    """The forward pass of one architecture (a module with this function)."""

    def build_graph(self, ctx: GraphContext, hp: H_contra, /) -> torch.Tensor:
        """Logits ``(n_out, n_vocab)`` of one ubatch for the wanted rows, from ``ctx``'s blocks."""
        raise NotImplementedError


BUILDERS: dict[str, GraphBuilder[Any]] = {
    "gemma2": gemma2,
    "gemma3": gemma3,
    "llama": llama,
    "phi3": phi3,
    "qwen2": qwen2,
    "qwen3": qwen3,
    "qwen3moe": qwen3moe,
}
"""Graph builder by ``general.architecture``: one per `loraplane.formats.arch.ARCHS` entry."""


def spec(arch: str, path: Path | str = "") -> ArchSpec[Any]:
    """The architecture table's entry for ``arch``.

    Raises:
        worker.runtime.errors.ModelError: unknown architecture (lists the supported ones).
    """
    try:
        return arch_table.get(arch, path)
    except ArchError as exc:
        raise ModelError(str(exc)) from exc


def load_hparams(arch: ArchSpec[Any], gguf: GGUFFile) -> HParams:
    """``arch.load_hparams(gguf)`` with the table's `ArchError` raised as ``ModelError``.

    Raises:
        worker.runtime.errors.ModelError: a required metadata key is missing or out of range.
    """
    try:
        return arch.load_hparams(gguf)
    except ArchError as exc:
        raise ModelError(str(exc)) from exc


def get(arch: str, path: Path | str = "") -> GraphBuilder[Any]:
    """Graph builder for ``arch``.

    Raises:
        worker.runtime.errors.ModelError: unknown architecture (lists the supported ones).
    """
    return BUILDERS[spec(arch, path).name]


__all__ = ["BUILDERS", "GraphBuilder", "get", "load_hparams", "spec"]
