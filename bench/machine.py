"""What the machine is and which code paths a run takes: printed in every table's notes and
written to the JSON's ``machine`` section.

- the CPU model and the flags that decide the kernel path (avx2, fma, f16c, avx512f/bw/vl,
  avx512_vnni, avx_vnni, amx_*), read from ``/proc/cpuinfo``;
- the kernel path and activation precision actually used by the quantized matmuls
  (``worker.runtime.kernels.resolve_path()`` / ``resolve_act()``, the same environment the
  workers inherit), or the float reference when ``--weights dequant`` (or a CUDA device);
- ``OMP_WAIT_POLICY`` in force (the worker defaults it to PASSIVE) and the load average.
"""

from __future__ import annotations

import os

FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


def load_avg() -> str:
    """``"1m 5m 15m"`` load average, or ``-``."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "-"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def kernels_used(weights: str, device: str) -> dict:
    """The matmul path a model loaded with ``--weights weights`` on ``device`` takes.

    Returns ``{"weights", "path", "act", "summary"}``; ``path`` is the ISA of our C kernels
    ('amx' | 'avx512' | 'avx2'), or 'torch' (dequantized float weights: ``--weights dequant``, CUDA,
    a CPU without AVX2, or ``LORAPLANE_KERNELS=torch``); ``act`` the activation precision of
    the C kernels ('i16' | 'i8' when ``LORAPLANE_KERNEL_ACT`` forces one, else the per-weight
    policy: ``$LORAPLANE_INT8_WEIGHTS``, else each architecture's measured default), None for the
    torch path.
    """
    from worker.runtime.kernels import resolve_act, resolve_path
    from worker.runtime.kernels.cpu import bf16_tiles_supported
    from worker.runtime.model import INT8_ARCH_DEFAULTS, bf16_tiles_wanted, int8_policy

    if weights == "dequant":
        return {
            "weights": weights,
            "path": "torch",
            "act": None,
            "summary": "dequant: torch matmul on f32-dequantized weights (reference)",
        }
    if device.startswith("cuda") or (device == "auto" and _cuda_available()):
        return {
            "weights": weights,
            "path": "torch",
            "act": None,
            "summary": "packed on CUDA: torch matmul on bf16-dequantized weights",
        }
    path = resolve_path()
    if path == "torch":
        return {"weights": weights, "path": "torch", "act": None, "summary": "packed, torch fallback (dequantized f32)"}
    forced = os.environ.get("LORAPLANE_KERNEL_ACT")
    # the per-weight policy (model.assign_acts) unless one precision is forced for all weights
    policy = os.environ.get("LORAPLANE_INT8_WEIGHTS")
    if forced:
        act = resolve_act()
    elif policy:
        act = "i16" if int8_policy() == "none" else f"i16, i8 for {int8_policy()}"
    else:  # each architecture's measured default (worker.runtime.model.INT8_ARCH_DEFAULTS)
        act = "i16 (" + "; ".join(f"{a}: i8 for {p}" for a, p in INT8_ARCH_DEFAULTS.items()) + ")"
    summary = f"packed GGUF weights, {path} kernels, {act} activations (per row, per 32)"
    if not forced and path == "amx" and bf16_tiles_supported() and bf16_tiles_wanted():
        act += "; bf16 for the i16 weights but Q8_0"
        summary += "; bf16 activations on AMX-BF16 tiles in place of i16 for every weight type but Q8_0"
    return {"weights": weights, "path": path, "act": act, "summary": summary}


def machine_info(weights: str, device: str, dtype: str) -> dict:
    """The JSON ``machine`` section's CPU / kernel / thread-policy part."""
    from worker.runtime.kernels import cpu_flags, cpu_model

    flags = cpu_flags()
    return {
        "cpu_model": cpu_model(),
        "cpu_flags": [f for f in FLAGS if f in flags],
        "cpu_flags_missing": [f for f in FLAGS if f not in flags],
        "kernels": kernels_used(weights, device),
        "activation_dtype": dtype,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "") or "(unset: libgomp default, spin then sleep)",
    }


def machine_line(machine: dict) -> str:
    """One line for a table's notes: CPU, flags, kernels, OMP policy."""
    k = machine.get("kernels") or {}
    return (
        f"CPU {machine.get('cpu_model', '?')} [{' '.join(machine.get('cpu_flags', [])) or 'no listed flags'}]; "
        f"matmuls: {k.get('summary', '?')}; activations {machine.get('activation_dtype', '?')}; "
        f"OMP_WAIT_POLICY={machine.get('omp_wait_policy', '?')}"
    )
