"""Device spellings and their resolution (``loraplane.compute_spec``,
``worker.runtime.device``): the CLI's usage errors, ``auto`` / ``cuda`` / ``cuda:N`` /
``cpu:0`` resolved to the exact ``torch.device`` tensors report, on this CPU machine and on a
simulated machine with two GPUs (``torch.cuda`` queries monkeypatched; nothing is allocated
on a GPU), and the packed weights that compare their input's device with it."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf import GGMLQuantizationType as T

from bench.__main__ import device_arg
from clients.cli.main import cli
from loraplane.compute_spec import DTYPE_NAMES, check_device_spec
from loraplane.formats.gguf.reader import TensorRecord
from worker.runtime.device import bind_device, resolve_device
from worker.runtime.errors import ModelError
from worker.runtime.kernels import KernelError, QuantLinear, pack_tensor
from worker.runtime.model import DTYPES, load_model


@pytest.mark.parametrize(
    ("spec", "norm"),
    [
        ("auto", "auto"),
        ("cpu", "cpu"),
        ("cpu:0", "cpu:0"),
        ("cuda", "cuda"),
        ("cuda:0", "cuda:0"),
        ("cuda:1", "cuda:1"),
        (" CUDA:01 ", "cuda:1"),
    ],
)
def test_spellings_accepted_and_normalized(spec, norm):
    assert check_device_spec(spec) == norm


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("tpu", "is not one of auto, cpu, cpu:0, cuda, cuda:N"),
        ("gpu", "is not one of"),
        ("mps", "is not one of"),
        ("cuda:", "is not one of"),
        ("cuda:-1", "is not one of"),
        ("cuda:x", "is not one of"),
        ("cuda:٣", "is not one of"),  # a Unicode digit is not an index
        ("auto:0", "'auto' takes no index"),
        ("cpu:1", "torch has one CPU device"),
    ],
)
def test_spellings_refused_name_the_value(spec, why):
    with pytest.raises(ValueError, match=why) as err:
        check_device_spec(spec)
    assert repr(spec) in str(err.value)


def test_dtype_names_are_the_models_dtypes():
    assert tuple(DTYPES) == DTYPE_NAMES
    assert DTYPES["f16"] is torch.float16 and DTYPES["bf16"] is torch.bfloat16 and DTYPES["f32"] is torch.float32


# --- resolution on this machine (no CUDA) -----------------------------------------------------
@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("spec", ["cpu", "cpu:0", "CPU", torch.device("cpu"), torch.device("cpu", 0)])
def test_cpu_spellings_resolve_to_what_cpu_tensors_report(spec):
    dev = resolve_device(spec)
    assert dev == torch.zeros(1, device="cpu:0").device == torch.device("cpu")
    assert dev.index is None and str(dev) == "cpu"


def test_auto_without_cuda_is_cpu(no_cuda):
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_without_cuda_names_the_spelling(no_cuda, spec):
    with pytest.raises(ModelError, match=rf"device '{spec}' requested but .*use --device cpu or auto"):
        resolve_device(spec)


def test_cuda_error_says_why_cuda_is_missing(no_cuda, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ModelError, match=r"this torch \(.*\) is built without CUDA"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(ModelError, match=r"is_available\(\) is False \(no GPU visible"):
        resolve_device("cuda:0")


@pytest.mark.parametrize("spec", ["tpu", "cpu:1", "meta", torch.device("meta")])
def test_other_spellings_are_model_errors(spec):
    with pytest.raises(ModelError, match=f"device '{spec}'"):
        resolve_device(spec)


# --- resolution on a simulated machine with two GPUs ------------------------------------------
@pytest.fixture
def two_gpus(monkeypatch):
    """``torch.cuda`` answering like a machine with 2 visible GPUs whose current one is 1;
    ``set_device`` calls recorded."""
    bound: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    return bound


@pytest.mark.parametrize(
    ("spec", "index"),
    [("cuda", 1), ("auto", 1), ("cuda:0", 0), ("cuda:1", 1), (torch.device("cuda"), 1), (torch.device("cuda", 0), 0)],
)
def test_cuda_spellings_resolve_with_an_index(two_gpus, spec, index):
    dev = resolve_device(spec)
    # what a CUDA tensor on that GPU reports: type and index, so == holds (no index-less "cuda")
    assert (dev.type, dev.index) == ("cuda", index)
    assert dev == torch.device(f"cuda:{index}") and dev != torch.device("cuda")


def test_cuda_index_beyond_the_count_names_spelling_and_count(two_gpus):
    with pytest.raises(
        ModelError, match=r"device 'cuda:7' requested but 2 CUDA device\(s\) are visible \(cuda:0..cuda:1\)"
    ):
        resolve_device("cuda:7")
    with pytest.raises(ModelError, match=r"'cuda:2' requested but 2 CUDA"):
        resolve_device("cuda:2")


def test_cpu_stays_cpu_with_gpus_present(two_gpus):
    assert resolve_device("cpu:0") == torch.device("cpu")


def test_bind_device_sets_the_current_gpu_only_for_cuda(two_gpus):
    bind_device(torch.device("cpu"))
    assert two_gpus == []
    bind_device(resolve_device("cuda:0"))
    assert two_gpus == [torch.device("cuda", 0)]


# --- packed weights compare with the resolved device ------------------------------------------
def _f32_record(name: str = "w") -> TensorRecord:
    w = np.arange(64 * 3, dtype=np.float32).reshape(3, 64) / 100
    return TensorRecord(name, T.F32, (64, 3), w)


def test_quant_linear_takes_cpu0_and_multiplies_cpu_inputs():
    """The CUDA crash (weight on ``cuda``, input on ``cuda:0``) spelled on CPU: a weight on
    ``cpu:0`` refused an input that reports ``cpu``; now the weight's device is resolved and
    the product is exact."""
    ql = pack_tensor(_f32_record(), device="cpu:0")
    assert ql.device == torch.device("cpu") and ql.device.index is None
    x = torch.ones(2, 64)
    assert torch.equal(ql.matmul(x), x @ ql.weight.T)
    direct = QuantLinear("v", T.F32, 64, 3, torch.device("cpu", 0), weight=ql.weight)
    assert direct.device == torch.device("cpu")
    assert torch.equal(direct.matmul(x), ql.matmul(x))


def test_quant_linear_on_index_less_cuda_holds_the_indexed_device(two_gpus):
    """``torch.device("cuda")`` becomes ``cuda:<current>``: what a CUDA input reports, so the
    device check of ``matmul`` compares equal objects (no tensor is made: no GPU here)."""
    ql = QuantLinear("w", T.F32, 64, 3, torch.device("cuda"))
    assert ql.device == torch.device("cuda", 1)


def test_pack_tensor_refuses_a_missing_gpu_naming_the_tensor(no_cuda):
    with pytest.raises(KernelError, match=r"blk\.0\.attn_q\.weight: device 'cuda:1' requested but"):
        pack_tensor(_f32_record("blk.0.attn_q.weight"), device="cuda:1")


# --- the CLI and the bench ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["worker", "--device", "tpu"], "device 'tpu' is not one of auto, cpu, cpu:0, cuda, cuda:N"),
        (["worker", "--device", "cuda:x"], "device 'cuda:x' is not one of"),
        (["serve", "--device", "cpu:1"], "torch has one CPU device"),
        (["worker", "--dtype", "f64"], "'f64' is not one of 'f32', 'bf16', 'f16'"),
    ],
)
def test_cli_device_and_dtype_usage_errors(args, message):
    result = CliRunner().invoke(cli, args, prog_name="loraplane")
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_cli_help_shows_device_and_dtype_forms():
    result = CliRunner().invoke(cli, ["worker", "--help"], prog_name="loraplane", terminal_width=200)
    assert result.exit_code == 0
    assert "cpu|cuda|cuda:N|auto" in result.output and "[f32|bf16|f16]" in result.output


def test_bench_device_argument():
    assert device_arg("CUDA:1") == "cuda:1" and device_arg("cpu:0") == "cpu:0"
    with pytest.raises(argparse.ArgumentTypeError, match="device 'npu' is not one of"):
        device_arg("npu")


def test_f16_refused_for_gemma_naming_the_flag(base_model_path):
    """Gemma 3's residual stream overflows float16 (``model.F16_REFUSED``): refused at load, before
    any weight is read, with the flag and what to use instead."""
    with pytest.raises(ModelError, match=r"--dtype f16 is refused for Gemma 3 \(gemma3\).*use --dtype bf16 or f32"):
        load_model(base_model_path, dtype="f16", device="cpu")
