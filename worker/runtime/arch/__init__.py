"""Architecture registry: ``general.architecture`` string → builder module.

Each module provides three functions (llama.cpp ``load_hparams`` / ``load_tensors`` /
``build_graph`` split per arch in ``src/models/<arch>.cpp``):

- ``load_hparams(gguf) -> HParams``: hyper-parameters from metadata (raises ModelError on a
  missing key, naming it);
- ``tensor_specs(hparams) -> list[TensorSpec]``: tensors with their ggml ``ne`` and whether
  required;
- ``build_graph(ctx: GraphContext, hparams) -> logits``: the forward pass, built only from
  ``GraphContext`` blocks.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from worker.runtime.arch.base import HParams, TensorSpec, meta
from worker.runtime.errors import ModelError


def get(arch: str, path: Path | str = "") -> ModuleType:
    """Builder module for ``arch``.

    Raises:
        worker.runtime.errors.ModelError: unknown architecture (lists the supported ones).
    """
    from worker.runtime.arch import gemma2, gemma3, llama, phi3, qwen2, qwen3, qwen3moe

    known = {
        "gemma2": gemma2,
        "gemma3": gemma3,
        "llama": llama,
        "phi3": phi3,
        "qwen2": qwen2,
        "qwen3": qwen3,
        "qwen3moe": qwen3moe,
    }
    mod = known.get(arch)
    if mod is None:
        raise ModelError(f"{path}: unknown architecture '{arch}' (supported: {', '.join(sorted(known))})")
    return mod


__all__ = ["HParams", "TensorSpec", "get", "meta"]
