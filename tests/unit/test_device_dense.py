"""The loader's ``device-dense`` weight form (the GPU form: raw GGUF blocks dequantized on the
device, dense compute-dtype matrices, q/k/v and gate/up in one tensor), run on CPU tensors.

Its weights equal the ``dequant`` reference form's bit for bit (the same f32 dequantization,
rounded once to the compute dtype), so the logits of a forward pass over the same prompt are
compared with a tolerance that only covers how a product is blocked: f32 max |d| ≤ 1e-4,
bf16 ≤ 2 bf16 steps at the largest logit's magnitude (the fused projections, when the graph
multiplies by them, are one matmul where the reference makes three). On CUDA the ``gpu`` tier
loads the same model with the default ``packed`` form, which resolves to ``device-dense``.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from worker.runtime.context import Model, UBatch
from worker.runtime.model import (
    ModelError,
    load_device_dense,
    load_model,
    resolve_weight_form,
)

NEEDS_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="gpu tier: needs a CUDA device (torch.cuda.is_available() is False)"
)

PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203, 29889]


def _logits(model: Model) -> torch.Tensor:
    """f32 ``(len(PROMPT), n_vocab)`` logits of every prompt row (one sequence, one ubatch)."""
    ctx = model.new_context(n_ctx_seq=64)
    try:
        n = len(PROMPT)
        return ctx.decode(UBatch(PROMPT, list(range(n)), [1] * n, [True] * n)).logits.float()
    finally:
        ctx.close()


def _tolerance(ref: torch.Tensor, dtype: str) -> float:
    if dtype == "f32":
        return 1e-4
    return 2 * 2.0 ** (torch.log2(ref.abs().max()).floor().item() - 7)  # bf16: 8 significant bits


def _compare(path: Path, dtype: str) -> None:
    ref = load_model(path, device="cpu", dtype=dtype, weights="dequant")
    got = load_model(path, device="cpu", dtype=dtype, weights="device-dense")
    assert got.weight_form == "device-dense" and got.fused == {}
    assert list(got.weights) == list(ref.weights)
    for name, w in ref.weights.items():
        g = got.weights[name]
        assert isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor)
        assert g.dtype == w.dtype and torch.equal(g, w), name
    a, b = _logits(Model(ref)), _logits(Model(got))
    assert a.shape == b.shape and torch.isfinite(a).all()
    tol = _tolerance(a, dtype)
    assert float((a - b).abs().max()) <= tol
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_tiny_moe_logits_equal_dequant(fixtures_dir: Path, dtype: str):
    _compare(fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf", dtype)


def test_fused_projections_are_one_tensor(fixtures_dir: Path):
    """Each layer's q/k/v lands in one ``(Σd, k)`` tensor whose row slices are the members
    (views: the bytes are held once), and ``x @ fused.T`` holds every member's product as a
    column slice (f32, within 1e-5 of the separate products)."""
    m = load_model(fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf", device="cpu", weights="device-dense")
    want = [tuple(f"blk.{il}.attn_{p}.weight" for p in "qkv") for il in range(m.hparams.n_layer)]
    assert sorted(m.fused_dense) == want  # gate/up are expert stacks here: not fused
    x = torch.randn(5, m.hparams.n_embd, generator=torch.Generator().manual_seed(0))
    for names, whole in m.fused_dense.items():
        members = [m.weights[n] for n in names]
        assert isinstance(whole, torch.Tensor) and whole.shape[0] == sum(w.shape[0] for w in members)
        assert torch.equal(whole, torch.cat(members))
        row = 0
        for w in members:
            assert isinstance(w, torch.Tensor) and w.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
            assert w.data_ptr() == whole[row].data_ptr()
            row += w.shape[0]
        cols = torch.split(x @ whole.T, [w.shape[0] for w in members], dim=-1)
        for w, c in zip(members, cols, strict=True):
            assert float((c - x @ w.T).abs().max()) <= 1e-5
    dense = [w for w in m.weights.values() if isinstance(w, torch.Tensor)]
    assert m.weight_bytes == sum(w.numel() * w.element_size() for w in dense)  # the fused tensors add nothing


def test_norms_stay_f32_and_matrices_take_the_compute_dtype(fixtures_dir: Path):
    m = load_model(
        fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf", device="cpu", dtype="bf16", weights="device-dense"
    )
    kinds = {(w.dim(), w.dtype) for w in m.weights.values() if isinstance(w, torch.Tensor)}
    assert kinds == {(1, torch.float32), (2, torch.bfloat16), (3, torch.bfloat16)}


def test_weight_form_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 1)
    assert resolve_weight_form("packed", cpu) == "packed"
    assert resolve_weight_form("packed", cuda) == "device-dense"  # the packed kernels are CPU code
    assert resolve_weight_form("dequant", cuda) == "dequant"
    assert resolve_weight_form("device-dense", cpu) == "device-dense"
    with pytest.raises(ModelError, match="unknown weight form 'int4'"):
        resolve_weight_form("int4", cpu)


def test_unsupported_type_names_the_tensor():
    from loraplane.formats.gguf.reader import GGUFError, TensorRecord

    rec = TensorRecord("blk.0.attn_q.weight", gguf.GGMLQuantizationType.TQ1_0, (256, 1), np.zeros((1, 54), np.uint8))
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_q\.weight.*TQ1_0"):
        load_device_dense({rec.name: rec}, 1, torch.device("cpu"), torch.float32)


QUANT_MIX = [
    gguf.GGMLQuantizationType.Q8_0,
    gguf.GGMLQuantizationType.Q4_0,
    gguf.GGMLQuantizationType.Q4_1,
    gguf.GGMLQuantizationType.Q5_0,
    gguf.GGMLQuantizationType.Q5_1,
    gguf.GGMLQuantizationType.BF16,
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_quantized_model_logits_equal_dequant(fixtures_dir: Path, tmp_path: Path, dtype: str):
    """The tiny MoE model with its matrices in six types (q/k/v of one layer in three
    different ones: fused all the same, as dense tensors)."""
    from tests.helpers.gguf_retype import quantize_gguf

    path = quantize_gguf(fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf", tmp_path / "mix.gguf", QUANT_MIX)
    _compare(path, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2"])
def test_tiny_arch_logits_equal_dequant(arch: str, tmp_path: Path):
    from tests.helpers.tiny_models import MODELS

    _compare(MODELS[arch](tmp_path / f"{arch}.gguf"), "f32")


@pytest.mark.cuda
@NEEDS_CUDA
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_cuda_load_is_device_dense(fixtures_dir: Path, dtype: str):
    """``packed`` on CUDA loads dense weights on the GPU equal to the CPU reference's bit for bit."""
    path = fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"
    ref = load_model(path, device="cpu", dtype=dtype, weights="dequant")
    got = load_model(path, device="cuda", dtype=dtype)
    assert got.weight_form == "device-dense" and got.fused_dense
    for name, w in ref.weights.items():
        g = got.weights[name]
        assert isinstance(g, torch.Tensor) and g.device.type == "cuda", name
        assert isinstance(w, torch.Tensor) and torch.equal(g.cpu(), w), name
