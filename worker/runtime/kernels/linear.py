"""GGUF linear weights kept in (close to) their quantized form, and the matmul that reads it.

`pack_tensor` (and `pack_experts` for 3-D expert tensors) turns a GGUF tensor record into a
`QuantLinear`: the repacked exact int8 form of ``worker.runtime.kernels.repack`` for the block
types it covers (multiplied on CPU by the C kernels, activations quantized per row and per 32 by
`quantize_activations`, int16 or int8 per weight — or rounded to bf16 for the AMX-BF16 tiles:
`resolve_act`, `ACTS`), an f32 tensor for
F32/F16/BF16 (`FLOAT_TYPES`), or a dequantized weight multiplied by torch on CUDA and the
``torch`` path. ``QuantLinear.matmul(x)`` takes ``x`` ``(n, k)`` (or ``(..., k)``) and returns
``y = x @ W.T`` ``(n, d)`` f32, what ggml's ``mul_mat(W, x)`` computes; rows never share a
scale, so a row's result is the same alone or batched. A weight or input the kernels cannot
handle raises `KernelError`.

Weight forms, activation precision per weight, paths: ``worker/runtime/kernels/README.md``
("Weight form", "Kernels", "Activation precision per weight", "bf16 tiles", "Paths and dispatch").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import structlog
import torch
from gguf import GGMLQuantizationType as T

from loraplane.formats.gguf.reader import GGUFError, TensorRecord
from loraplane.formats.gguf.reader import dequantize as gguf_dequantize
from worker.gpu.dequant import dequantize_tensor
from worker.runtime.device import resolve_device
from worker.runtime.errors import ModelError
from worker.runtime.kernels import cpu, library
from worker.runtime.kernels.repack import REPACK_TYPES, R, decode, interleave
from worker.runtime.kernels.sample import TOPK_MAX

log = structlog.get_logger("loraplane.worker.runtime.kernels.linear")

FLOAT_TYPES = {T.F32, T.F16, T.BF16}


ACTS = ("i16", "i8", "bf16")


def resolve_act(act: str | None = None, weight_act: str | None = None) -> str:
    """The activation precision a matmul uses, in this order: ``act`` (a caller forcing it for
    one call), ``$LORAPLANE_KERNEL_ACT`` (a forced override for every weight of the process,
    for measurement), ``weight_act`` (the weight's own choice, :attr:`QuantLinear.act`, set at
    model load by :func:`worker.runtime.model.assign_acts`), else 'i16'.

    It never depends on the batch: a row's result is the same alone or batched. 'bf16' runs only
    on the amx path and only for some weights (:meth:`QuantLinear.resolved_act` turns it into
    'i16' elsewhere).

    Raises:
        KernelError: not one of :data:`ACTS`.
    """
    want = act or os.environ.get("LORAPLANE_KERNEL_ACT") or weight_act or "i16"
    if want not in ACTS:
        raise KernelError(f"unknown activation precision '{want}' (expected {', '.join(ACTS)})")
    return want


class KernelError(ValueError):
    """A weight or input the kernels cannot handle (type, shape, dtype, device); names it."""


@dataclass(frozen=True)
class QuantizedActivations:
    """Rows of ``x`` quantized per row and per block of 32: int16 (``d = amax/32767``) or int8
    (``d = amax/127``, llama.cpp ``quantize_row_q8_0``).

    Build once with :func:`quantize_activations` and pass to several ``matmul`` calls that
    share the input (q/k/v, gate/up). Attributes (torch order): ``q`` int8 or int16 ``(n, k)``;
    ``d`` f32 ``(n, k/32)`` scales; ``s16`` / ``s32`` f32 ``(n, k/16)`` / ``(n, k/32)``
    = ``d * sum(q)`` per 16 / 32; ``path`` the ISA that made it; ``act`` 'i16' or 'i8'.
    """

    q: torch.Tensor
    d: torch.Tensor
    s16: torch.Tensor
    s32: torch.Tensor
    path: str
    act: str

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1]


def _p(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


_FNS: dict[tuple[str, str], tuple] = {}
_FN_NAMES = {
    "i8": ("quantize_act", "qmm", "qmm_f32"),
    "i16": ("quantize_act16", "qmm16", "qmm16_f32"),
    "bf16": (None, None, "qmmbf16_f32"),  # the amx library only; read from f32, never pre-quantized
}


def _fns(path: str, act: str) -> tuple:
    """(quantize, qmm, qmm_f32) ctypes functions of ``path``'s library for ``act`` (loaded once;
    None where ``act`` has no such function)."""
    f = _FNS.get((path, act))
    if f is None:
        lib = library.load(path)
        f = _FNS[(path, act)] = tuple(None if n is None else getattr(lib, f"lp_{path}_{n}") for n in _FN_NAMES[act])
    return f


def quantize_activations(x: torch.Tensor, path: str | None = None, act: str | None = None) -> QuantizedActivations:
    """Quantize ``x`` ``(n, k)`` f32/bf16/f16 CPU (k a multiple of 32) for the C kernels.

    Args:
        path: ISA ('amx' | 'avx512' | 'avx2'; default :func:`~worker.runtime.kernels.cpu.resolve_path`).
        act: 'i16' | 'i8' (default :func:`resolve_act`; 'bf16' is read from f32 by each matmul
            and has no quantized form).
    Raises:
        KernelError: not a 2-D CPU tensor, ``k`` not a multiple of 32, unknown ``act`` or 'bf16'.
        KernelPathError: ``path`` is not runnable here, or is 'torch'.
    """
    p = cpu.resolve_path(path)
    a = resolve_act(act)
    if a == "bf16":
        raise KernelError("bf16 activations have no quantized form: pass the f32 rows to matmul")
    if p == "torch":
        raise cpu.KernelPathError("quantize_activations is for the C kernel paths, not 'torch'")
    if x.dim() != 2 or x.device.type != "cpu":
        raise KernelError(f"activations must be a 2-D CPU tensor, got {tuple(x.shape)} on {x.device}")
    n, k = x.shape
    if k % 32:
        raise KernelError(f"activation width {k} is not a multiple of 32")
    xf = x.to(torch.float32).contiguous()
    q = torch.empty((n, k), dtype=torch.int8 if a == "i8" else torch.int16)
    d = torch.empty((n, k // 32), dtype=torch.float32)
    s16 = torch.empty((n, k // 16), dtype=torch.float32)
    s32 = torch.empty((n, k // 32), dtype=torch.float32)
    _fns(p, a)[0](
        xf.data_ptr(), k, n, k, q.data_ptr(), d.data_ptr(), s16.data_ptr(), s32.data_ptr(), torch.get_num_threads()
    )
    return QuantizedActivations(q, d, s16, s32, p, a)


@dataclass(eq=False)
class QuantLinear:
    """One GGUF linear weight in its packed form (see the module docstring).

    Attributes:
        name: GGUF tensor name.
        ggml_type: the GGUF storage type.
        k, d: input width and output rows (ggml ``ne = [k, d]``).
        qw: uint8 ``(G, nb, bs/4, 16, 4)`` interleaved values (repacked types), else None.
        scale / bias: f32 ``(G, nb, 16)``; bias None where ``c = offset * scale`` (Q4_0, Q5_0,
            Q6_K, and Q8_0's signed form with offset 0).
        offset: the implicit ``c / s`` when bias is None.
        bs: sub-block size of ``scale`` (16 or 32); signed: Q8_0's int8 values.
        weight: float ``(d, k)`` weight (F32/F16/BF16 types and the torch path), else None.
        device: where the weight lives, in the resolved form tensors report (``cpu``,
            ``cuda:N``; :func:`worker.runtime.device.resolve_device`, applied here to
            whatever is passed): :meth:`matmul` compares its input's device with it.
        act: this weight's activation precision on the C kernel paths, 'i16' | 'i8' | 'bf16'
            (chosen per weight at model load, :func:`worker.runtime.model.assign_acts`;
            overridden for all weights by ``$LORAPLANE_KERNEL_ACT``, see :func:`resolve_act`;
            'bf16' runs where :attr:`takes_bf16` and the amx path with AMX-BF16, else 'i16').
        rescore: when > 0 and this weight runs 'i8': each row's ``rescore`` largest outputs
            are recomputed with int16 activations (equal bit for bit to the 'i16' kernel's
            values), the rest stay int8 — an LM head option that keeps the top candidates'
            logits exact (:meth:`matmul`).
    """

    name: str
    ggml_type: T
    k: int
    d: int
    device: torch.device
    qw: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    bs: int = 32
    signed: bool = False
    offset: float = 0.0
    weight: torch.Tensor | None = None
    act: str = "i16"
    rescore: int = 0
    _f32_cache: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.device = _resolve(self.device, self.name)

    @property
    def nbytes(self) -> int:
        """Bytes this weight holds (packed values + scales, or the float weight)."""
        ts = [self.qw, self.scale, self.bias, self.weight, self._f32_cache]
        return sum(int(t.numel() * t.element_size()) for t in ts if t is not None)

    @property
    def takes_bf16(self) -> bool:
        """Whether the bf16 tiles (``csrc/qmmbf16.cpp``) take this weight: packed unsigned values
        (all below 128) — Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K (blocks of 32), Q6_K (16); not
        Q8_0's signed values."""
        return self.qw is not None and not self.signed and self.bs in (16, 32)

    def resolved_act(self, act: str | None = None, path: str | None = None) -> str:
        """The precision :meth:`matmul` uses for this weight on ``path`` (default
        :func:`~worker.runtime.kernels.cpu.resolve_path`): :func:`resolve_act` with ``act``, the
        environment override and :attr:`act`; 'bf16' becomes 'i16' off the amx path, on a CPU
        without AMX-BF16, or for a weight the bf16 tiles do not take (:attr:`takes_bf16`)."""
        a = resolve_act(act, self.act)
        if a == "bf16" and not (self.takes_bf16 and cpu.resolve_path(path) == "amx" and cpu.bf16_tiles_supported()):
            return "i16"
        return a

    def dequantize(self) -> torch.Tensor:
        """The weight as f32 ``(d, k)`` (torch order), on ``device``: exactly what
        ``loraplane.formats.gguf.reader.dequantize`` gives on CPU; on CUDA the bf16 copy, widened."""
        if self.qw is None:
            assert self.weight is not None  # float weights keep `weight`
            return self.weight.to(torch.float32)
        assert self.scale is not None
        G, nb = self.qw.shape[0], self.qw.shape[1]
        u = self.qw.permute(0, 3, 1, 2, 4).reshape(G * R, nb, self.bs)[: self.d]
        return self._affine(
            u,
            self.scale.permute(0, 2, 1).reshape(G * R, nb)[: self.d],
            None if self.bias is None else self.bias.permute(0, 2, 1).reshape(G * R, nb)[: self.d],
        )

    def _affine(self, u: torch.Tensor, s: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
        """``s * u + c`` per block; u ``(m, nb, bs)`` -> f32 ``(m, k)``."""
        uf = (u.view(torch.int8) if self.signed else u).to(torch.float32)
        w = uf * s.unsqueeze(-1)
        if c is not None:
            w = w + c.unsqueeze(-1)
        elif self.offset:
            w = w + s.unsqueeze(-1) * self.offset
        return w.reshape(u.shape[0], self.k)

    def get_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight as f32 ``(m, k)`` (embedding lookup, ``ggml_get_rows``).

        Args:
            ids: int ``(m,)`` row indices in ``[0, d)``.
        Raises:
            KernelError: an index out of range.
        """
        ids = ids.reshape(-1).to(device=self.device, dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.d):
            raise KernelError(f"{self.name}: row index out of range [0, {self.d})")
        if self.qw is None:
            assert self.weight is not None
            return self.weight.index_select(0, ids).to(torch.float32)
        assert self.scale is not None
        g, r = ids // R, ids % R
        u = self.qw[g, :, :, r, :]  # (m, nb, bs/4, 4)
        u = u.reshape(ids.numel(), -1, self.bs)
        s = self.scale[g, :, r]  # (m, nb)
        c = None if self.bias is None else self.bias[g, :, r]
        return self._affine(u, s, c)

    def matmul(
        self, x: torch.Tensor | QuantizedActivations, *, path: str | None = None, act: str | None = None
    ) -> torch.Tensor:
        """``y = x @ W.T``: x ``(..., k)`` f32/bf16/f16 (or pre-quantized rows) -> f32 ``(..., d)``.

        Args:
            x: activations, on this weight's device (``x.device == self.device``: both are the
                resolved form, so ``cuda:0`` and an index-less ``cuda`` cannot disagree).
            path: force 'amx' | 'avx512' | 'avx2' | 'torch' for this call (default: see
                :func:`worker.runtime.kernels.cpu.resolve_path`); ignored for float weights.
                'amx' runs int8 and int16 activations on AMX tiles (bit-identical to
                avx512's kernels).
            act: force activation precision 'i16' | 'i8' for this call (default: this weight's,
                :meth:`resolved_act`). Pre-quantized ``x`` must have been quantized with that
                precision.
        Raises:
            KernelError: wrong width or device, unknown ``act``, pre-quantized ``x`` of another
                precision than this weight's.
            KernelPathError: a forced path this CPU cannot run.
        """
        if isinstance(x, QuantizedActivations):
            if self.qw is None:
                raise KernelError(f"{self.name}: {self.ggml_type.name} weight takes float activations")
            if x.k != self.k:
                raise KernelError(f"{self.name}: activations have width {x.k}, weight expects {self.k}")
            want = self.resolved_act(act, x.path)
            if x.act != want:
                raise KernelError(f"{self.name}: activations quantized as {x.act}, this weight runs {want}")
            return self._qmm(x)
        if x.shape[-1] != self.k:
            raise KernelError(f"{self.name}: input width {x.shape[-1]} does not match k={self.k}")
        if x.device != self.device:
            raise KernelError(f"{self.name}: input on {x.device}, weight on {self.device}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        if self.qw is None:
            y = self._float_mm(x2)
        else:
            p = cpu.resolve_path(path)
            if p == "torch":
                if self._f32_cache is None:
                    log.warning("kernels_dequantize_f32", tensor=self.name, mib=round(self.d * self.k * 4 / 2**20, 1))
                    self._f32_cache = self.dequantize()
                y = x2.to(torch.float32) @ self._f32_cache.T
            else:
                a = self.resolved_act(act, p)
                y = self._qmm_f32(x2, p, a)
                if a == "i8" and self.rescore > 0 and y.shape[0]:
                    y = self._rescore_top(x2, y, p)
        return y.reshape(*lead, self.d)

    def _rescore_top(self, x: torch.Tensor, y: torch.Tensor, path: str) -> torch.Tensor:
        """Replace each row's ``rescore`` largest int8 outputs of ``y`` ``(n, d)`` (ties: the lower
        column) by their int16 values, in place, in one C call (``csrc/qmm16.cpp``
        ``qmm16_rescore``): the int16 kernel's tile on each 16-row weight group holding a
        candidate, the same operations per row as the full int16 matmul, so the values equal
        its bit for bit and a row's result does not depend on the other rows.

        Raises:
            KernelError: the kernel refused the call (its code in the message).
        """
        xf = x.to(torch.float32).contiguous()
        rc = getattr(library.load(path), f"lp_{path}_qmm16_rescore")(
            xf.data_ptr(),
            self.k,
            y.shape[0],
            *self._f32_call_form(),
            min(self.rescore, self.d, TOPK_MAX),
            y.data_ptr(),
            y.stride(0),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise KernelError(f"{self.name}: the int16 re-score refused the call (code {rc})")
        return y

    def _float_mm(self, x: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None
        if self.weight.dtype == torch.float32:
            return x.to(torch.float32) @ self.weight.T
        return (x.to(self.weight.dtype) @ self.weight.T).to(torch.float32)

    def _f32_call_form(self) -> tuple:
        """The weight's arguments of the float-input exports (``qmm*_f32``, ``qmm16_rescore``):
        ``k, qw, sc, bias, off, d, bs, is_signed`` (csrc/api.h)."""
        assert self.qw is not None and self.scale is not None
        return (
            self.k,
            self.qw.data_ptr(),
            self.scale.data_ptr(),
            _p(self.bias),
            self.offset,
            self.d,
            self.bs,
            int(self.signed),
        )

    def _qmm_f32(self, x: torch.Tensor, path: str, act: str) -> torch.Tensor:
        """Quantize + multiply in one C call (the common case: one ctypes crossing)."""
        n = x.shape[0]
        y = torch.empty((n, self.d), dtype=torch.float32)
        if n == 0:
            return y
        if self.k % 32:
            raise KernelError(f"{self.name}: width {self.k} is not a multiple of 32")
        xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
        rc = _fns(path, act)[2](
            xf.data_ptr(),
            self.k,
            n,
            *self._f32_call_form(),
            y.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise KernelError(f"{self.name}: kernel failed (rc={rc}, bs={self.bs}, signed={self.signed})")
        return y

    def _qmm(self, a: QuantizedActivations) -> torch.Tensor:
        y = torch.empty((a.n, self.d), dtype=torch.float32)
        if a.n == 0:
            return y
        assert self.qw is not None and self.scale is not None
        rc = _fns(a.path, a.act)[1](
            self.qw.data_ptr(),
            self.scale.data_ptr(),
            _p(self.bias),
            self.offset,
            self.d,
            self.k,
            self.bs,
            int(self.signed),
            a.q.data_ptr(),
            a.d.data_ptr(),
            a.s16.data_ptr(),
            a.s32.data_ptr(),
            a.n,
            y.data_ptr(),
            torch.get_num_threads(),
        )
        if rc == -2:
            raise KernelError(f"{self.name}: out of memory for the activations' block sums ({a.n} rows)")
        if rc != 0:
            raise KernelError(f"{self.name}: kernel rejected bs={self.bs} signed={self.signed}")
        return y


def _resolve(device: str | torch.device, name: str) -> torch.device:
    """``device`` in the form its tensors report (``resolve_device``), as a KernelError naming ``name``."""
    try:
        return resolve_device(device)
    except ModelError as exc:
        raise KernelError(f"{name}: {exc}") from None


def pack_tensor(rec: TensorRecord, *, device: str | torch.device = "cpu", path: str | None = None) -> QuantLinear:
    """Build the packed weight of one 2-D GGUF tensor.

    Args:
        rec: the tensor record (``loraplane.formats.gguf.reader``); its bytes are read, not kept.
        device: a ``--device`` spelling or ``torch.device`` (resolved here,
            :func:`worker.runtime.device.resolve_device`): CPU keeps the compact form;
            CUDA uploads the raw blocks and dequantizes them to bf16 on the GPU
            (``worker.gpu.dequant``; the C kernels are CPU-only).
        path: 'torch' forces the float form on CPU too (f32); default: the compact form.
    Raises:
        KernelError: not a 2-D tensor, a type with neither a repack rule nor a dequantizer, or
            a device that is not there (``cuda`` without CUDA, ``cuda:N`` beyond the count).
    """
    dev = _resolve(device, rec.name)
    if len(rec.ne) != 2:
        raise KernelError(f"{rec.name}: expected a 2-D weight, ne={list(rec.ne)}")
    k, d = int(rec.ne[0]), int(rec.ne[1])
    t = rec.ggml_type
    ql = QuantLinear(rec.name, t, k, d, dev)
    if dev.type == "cuda":
        try:
            ql.weight = dequantize_tensor(rec, device=dev, dtype=torch.bfloat16)
        except GGUFError as exc:
            raise KernelError(f"{rec.name}: unsupported GGML type {t.name}") from exc
        return ql
    if dev.type == "cpu" and t in REPACK_TYPES and path == "torch":
        ql.weight = torch.from_numpy(np.array(gguf_dequantize(rec.name, rec))).to(device=dev, dtype=torch.float32)
        return ql
    if dev.type != "cpu":
        raise KernelError(f"{rec.name}: no kernels for device {dev}")
    if t in REPACK_TYPES:
        aff = decode(rec.raw, t, d, k)
        qw, sc, bias = interleave(aff)
        ql.offset = aff.offset
        ql.qw, ql.scale = torch.from_numpy(qw), torch.from_numpy(sc)
        ql.bias = None if bias is None else torch.from_numpy(bias)
        ql.bs, ql.signed = (16 if t == T.Q6_K else 32), t == T.Q8_0
        return ql
    try:
        w = torch.from_numpy(np.array(gguf_dequantize(rec.name, rec), dtype=np.float32))
    except GGUFError as exc:
        raise KernelError(f"{rec.name}: unsupported GGML type {t.name}") from exc
    if t not in FLOAT_TYPES:
        log.warning("kernels_no_repack_rule", tensor=rec.name, ggml_type=t.name, kept_as="f32")
    ql.weight = w
    return ql


def pack_experts(rec: TensorRecord, *, device: str | torch.device = "cpu") -> list[QuantLinear]:
    """Pack a 3-D expert weight (ggml ``ne = [k, d, E]``, torch ``(E, d, k)``) as ``E``
    :class:`QuantLinear` (one per expert, named ``name[e]``), for ``build_lora_mm_id``.

    Raises:
        KernelError: not a 3-D tensor, or as :func:`pack_tensor`.
    """
    if len(rec.ne) != 3:
        raise KernelError(f"{rec.name}: expected a 3-D expert weight, ne={list(rec.ne)}")
    return [
        pack_tensor(TensorRecord(f"{rec.name}[{e}]", rec.ggml_type, tuple(rec.ne[:2]), rec.raw[e]), device=device)
        for e in range(int(rec.ne[2]))
    ]


__all__ = [
    "ACTS",
    "KernelError",
    "QuantLinear",
    "resolve_act",
    "QuantizedActivations",
    "quantize_activations",
    "pack_experts",
    "pack_tensor",
]
