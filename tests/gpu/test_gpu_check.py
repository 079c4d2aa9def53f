"""``bench.gpu_check`` (the ``env`` and ``warmup`` stages of ``scripts/gpu_check.sh``) on
this machine: on a CPU the kernels run under Triton's interpreter (``tests/helpers/gpu.py``)."""

from __future__ import annotations

import pytest
import torch

from bench import gpu_check
from tests.helpers.gpu import CUDA, NO_TRITON, TRITON

needs_triton = pytest.mark.skipif(not TRITON, reason=NO_TRITON)


@needs_triton
@pytest.mark.slow  # ~1 s per dtype under the interpreter
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_warm_up_checks_every_kernel_against_its_reference(device, dtype: str):
    """One row on the tiny Qwen2.5-1.5B sizes: every kernel runs twice and agrees with its torch
    reference within the dtype's tolerance (kv_write exactly: it is a copy)."""
    lines: list[str] = []
    got = gpu_check.warm_up(device, tiny=True, dtypes=(dtype,), rows=(1,), log=lines.append)
    kernels = ("lora attn_q", "lora ffn_down", "kv_write", "decode attention")
    assert [(w.kernel, w.dtype, w.rows) for w in got] == [(k, dtype, 1) for k in kernels]
    for w in got:
        assert w.error == "" and w.ok, w
        assert w.first_s > 0 and w.again_s > 0
        assert w.rel_err <= gpu_check.TOLERANCE[w.dtype]
        if w.kernel == "kv_write":
            assert w.rel_err == 0.0
    assert len(lines) == len(got) and all(line.endswith("ok") for line in lines)


@needs_triton
def test_a_kernel_that_raises_is_recorded_and_the_others_still_run(device, monkeypatch):
    from worker.gpu.kernels import attention, lora

    def broken(*args, **kwargs):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(attention, "paged_decode_attention", broken)
    monkeypatch.setattr(lora, "add_lora", broken)
    got = gpu_check.warm_up(device, tiny=True, dtypes=("f32",), rows=(1,), log=lambda _: None)
    assert [(w.kernel, w.error) for w in got] == [
        ("lora attn_q", "RuntimeError: no such kernel"),
        ("lora ffn_down", "RuntimeError: no such kernel"),
        ("kv_write", ""),
        ("decode attention", "RuntimeError: no such kernel"),
    ]
    assert [w.ok for w in got] == [False, False, True, False]
    assert got[2].rel_err == 0.0 and got[2].first_s > 0 and got[2].again_s > 0


@pytest.mark.slow  # imports the control plane and the GPU engine (~1.5 s in a fresh process)
def test_environment_names_the_missing_gpu_and_the_imports():
    lines, problems = gpu_check.environment()
    values = dict(lines)
    assert values["torch"] == torch.__version__.split("+")[0] or values["torch"] == torch.__version__
    assert all(values[f"import {m}"] == "ok" for m in gpu_check.IMPORTS)
    if CUDA:
        assert problems == [] and values["attention backend"] in ("triton", "flashinfer")
        assert "cuda:0" in values
    else:
        assert problems == [
            "torch sees no CUDA device (torch.cuda.is_available() is False): the gpu tier would only skip"
        ]
        assert not any(label.startswith("cuda:") for label in values)


def test_warmup_refuses_an_unknown_dtype(capsys):
    assert gpu_check.main(["warmup", "--device", "cpu", "--dtypes", "f32,f8"]) == 2
    assert "unknown dtype(s) f8" in capsys.readouterr().err
