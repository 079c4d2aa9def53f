"""Where and in what a worker computes, as ``--device`` and ``--dtype`` spell it, checked
without importing torch.

One grammar for every entry point that takes them (``serve``, ``worker``, ``demo``,
``loraplane bench``, ``WorkerConfig``): the CLI refuses a bad spelling as a usage error before
it starts anything, and importing torch for that would cost seconds. Whether the named device
exists on this machine is the worker's question, answered once at model load
(``worker.runtime.device.resolve_device``); the dtypes' torch types are
``worker.runtime.device.DTYPES``.

Device spellings (``DEVICE_SPECS``):

- ``auto``: the current CUDA device when CUDA is available, else the CPU.
- ``cuda``: the current CUDA device (0 unless the process chose another;
  ``CUDA_VISIBLE_DEVICES`` decides which GPUs are counted).
- ``cuda:N``: GPU ``N`` of the visible ones.
- ``cpu``, ``cpu:0``: the CPU (torch has one CPU device; ``cpu:1`` is refused rather than
  silently meaning the same thing).
"""

from __future__ import annotations

import re

DTYPE_NAMES = ("f32", "bf16", "f16")
"""``--dtype`` values: the compute (activation) dtype, float32 (default; on CPU the C kernels'
exact path), bfloat16 or float16."""

KV_CACHE_DTYPE_NAMES = ("auto", "f32", "f16", "bf16")
"""``--kv-cache-dtype`` values: the CPU KV cache's storage (llama-server's ``--cache-type-k/-v``);
"auto" is f16 under f32 compute with packed weights (llama.cpp's default), else the compute dtype
(``worker.runtime.kv_cache.kv_cache_dtype``)."""

DEVICE_SPECS = ("auto", "cpu", "cpu:0", "cuda", "cuda:N")
"""The accepted ``--device`` spellings (``N``: a GPU index, ASCII digits)."""

DEVICE_METAVAR = "cpu|cuda|cuda:N|auto"
"""How help texts show ``--device`` (``cpu:0`` is accepted too)."""

_SPEC = re.compile(r"(auto|cpu|cuda)(?::([0-9]+))?")


def check_device_spec(spec: str) -> str:
    """``spec`` normalized (stripped, lower case, index without leading zeros) when it is one of
    ``DEVICE_SPECS``, e.g. ``" CUDA:01"`` → ``"cuda:1"``.

    Only the spelling is checked: whether ``cuda:N`` exists is asked where the worker runs
    (a control plane may start a worker for a GPU it does not see itself).

    Raises:
        ValueError: any other spelling (``mps``, ``gpu``, ``cuda:-1``, ``auto:0``, ``cpu:1``),
            the message naming it and the accepted forms.
    """
    text = spec.strip().lower()
    m = _SPEC.fullmatch(text)
    if m is None:
        raise ValueError(f"device {spec!r} is not one of {', '.join(DEVICE_SPECS)}")
    kind, index = m.group(1), m.group(2)
    if kind == "auto" and index is not None:
        raise ValueError(f"device {spec!r}: 'auto' takes no index (expected one of {', '.join(DEVICE_SPECS)})")
    if kind == "cpu" and index is not None and int(index) != 0:
        raise ValueError(f"device {spec!r}: torch has one CPU device, use 'cpu' (or 'cpu:0')")
    return f"{kind}:{int(index)}" if index is not None else kind


__all__ = ["DEVICE_METAVAR", "DEVICE_SPECS", "DTYPE_NAMES", "KV_CACHE_DTYPE_NAMES", "check_device_spec"]
