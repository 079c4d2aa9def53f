"""``worker.gpu.dequant``: GGUF blocks dequantized with torch ops, against gguf-py's
``quants.dequantize`` (the reference the reader and the ``dequant`` weight form use).

Every block type is compared bit for bit in f32 on random block bytes (f16 scale fields set to
finite values in [-2, 2], every other byte random: all bit patterns of the quantized fields and
6-bit scales occur), and on gguf-py's own quantization of random floats where gguf-py has one;
f16 / bf16 outputs equal the f32 result rounded once. The tensors of the tiny fixture GGUFs (F16
matrices, F32 norms) go through the whole ``dequantize_tensor`` path. The CUDA comparison is in
the ``gpu`` tier.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T

from loraplane.formats.gguf.reader import GGUFError, TensorRecord, dequantize, read_gguf
from worker.gpu.dequant import (
    DEVICE_DEQUANT_TYPES,
    Uploader,
    dequantize_blocks,
    dequantize_rows,
    dequantize_tensor,
)

NEEDS_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="gpu tier: needs a CUDA device (torch.cuda.is_available() is False)"
)

BLOCK_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]

F16_FIELDS = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}
"""Byte offsets of each block type's f16 scale fields (d, and dmin / m where the type has one)."""

GGUF_PY_QUANTIZES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]


