"""The one architecture table: every architecture we serve and what each plane needs of it.

One `ArchSpec` per ``general.architecture`` value, in `ARCHS`:

- ``load_hparams(gguf) -> HParams``: hyper-parameters from ``{arch}.*`` metadata (llama.cpp
  ``load_hparams``); raises `ArchError` naming a missing key;
- ``tensor_specs(hparams) -> list[TensorSpec]``: the tensors a base file must (or may) hold,
  with their ggml ``ne`` as functions of the hyper-parameters (llama.cpp ``load_tensors``);
- ``lora_targets``: the weights the forward pass sends through its LoRA entry points, so the
  ones an adapter can patch (per-layer stems ``blk.N.<stem>.weight``, plus ``token_embd`` and
  ``output``);
- ``peft``: what PEFT conversion needs (`PeftNames`: the PEFT module → GGUF stem map and the
  name hints that tell the architecture from ``base_model_name_or_path``); None when we convert
  no PEFT folder for it.

The forward pass of each is a graph builder in ``worker.runtime.arch`` (torch; it implements
``worker.runtime.arch.GraphBuilder``). Adding an architecture is one entry here, its module
beside this one, and one builder there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from loraplane.formats.arch import gemma2, gemma3, llama, phi3, qwen2, qwen3, qwen3moe
from loraplane.formats.arch.base import ArchError, HParams, TensorSpec, meta
from loraplane.formats.gguf.reader import GGUFFile

H = TypeVar("H", bound=HParams)

PEFT_LAYER_MODULES: Mapping[str, str] = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
"""PEFT layer sub-module (``model.layers.N.<module>``) → GGUF tensor stem, as
``convert_hf_to_gguf.py``'s tensor map names them for every decoder we convert."""

GLOBAL_TARGETS = ("token_embd.weight", "output.weight")
"""LoRA targets outside the layers: the token embedding (``build_inp_embd``) and the LM head."""
ATTN_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output")
DENSE_TARGETS = (*ATTN_TARGETS, "ffn_gate", "ffn_up", "ffn_down")
MOE_TARGETS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
PHI3_TARGETS = ("attn_qkv", *ATTN_TARGETS, "ffn_up", "ffn_down")
"""Per-layer LoRA target stems (``blk.N.<stem>.weight``): q/k/v/o, the gated FFN, the MoE router
and experts (``build_lora_mm_id``), phi3's fused qkv and gate|up (no separate gate)."""


@dataclass(frozen=True)
class PeftNames:
    """What PEFT conversion (`loraplane.formats.convert_peft`) needs of an architecture.

    Attributes:
        modules: PEFT layer sub-module → GGUF tensor stem: those of `PEFT_LAYER_MODULES` whose
            stem is one of the architecture's LoRA targets, plus its own (phi3's fused
            ``qkv_proj`` / ``gate_up_proj``).
        hints: lower-case substrings of ``base_model_name_or_path`` / ``auto_mapping`` that
            name the architecture when no base GGUF is given.
    """

    modules: Mapping[str, str]
    hints: tuple[str, ...]


@dataclass(frozen=True)
class ArchSpec(Generic[H]):
    """One architecture of the table (see the module docstring for each field's rule).

    Attributes:
        name: the ``general.architecture`` value.
        load_hparams: metadata → hyper-parameters (raises `ArchError`).
        tensor_specs: hyper-parameters → the base tensors, ggml ``ne`` order.
        lora_targets: per-layer weight stems the forward pass applies LoRA to.
        peft: the PEFT conversion names, or None (no PEFT conversion for it).
    """

    name: str
    load_hparams: Callable[[GGUFFile], H]
    tensor_specs: Callable[[H], list[TensorSpec]]
    lora_targets: tuple[str, ...]
    peft: PeftNames | None

    def is_lora_target(self, tensor: str) -> bool:
        """Whether base tensor ``tensor`` (``blk.N.attn_q.weight``, ``token_embd.weight``) is
        one the forward pass applies LoRA to."""
        if tensor in GLOBAL_TARGETS:
            return True
        parts = tensor.split(".")
        return len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in self.lora_targets


def _peft(targets: tuple[str, ...], hints: tuple[str, ...], extra: Mapping[str, str] | None = None) -> PeftNames:
    """`PeftNames` whose modules are those of `PEFT_LAYER_MODULES` that map onto one of the
    architecture's LoRA ``targets``, plus its ``extra`` modules."""
    common = {module: stem for module, stem in PEFT_LAYER_MODULES.items() if stem in targets}
    return PeftNames({**common, **(extra or {})}, hints)


ARCHS: Mapping[str, ArchSpec[Any]] = {
    spec.name: spec
    for spec in (
        ArchSpec(
            "gemma2",
            gemma2.load_hparams,
            gemma2.tensor_specs,
            DENSE_TARGETS,
            _peft(DENSE_TARGETS, ("gemma-2", "gemma2", "gemma_2")),
        ),
        ArchSpec(
            "gemma3",
            gemma3.load_hparams,
            gemma3.tensor_specs,
            DENSE_TARGETS,
            _peft(DENSE_TARGETS, ("gemma-3", "gemma3", "gemma_3")),
        ),
        ArchSpec(
            "llama",
            llama.load_hparams,
            llama.tensor_specs,
            DENSE_TARGETS + MOE_TARGETS,
            _peft(DENSE_TARGETS, ("llama",)),
        ),
        # phi3's fused projections: qkv rows are q|k|v, ffn_up rows gate|up, gate first (its
        # tensor map in convert_hf_to_gguf.py); separate q/k/v are accepted too, no ffn_gate
        ArchSpec(
            "phi3",
            phi3.load_hparams,
            phi3.tensor_specs,
            PHI3_TARGETS,
            _peft(
                PHI3_TARGETS,
                ("phi-3", "phi3", "phi-4-mini"),
                {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
            ),
        ),
        ArchSpec(
            "qwen2",
            qwen2.load_hparams,
            qwen2.tensor_specs,
            DENSE_TARGETS,
            _peft(DENSE_TARGETS, ("qwen2", "qwen-2")),
        ),
        ArchSpec(
            "qwen3",
            qwen3.load_hparams,
            qwen3.tensor_specs,
            DENSE_TARGETS,
            _peft(DENSE_TARGETS, ("qwen3", "qwen-3")),
        ),
        # PEFT folders of MoE models hold per-expert modules; no converter writes them yet
        ArchSpec("qwen3moe", qwen3moe.load_hparams, qwen3moe.tensor_specs, ATTN_TARGETS + MOE_TARGETS, None),
    )
}
"""Every architecture we serve, by ``general.architecture``."""


def get(arch: str, path: Path | str = "") -> ArchSpec[Any]:
    """The table entry of ``arch`` (``path``: the file it came from, for the message).

    Raises:
        ArchError: an architecture not in `ARCHS` (names it and lists the supported ones).
    """
    spec = ARCHS.get(arch)
    if spec is None:
        raise ArchError(f"{path}: unknown architecture '{arch}' (supported: {', '.join(sorted(ARCHS))})")
    return spec


def peft_archs() -> tuple[str, ...]:
    """The architectures whose PEFT folders we convert, sorted."""
    return tuple(sorted(name for name, spec in ARCHS.items() if spec.peft is not None))


__all__ = [
    "ARCHS",
    "ArchError",
    "ArchSpec",
    "HParams",
    "PEFT_LAYER_MODULES",
    "PeftNames",
    "TensorSpec",
    "get",
    "meta",
    "peft_archs",
]
