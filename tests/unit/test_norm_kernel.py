"""The RMS norm kernel (``worker.runtime.kernels.norm``, ``csrc/norm.cpp``) against the torch
rule it replaces in ``GraphContext.build_norm`` (f64 mean of squares), on every ISA path this
CPU runs: close to it, a row bit-identical alone or batched and with 1 or 2 threads."""

from __future__ import annotations

import pytest
import torch

from worker.runtime.kernels import norm as knorm
from worker.runtime.kernels import supported
from worker.runtime.kernels.linear import KernelError

PATHS = [p for p in ("avx2", "avx512", "amx") if supported(p)]
pytestmark = pytest.mark.skipif(not PATHS, reason="no C kernel path on this CPU")


def _ref(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    ms = x.double().pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(ms + eps).float()
    return y if w is None else y * w


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("d", [640, 896, 256, 37])
def test_matches_torch_rule(path, d):
    g = torch.Generator().manual_seed(d)
    x = torch.randn(19, d, generator=g) * torch.logspace(-3, 2.5, 19).unsqueeze(1)
    x[3, 5 % d] = 250.0  # a Gemma-like outlier
    w = torch.randn(d, generator=g)
    for weight in (w, None):
        got = knorm.rms_norm(x, weight, 1e-6, path=path)
        want = _ref(x, weight, 1e-6)
        assert got.shape == x.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_row_alone_equals_batched_and_threads(path, monkeypatch):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 640, generator=g)
    w = torch.randn(640, generator=g)
    y = knorm.rms_norm(x, w, 1e-6, path=path)
    for i in (0, 7, 299):
        assert torch.equal(knorm.rms_norm(x[i : i + 1], w, 1e-6, path=path)[0], y[i])
    monkeypatch.setattr(knorm, "MIN_PARALLEL", 0)  # force the split over threads
    torch.set_num_threads(2)
    assert torch.equal(knorm.rms_norm(x, w, 1e-6, path=path), y)
    # per-head norms (Qwen3/Gemma 3 q/k norms): x (n, H, d_head), weight (d_head,)
    xh = x.reshape(300, 5, 128)
    wh = w[:128].contiguous()
    assert torch.equal(
        knorm.rms_norm(xh, wh, 1e-6, path=path),
        knorm.rms_norm(xh.reshape(-1, 128), wh, 1e-6, path=path).reshape(300, 5, 128),
    )


def test_bad_inputs_refused():
    x = torch.randn(2, 64)
    with pytest.raises(KernelError, match="f32 on CPU"):
        knorm.rms_norm(x.double(), None, 1e-6, path=PATHS[0])
    with pytest.raises(KernelError, match="weight must be contiguous f32 \\(64,\\)"):
        knorm.rms_norm(x, torch.ones(63), 1e-6, path=PATHS[0])
