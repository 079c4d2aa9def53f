"""Fixtures of the ``gpu`` tier (docs/gpu.md): every test here carries the ``gpu`` marker and is
skipped, saying why, without CUDA (``tests/conftest.py``).

Nothing here downloads: the synthetic model is written by ``loraplane.bench.synthetic``; the
tiny architectures need llama.cpp's vocabulary files in the cache (``scripts/gpu_check.sh``
puts them there from its ``--wheels`` folder).
"""

from __future__ import annotations

from pathlib import Path

import pytest

GPU_DTYPES = ("f32", "bf16", "f16")
"""Compute dtypes the device is tested in: f32 against the CPU's bounds, the 16-bit ones against
looser bounds (each module states them)."""


def is_16bit(dtype: str) -> bool:
    return dtype in ("bf16", "f16")


@pytest.fixture(scope="session")
def synthetic_tiny(tmp_path_factory):
    """The tiny Qwen2.5-1.5B-shaped model (``qwen2``: q/k/v biases, tied head, 4 096-id BPE
    vocabulary) and four rank-16 adapters on every linear weight: ``(model path, [adapter paths])``."""
    from loraplane.bench.synthetic import ensure_model

    m = ensure_model("qwen2.5-1.5b", tiny=True, seed=7, cache_dir=tmp_path_factory.mktemp("synthetic"))
    return m.path, m.factory.paths(4)


@pytest.fixture(scope="session")
def tiny_moe(fixtures_dir: Path) -> tuple[Path, Path]:
    """The tiny llama-MoE fixture model and its adapter on the expert weights."""
    return fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf", fixtures_dir / "tiny_moe" / "moe_lora.gguf"
