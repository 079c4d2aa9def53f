"""The GPU kernels' tests (``loraplane.worker.gpu.kernels``): on CUDA when the machine has it,
else on CPU tensors under Triton's interpreter.

Without CUDA, ``TRITON_INTERPRET=1`` is set here, before any test module of this folder is
imported and before the kernel modules import Triton (they do at the first kernel call), unless
the environment already sets it. ``device`` is the device the tests put their tensors on.

NumPy ≥ 2.4 refuses ``int()`` of a one-element array, which Triton 3.6's interpreter uses to turn
a runtime scalar into a loop bound (``range(n)`` in a kernel over a runtime ``n``); the session
fixture below swaps that one conversion for ``.item()`` while the tests run (the kernels and the
installed Triton are unchanged; newer Triton releases squeeze the array the same way).
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from loraplane.worker.gpu.kernels import triton_env  # noqa: E402

TRITON = triton_env.triton_available()
NO_TRITON = "triton is not installed (the 'test' extra pins it; CUDA builds of torch ship it)"


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
