"""Fixtures of ``tests/gpu/``: the GPU engine's tests (docs/gpu.md). Every test here is marked
``gpu`` (by this folder, ``tests/helpers/folder_marks.py``).

The kernel tests (``worker.gpu.kernels``) run on CUDA when the machine has it, else on
CPU tensors under Triton's interpreter (``tests/helpers/gpu.py``, imported here first, sets
``TRITON_INTERPRET=1`` then). ``device`` is the device those tests put their tensors on.

NumPy ≥ 2.4 refuses ``int()`` of a one-element array, which Triton 3.6's interpreter uses to turn
a runtime scalar into a loop bound (``range(n)`` in a kernel over a runtime ``n``); the session
fixture below swaps that one conversion for ``.item()`` while the tests run (the kernels and the
installed Triton are unchanged; newer Triton releases squeeze the array the same way).

Those marked ``cuda`` need a CUDA device: without one ``tests/conftest.py`` skips each, saying why. Nothing
here downloads: the synthetic model is written by ``bench.synthetic``; the tiny
architectures need llama.cpp's vocabulary files in the cache (``scripts/gpu_check.sh`` puts them
there from its ``--wheels`` folder).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.folder_marks import mark_folder
from tests.helpers.gpu import CUDA, TRITON


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of this folder is ``gpu`` (``tests/helpers/folder_marks.py``)."""
    mark_folder(items, Path(__file__).parent)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """``cuda`` when the machine has a GPU, else ``cpu`` (the kernels under the interpreter)."""
    return torch.device("cuda" if CUDA else "cpu")


@pytest.fixture(scope="session", autouse=True)
def _interpreter_scalar_index():
    """Make Triton's interpreter turn one-element arrays into loop bounds with ``.item()``
    (NumPy ≥ 2.4; see the module docstring). A no-op on CUDA or without Triton."""
    if CUDA or not TRITON:
        yield
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch
    try:
        yield
    finally:
        interpreter._patch_lang_tensor = original


@pytest.fixture(scope="session")
def synthetic_tiny(tmp_path_factory):
    """The tiny Qwen2.5-1.5B-shaped model (``qwen2``: q/k/v biases, tied head, 4 096-id BPE
    vocabulary) and four rank-16 adapters on every linear weight: ``(model path, [adapter paths])``."""
    from bench.synthetic import ensure_model

    m = ensure_model("qwen2.5-1.5b", tiny=True, seed=7, cache_dir=tmp_path_factory.mktemp("synthetic"))
    return m.path, m.factory.paths(4)


@pytest.fixture(scope="session")
def tiny_moe(fixtures_dir: Path) -> tuple[Path, Path]:
    """The tiny llama-MoE fixture model and its adapter on the expert weights."""
    return fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf", fixtures_dir / "tiny_moe" / "moe_lora.gguf"
