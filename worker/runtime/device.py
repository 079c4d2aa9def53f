"""The worker's device: its ``--device`` spelling resolved once to one ``torch.device``.

Why one resolved object: torch compares devices by type *and* index, and an index-less
``torch.device("cuda")`` is not equal to the ``cuda:0`` every CUDA tensor reports
(``tensor.device`` always carries the index), so a weight built for ``"cuda"`` and an input on
``cuda:0`` looked like two devices and the first matmul refused them. CPU is the other way
round: CPU tensors report ``cpu`` with no index, so ``cpu:0`` must become plain ``cpu``.
:func:`resolve_device` returns exactly the object the tensors report; the model loader calls
it once (``worker.runtime.model.load_model``) and every tensor of the worker
(weights, KV cache, adapter slots, ubatch inputs) is created on, and compared with,
``LoadedModel.device``.

The ``--dtype`` names' torch types are :data:`DTYPES` here. The spellings and their meaning
are ``loraplane.compute_spec`` (checked there without torch, for the CLI).
"""

from __future__ import annotations

import torch

from loraplane.compute_spec import DEVICE_SPECS, check_device_spec
from worker.runtime.errors import ModelError

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
"""``--dtype`` name → compute (activation) dtype: what the dequantized weights, the residual
stream and the adapter slots are held in, and the KV cache unless ``--kv-cache-dtype`` names
another (``worker.runtime.kv_cache.kv_cache_dtype``). Norm vectors stay f32; norms, attention
and the packed matmuls compute in f32 or wider and logits leave the model as f32 whatever the
dtype. On CPU, f32 is the C kernels' path (its results unchanged bit for bit); bf16 and f16 run
the same packed matmuls with the stream rounded to 16 bits between ops, and torch ops where a C
kernel takes f32 only (norm, attention, LoRA). f16 is refused where it overflows
(``worker.runtime.model.F16_REFUSED``)."""


def resolve_device(spec: str | torch.device) -> torch.device:
    """The one ``torch.device`` a worker runs on, equal to what its tensors report.

    Args:
        spec: a ``--device`` spelling (``loraplane.compute_spec.DEVICE_SPECS``: ``auto``,
            ``cpu``, ``cpu:0``, ``cuda``, ``cuda:N``), or a ``torch.device`` of type ``cpu`` or
            ``cuda`` (with or without an index) to bring to the same form.

    Returns:
        ``torch.device("cpu")`` (no index: what CPU tensors report), or
        ``torch.device("cuda", N)`` with the index always set: ``auto`` and ``cuda`` take
        ``torch.cuda.current_device()``.

    Raises:
        ModelError: a spelling outside ``DEVICE_SPECS``; ``cuda`` / ``cuda:N`` where
            ``torch.cuda.is_available()`` is False (the message says whether this torch was
            built without CUDA or sees no GPU); ``cuda:N`` with ``N`` not below
            ``torch.cuda.device_count()`` (the message names the spelling and the count).
    """
    text = str(spec)
    try:
        norm = check_device_spec(text)
    except ValueError as exc:
        raise ModelError(str(exc)) from None
    kind, _, index = norm.partition(":")
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())
    if not torch.cuda.is_available():
        why = (
            f"this torch ({torch.__version__}) is built without CUDA"
            if torch.version.cuda is None
            else "torch.cuda.is_available() is False (no GPU visible: driver? CUDA_VISIBLE_DEVICES?)"
        )
        raise ModelError(f"device {text!r} requested but {why}; use --device cpu or auto")
    if not index:
        return torch.device("cuda", torch.cuda.current_device())
    n = torch.cuda.device_count()
    if int(index) >= n:
        visible = f"cuda:0..cuda:{n - 1}" if n > 1 else "cuda:0"
        raise ModelError(f"device {text!r} requested but {n} CUDA device(s) are visible ({visible})")
    return torch.device("cuda", int(index))


def bind_device(device: torch.device) -> None:
    """Make ``device`` (resolved) the process's current CUDA device; nothing for the CPU.

    Work that names no device (new ``torch.cuda`` streams and graphs, Triton launches, library
    kernels that read the current device) then runs on the worker's GPU rather than GPU 0 when
    ``--device cuda:1`` is asked for. A worker process serves one device, so the loader sets it
    once.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)


__all__ = ["DEVICE_SPECS", "DTYPES", "bind_device", "resolve_device"]