def random_blocks(t: T, n_blocks: int, seed: int = 0) -> np.ndarray:
    """uint8 ``(n_blocks, type_size)``: random bytes, f16 fields finite in [-2, 2]."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n_blocks, GGML_QUANT_SIZES[t][1]), dtype=np.uint8)
    for at in F16_FIELDS[t]:
        blocks[:, at : at + 2] = rng.uniform(-2, 2, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    return blocks


def bits(x: np.ndarray | torch.Tensor) -> np.ndarray:
    a = x.numpy() if isinstance(x, torch.Tensor) else x
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def test_every_reader_type_has_a_device_dequantizer():
    from loraplane.formats.gguf.reader import FLOAT_TYPES, SUPPORTED_QUANT_TYPES

    assert DEVICE_DEQUANT_TYPES == FLOAT_TYPES | SUPPORTED_QUANT_TYPES
    assert set(F16_FIELDS) == set(BLOCK_TYPES) == SUPPORTED_QUANT_TYPES


@pytest.mark.parametrize("t", BLOCK_TYPES, ids=lambda t: t.name)
def test_random_blocks_bit_exact(t: T):
    blocks = random_blocks(t, 96, seed=int(t))
    ref = quants.dequantize(blocks, t).reshape(96, -1)
    got = dequantize_blocks(torch.from_numpy(blocks.copy()), t)
    assert got.dtype == torch.float32 and tuple(got.shape) == ref.shape
    assert np.isfinite(ref).all()
    np.testing.assert_array_equal(bits(got), bits(ref))


@pytest.mark.parametrize("t", GGUF_PY_QUANTIZES + [T.BF16], ids=lambda t: t.name)
def test_gguf_py_quantized_rows_bit_exact(t: T):
    """Rows quantized by gguf-py (valid scales, a spread of magnitudes per row) → the same f32."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((12, 256)) * np.logspace(-3, 2, 12)[:, None]).astype(np.float32)
    raw = quants.quantize(x, t)
    got = dequantize_rows(torch.from_numpy(raw.copy()), t, 256)
    np.testing.assert_array_equal(bits(got), bits(quants.dequantize(raw, t)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_output_is_the_f32_result_rounded_once(dtype: torch.dtype):
    for t in (T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_1):
        k = 512
        blocks = random_blocks(t, 4 * k // GGML_QUANT_SIZES[t][0], seed=3)
        rec = TensorRecord(f"w.{t.name}", t, (k, 4), blocks.reshape(4, -1))
        ref = torch.from_numpy(dequantize("mem", rec)).to(dtype)
        got = dequantize_tensor(rec, device="cpu", dtype=dtype)
        assert got.dtype == dtype and torch.equal(got, ref), t.name


@pytest.mark.parametrize("src", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_types_cast_once(src: T):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((5, 64)) * 30).astype(np.float32)
    raw = quants.quantize(x, src) if src == T.BF16 else x.astype({T.F32: np.float32, T.F16: np.float16}[src])
    rec = TensorRecord("w", src, (64, 5), raw)  # the reader's forms: float arrays, bytes for BF16
    ref = torch.from_numpy(dequantize("mem", rec))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(dequantize_tensor(rec, device="cpu", dtype=dtype), ref.to(dtype)), (src.name, dtype)


def test_chunks_and_out_slices_give_the_whole_tensor():
    """A 3-D expert stack ``(E, d, k)`` split into chunks of a few rows (not dividing the row
    count), written into a row slice of a larger tensor: equal to the one-chunk result and the
    reference; every byte uploaded once."""
    t, k, d, e = T.Q4_K, 512, 7, 3
    blocks = random_blocks(t, e * d * k // 256, seed=11)
    rec = TensorRecord("blk.0.ffn_up_exps.weight", t, (k, d, e), blocks.reshape(e, d, -1))
    ref = torch.from_numpy(dequantize("mem", rec))
    whole = dequantize_tensor(rec, device="cpu", dtype=torch.float32)
    assert tuple(whole.shape) == (e, d, k) and torch.equal(whole, ref)
    big = torch.full((e * d + 5, k), -1.0)
    up = Uploader("cpu")
    out = big[2 : 2 + e * d].view(e, d, k)
    got = dequantize_tensor(rec, device="cpu", dtype=torch.float32, out=out, uploader=up, chunk_elems=3 * k)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, ref)
    assert up.bytes_uploaded == blocks.nbytes
    assert (big[:2] == -1).all() and (big[2 + e * d :] == -1).all()  # nothing written outside the slice


def test_errors_name_the_tensor():
    rec = TensorRecord("blk.3.attn_q.weight", T.IQ2_XXS, (256, 2), np.zeros((2, 66), dtype=np.uint8))
    with pytest.raises(GGUFError, match=r"blk\.3\.attn_q\.weight.*IQ2_XXS"):
        dequantize_tensor(rec, device="cpu", dtype=torch.float32)
    ok = TensorRecord("w", T.Q8_0, (32, 2), random_blocks(T.Q8_0, 2))
    with pytest.raises(ValueError, match="expected torch.float32 \\(2, 32\\)"):
        dequantize_tensor(ok, device="cpu", dtype=torch.float32, out=torch.empty(3, 32))
    with pytest.raises(ValueError, match="multiple of its block size 32"):
        dequantize_rows(torch.zeros(1, 34, dtype=torch.uint8), T.Q8_0, 48)
    with pytest.raises(ValueError, match=r"uint8 \(n, 34\)"):
        dequantize_blocks(torch.zeros(1, 33, dtype=torch.uint8), T.Q8_0)


def _fixture_tensors_equal(path: Path) -> int:
    """Every tensor of the GGUF at ``path``: f32 equal bit for bit to the reader's dequantize,
    bf16 equal to that rounded once. Returns the number of tensors checked."""
    gf = read_gguf(path)
    up = Uploader("cpu")
    for rec in gf.tensors.values():
        ref = torch.from_numpy(dequantize(path, rec).copy())
        got = dequantize_tensor(rec, device="cpu", dtype=torch.float32, uploader=up)
        np.testing.assert_array_equal(bits(got), bits(ref.numpy()), err_msg=rec.name)
        assert torch.equal(dequantize_tensor(rec, device="cpu", dtype=torch.bfloat16), ref.to(torch.bfloat16))
    return len(gf.tensors)


def test_tiny_moe_fixture_tensors(fixtures_dir: Path):
    assert _fixture_tensors_equal(fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf") > 20


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2"])
def test_tiny_arch_tensors(arch: str, tmp_path: Path):
    from tests.helpers.tiny_models import MODELS

    assert _fixture_tensors_equal(MODELS[arch](tmp_path / f"{arch}.gguf")) > 10


@pytest.mark.cuda
@NEEDS_CUDA
@pytest.mark.parametrize("t", BLOCK_TYPES + [T.F16, T.BF16], ids=lambda t: t.name)
def test_cuda_equals_cpu(t: T):
    """On the GPU, through pinned staging in chunks: the CPU result bit for bit (f32, and the
    bf16 rounding)."""
    k, d = 1024, 40
    if t in F16_FIELDS:
        raw = random_blocks(t, d * k // GGML_QUANT_SIZES[t][0], seed=5).reshape(d, -1)
    else:
        x = np.random.default_rng(5).standard_normal((d, k)).astype(np.float32)
        raw = quants.quantize(x, t) if t == T.BF16 else x.astype(np.float16)
    rec = TensorRecord("w", t, (k, d), raw)
    up = Uploader("cuda")
    for dtype in (torch.float32, torch.bfloat16):
        cpu = dequantize_tensor(rec, device="cpu", dtype=dtype)
        gpu = dequantize_tensor(rec, device="cuda", dtype=dtype, uploader=up, chunk_elems=3 * k)
        assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu), (t.name, dtype)
