"""worker.lora.adapter: the fixture adapters load, and each validation rule has its own error.

Shapes in helper arguments are numpy/torch order; messages are checked in ggml ``ne``
order (reversed), which is what the loader reports.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from loraplane.formats.adapter_file import MAX_RANK, AdapterError, base_tensor_index, lora_scale, read_lora_adapter
from loraplane.formats.gguf.reader import dequantize, read_gguf
from tests.helpers.adapter_gguf import BASE, D, E, K, R, V, write_adapter_gguf
from worker.lora.adapter import LoraPair, load_lora_adapter, open_lora_adapter

# name, alpha, ranks, pair count, invocation tokens
FIXTURE_ADAPTERS = [
    ("shout", 16.0, (8,), 126, ()),
    ("sea", 8.0, (4,), 54, ()),
    ("shout_embd", 8.0, (8,), 37, ()),
    ("critic_alora", 16.0, (8,), 126, (105, 1179, 725, 107)),
    ("shout_rs", 8.0, (16,), 54, ()),
]


@pytest.mark.parametrize("name,alpha,ranks,n_pairs,tokens", FIXTURE_ADAPTERS)
def test_fixture_adapter_loads(fixtures_dir, base_index, name, alpha, ranks, n_pairs, tokens):
    path = fixtures_dir / "adapters" / f"{name}.gguf"
    arch, index = base_index
    a = load_lora_adapter(path, base_arch=arch, base_tensors=index)
    assert (a.name, a.arch, a.alpha, a.ranks) == (name, "gemma3", alpha, ranks)
    assert len(a.pairs) == n_pairs and a.n_nodes == 6 * n_pairs
    assert a.alora_invocation_tokens == tokens
    assert a.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert a.size_bytes == sum(4 * (p.lora_a.numel() + p.lora_b.numel()) for p in a.pairs.values())
    with pytest.raises(TypeError):
        a.pairs["x"] = a.pairs[next(iter(a.pairs))]  # read-only mapping
    # values are the file's, in torch order (ne reversed)
    gf = read_gguf(path)
    base, pair = next(iter(a.pairs.items()))
    np.testing.assert_array_equal(pair.lora_a.numpy(), dequantize(path, gf.tensors[base + ".lora_a"]))
    np.testing.assert_array_equal(pair.lora_b.numpy(), dequantize(path, gf.tensors[base + ".lora_b"]))


def test_fixture_shapes_linear_and_token_embd(fixtures_dir, base_index):
    arch, index = base_index
    a = load_lora_adapter(fixtures_dir / "adapters" / "shout_embd.gguf", base_arch=arch, base_tensors=index)
    emb = a.pairs["token_embd.weight"]
    assert tuple(emb.lora_a.shape) == (262144, 8) and tuple(emb.lora_b.shape) == (640, 8)
    down = a.pairs["blk.0.ffn_down.weight"]  # W ne [2048, 640]
    assert tuple(down.lora_a.shape) == (8, 2048) and tuple(down.lora_b.shape) == (640, 8)


def test_fixture_moe_adapter_loads(fixtures_dir):
    arch, index = base_tensor_index(fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf")
    a = load_lora_adapter(fixtures_dir / "tiny_moe" / "moe_lora.gguf", base_arch=arch, base_tensors=index)
    assert (a.arch, a.alpha, a.ranks, a.alora_invocation_tokens) == ("llama", 8.0, (4,), ())
    assert set(a.pairs) == {
        "blk.0.attn_q.weight",
        "blk.0.ffn_up_exps.weight",
        "blk.1.ffn_up_exps.weight",
        "blk.1.ffn_down_exps.weight",
    }
    up = a.pairs["blk.0.ffn_up_exps.weight"]  # W ne [64, 128, 4]
    assert tuple(up.lora_a.shape) == (4, 4, 64) and tuple(up.lora_b.shape) == (4, 128, 4)
    down = a.pairs["blk.1.ffn_down_exps.weight"]  # W ne [128, 64, 4]
    assert tuple(down.lora_a.shape) == (4, 4, 128) and tuple(down.lora_b.shape) == (4, 64, 4)


@pytest.mark.parametrize(
    "adapter_scale,alpha,rank,expected",
    [
        (1.0, 16.0, 8, 2.0),
        (0.5, 16.0, 8, 1.0),
        (1.0, 8.0, 16, 0.5),
        (1.0, 32.0, 16, 2.0),
        (0.7, 0.0, 8, 0.7),  # alpha 0 = absent: no alpha/rank factor
        (0.0, 16.0, 8, 0.0),
        (-1.0, 8.0, 4, -2.0),
    ],
)
def test_lora_scale(adapter_scale, alpha, rank, expected):
    assert lora_scale(adapter_scale, alpha, rank) == pytest.approx(expected)


# ---- synthetic adapters against a small synthetic base ---------------------------------

RNG = np.random.default_rng(0)


def _rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def good_q() -> dict[str, np.ndarray]:
    return {"blk.0.attn_q.weight.lora_a": _rand(R, K), "blk.0.attn_q.weight.lora_b": _rand(D, R)}


def problems_of(path: Path, base: dict = BASE, arch: str = "llama") -> list[str]:
    with pytest.raises(AdapterError) as info:
        load_lora_adapter(path, base_arch=arch, base_tensors=base)
    err = info.value
    assert str(path) in str(err) and all(p in str(err) for p in err.problems)
    return err.problems


def test_good_synthetic_adapter(tmp_path):
    t = good_q()
    t["token_embd.weight.lora_a"] = _rand(V, R)  # ne [r, V]
    t["token_embd.weight.lora_b"] = _rand(D, R)  # ne [r, d]
    t["blk.0.ffn_up_exps.weight.lora_a"] = _rand(E, R, K)  # ne [k, r, E]
    t["blk.0.ffn_up_exps.weight.lora_b"] = _rand(E, D, R)  # ne [r, d, E]
    extra = {
        "adapter.lora.task_name": ("shout", gguf.GGUFValueType.STRING, None),
        "adapter.lora.prompt_prefix": ("Say: ", gguf.GGUFValueType.STRING, None),
        "adapter.alora.invocation_tokens": ([5, 6], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32),
    }
    path = write_adapter_gguf(tmp_path / "good.gguf", t, extra=extra)
    af = read_lora_adapter(path, base_arch="llama", base_tensors=BASE)  # numpy, no torch
    a = load_lora_adapter(path, base_arch="llama", base_tensors=BASE)
    assert (af.name, af.ranks, af.n_nodes, sorted(af.pairs)) == (a.name, a.ranks, a.n_nodes, sorted(a.pairs))
    for base, (a_np, b_np) in af.pairs.items():
        np.testing.assert_array_equal(a_np, t[base + ".lora_a"])
        np.testing.assert_array_equal(b_np, t[base + ".lora_b"])
    assert (a.name, a.task_name, a.prompt_prefix, a.alora_invocation_tokens) == ("good", "shout", "Say: ", (5, 6))
    assert set(a.pairs) == {"blk.0.attn_q.weight", "token_embd.weight", "blk.0.ffn_up_exps.weight"}
    for base, pair in a.pairs.items():
        np.testing.assert_array_equal(pair.lora_a.numpy(), t[base + ".lora_a"])
        np.testing.assert_array_equal(pair.lora_b.numpy(), t[base + ".lora_b"])
        assert pair.rank == R and a.scale(1.0, pair) == pytest.approx(2.0)


def test_dtype_and_device_for(tmp_path):
    path = write_adapter_gguf(tmp_path / "a.gguf", good_q())
    asked: list[str] = []

    def device_for(name: str) -> torch.device:
        asked.append(name)
        return torch.device("cpu")

    a = load_lora_adapter(path, base_arch="llama", base_tensors=BASE, device_for=device_for, dtype=torch.float16)
    pair = a.pairs["blk.0.attn_q.weight"]
    assert pair.lora_a.dtype == torch.float16 and pair.lora_b.dtype == torch.float16
    assert asked == ["blk.0.attn_q.weight"] and a.size_bytes == 2 * (R * K + D * R)


def test_not_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf at all")
    assert any("not a GGUF file" in p for p in problems_of(path))


def test_truncated(tmp_path):
    good = write_adapter_gguf(tmp_path / "good.gguf", good_q())
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert any("truncated or corrupt" in p for p in problems_of(cut))


def test_general_type_must_be_adapter(tmp_path):
    path = write_adapter_gguf(tmp_path / "a.gguf", good_q(), gtype="model")
    assert problems_of(path) == [
        "general.type: expected 'adapter', found 'model' (this looks like a model file, not an adapter)"
    ]


def test_arch_must_match_base(tmp_path):
    path = write_adapter_gguf(tmp_path / "a.gguf", good_q(), arch="gemma3")
    (p,) = problems_of(path, arch="llama")
    assert "general.architecture: expected 'llama'" in p and "found 'gemma3'" in p and "wrong base model?" in p


def test_adapter_type_must_be_lora(tmp_path):
    path = write_adapter_gguf(tmp_path / "a.gguf", good_q(), atype="ia3")
    assert problems_of(path) == ["adapter.type: expected 'lora', found 'ia3'"]
    path = write_adapter_gguf(tmp_path / "b.gguf", good_q(), atype=None)
    assert problems_of(path) == ["adapter.type: expected 'lora', found missing"]


def test_alpha_absent_means_zero(tmp_path):
    path = write_adapter_gguf(tmp_path / "a.gguf", good_q(), alpha=None)
    a = load_lora_adapter(path, base_arch="llama", base_tensors=BASE)
    assert a.alpha == 0.0 and a.scale(0.7, a.pairs["blk.0.attn_q.weight"]) == pytest.approx(0.7)


def test_norm_tensors_skipped(tmp_path):
    t = good_q()
    t["blk.0.attn_norm.weight"] = _rand(K)
    t["blk.0.attn_norm.weight.lora_a"] = _rand(R, K)  # a pair on a norm: skipped too
    a = load_lora_adapter(write_adapter_gguf(tmp_path / "a.gguf", t), base_arch="llama", base_tensors=BASE)
    assert list(a.pairs) == ["blk.0.attn_q.weight"]


def test_unexpected_suffix(tmp_path):
    t = good_q()
    t["blk.0.attn_q.weight.lora_c"] = _rand(R, K)
    (p,) = problems_of(write_adapter_gguf(tmp_path / "a.gguf", t))
    assert p.startswith("tensor 'blk.0.attn_q.weight.lora_c': unexpected suffix")


def test_half_pair(tmp_path):
    t = {"blk.0.attn_q.weight.lora_a": _rand(R, K)}
    assert problems_of(write_adapter_gguf(tmp_path / "a.gguf", t)) == [
        "pair 'blk.0.attn_q.weight': missing 'blk.0.attn_q.weight.lora_b' (found only 'blk.0.attn_q.weight.lora_a')"
    ]
    t = {"blk.0.attn_q.weight.lora_b": _rand(D, R)}
    (p,) = problems_of(write_adapter_gguf(tmp_path / "b.gguf", t))
    assert "missing 'blk.0.attn_q.weight.lora_a'" in p


def test_base_tensor_missing(tmp_path):
    t = {"blk.7.attn_q.weight.lora_a": _rand(R, K), "blk.7.attn_q.weight.lora_b": _rand(D, R)}
    (p,) = problems_of(write_adapter_gguf(tmp_path / "a.gguf", t))
    assert "base tensor 'blk.7.attn_q.weight' does not exist in the base model" in p
    assert "wrong base model?" in p


def test_linear_b_wrong_shape(tmp_path):
    t = {"blk.0.attn_q.weight.lora_a": _rand(R, K), "blk.0.attn_q.weight.lora_b": _rand(20, R)}
    (p,) = problems_of(write_adapter_gguf(tmp_path / "a.gguf", t))
    assert p.startswith("'blk.0.attn_q.weight.lora_b': expected ne [4, 24]")
    assert "found [4, 20]" in p and "is ne [32, 24]" in p and "wrong base model?" in p


def test_linear_a_wrong_k(tmp_path):
    t = {"blk.0.attn_q.weight.lora_a": _rand(R, 30), "blk.0.attn_q.weight.lora_b": _rand(D, R)}
    (p,) = problems_of(write_adapter_gguf(tmp_path / "a.gguf", t))
    assert "'blk.0.attn_q.weight.lora_a': expected ne [32, 4], found [30, 4]" in p and "wrong base model?" in p


def test_a_not_transposed(tmp_path):
    # old finetune exporter: A stored as ne [r, k] instead of [k, r]
    t = {"blk.0.attn_q.weight.lora_a": _rand(K, R), "blk.0.attn_q.weight.lora_b": _rand(D, R)}
    (p,) = problems_of(write_adapter_gguf(tmp_path / "a.gguf", t))
    assert "'blk.0.attn_q.weight.lora_a': expected ne [32, 4], found [4, 32]" in p
    assert "A.ne[1] = 32 != B.ne[0] = 4: lora_a appears not transposed" in p
    assert "old exporter format" in p


def test_token_embd_exception(tmp_path):
    # a linear-style A (ne [V, r]) is wrong for token_embd, which wants [r, V]
    t = {"token_embd.weight.lora_a": _rand(R, V), "token_embd.weight.lora_b": _rand(D, R)}
    (p,) = problems_of(write_adapter_gguf(tmp_path / "a.gguf", t))
    assert "'token_embd.weight.lora_a': expected ne [4, 50], found [50, 4]" in p
    assert "token_embd's A must be [r, V]" in p
    t = {"token_embd.weight.lora_a": _rand(V, R), "token_embd.weight.lora_b": _rand(D + 1, R)}
    (p,) = problems_of(write_adapter_gguf(tmp_path / "b.gguf", t))
    assert "'token_embd.weight.lora_b': expected ne [4, 24]" in p and "found [4, 25]" in p


def test_expert_shapes(tmp_path):
    t = {"blk.0.ffn_up_exps.weight.lora_a": _rand(E - 1, R, K), "blk.0.ffn_up_exps.weight.lora_b": _rand(E, D, R)}
    (p,) = problems_of(write_adapter_gguf(tmp_path / "a.gguf", t))
    assert "'blk.0.ffn_up_exps.weight.lora_a': expected ne [32, 4, 4], found [32, 4, 3]" in p
    t = {
        "blk.0.ffn_up_exps.weight.lora_a": _rand(R, K),  # 2-D pair on a 3-D expert tensor
        "blk.0.ffn_up_exps.weight.lora_b": _rand(D, R),
    }
    (p,) = problems_of(write_adapter_gguf(tmp_path / "b.gguf", t))
    assert "pair 'blk.0.ffn_up_exps.weight'" in p and "[k, r, E]" in p and "wrong number of dimensions" in p


def test_float_types_accepted(tmp_path):
    a16, b32 = _rand(R, K), _rand(D, R)
    bf16 = torch.from_numpy(b32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8).reshape(D, 2 * R)
    t = {
        "blk.0.attn_q.weight.lora_a": a16.astype(np.float16),
        "blk.0.attn_q.weight.lora_b": (bf16, gguf.GGMLQuantizationType.BF16),
    }
    a = load_lora_adapter(write_adapter_gguf(tmp_path / "a.gguf", t), base_arch="llama", base_tensors=BASE)
    pair = a.pairs["blk.0.attn_q.weight"]
    np.testing.assert_array_equal(pair.lora_a.numpy(), a16.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(pair.lora_b, torch.from_numpy(b32).to(torch.bfloat16).float())


def test_quantized_dequantized_at_load(tmp_path):
    a32 = _rand(R, K)
    q = gguf.quants.quantize(a32, gguf.GGMLQuantizationType.Q8_0)
    t = {"blk.0.attn_q.weight.lora_a": (q, gguf.GGMLQuantizationType.Q8_0), "blk.0.attn_q.weight.lora_b": _rand(D, R)}
    a = load_lora_adapter(write_adapter_gguf(tmp_path / "a.gguf", t), base_arch="llama", base_tensors=BASE)
    got = a.pairs["blk.0.attn_q.weight"].lora_a.numpy()
    assert got.dtype == np.float32 and np.abs(got - a32).max() < np.abs(a32).max() / 100


def test_unsupported_type(tmp_path):
    raw = np.zeros((R, K // 32 * 18), dtype=np.uint8)  # IQ4_NL: 18 bytes per 32 values
    t = {
        "blk.0.attn_q.weight.lora_a": (raw, gguf.GGMLQuantizationType.IQ4_NL),
        "blk.0.attn_q.weight.lora_b": _rand(D, R),
    }
    (p,) = problems_of(write_adapter_gguf(tmp_path / "a.gguf", t))
    assert p.startswith("tensor 'blk.0.attn_q.weight.lora_a': type IQ4_NL is not supported")


def test_max_rank(tmp_path):
    r = MAX_RANK + 1
    t = {"blk.0.attn_q.weight.lora_a": _rand(r, K), "blk.0.attn_q.weight.lora_b": _rand(D, r)}
    assert problems_of(write_adapter_gguf(tmp_path / "a.gguf", t)) == [
        "'blk.0.attn_q.weight.lora_b': rank 513 exceeds max_rank 512"
    ]


def test_non_finite_values(tmp_path):
    t = good_q()
    t["blk.0.attn_q.weight.lora_b"][3, 1] = np.nan
    (p,) = problems_of(write_adapter_gguf(tmp_path / "a.gguf", t))
    assert p == "tensor 'blk.0.attn_q.weight.lora_b': 1 NaN/Inf value(s) (type F32)"


def test_all_problems_collected(tmp_path):
    t = {
        "blk.0.attn_q.weight.lora_a": _rand(R, K),  # half pair
        "blk.9.attn_q.weight.lora_a": _rand(R, K),
        "blk.9.attn_q.weight.lora_b": _rand(D, R),
        "odd_tensor": _rand(3),
    }
    problems = problems_of(write_adapter_gguf(tmp_path / "a.gguf", t, gtype="model", arch="gemma3"))
    assert len(problems) == 5
    joined = "\n".join(problems)
    for fragment in (
        "general.type",
        "general.architecture",
        "odd_tensor",
        "blk.9.attn_q.weight",
        "missing 'blk.0.attn_q.weight.lora_b'",
    ):
        assert fragment in joined


def test_pair_rank_is_derived():
    pair = LoraPair("w", torch.zeros(3, 10), torch.zeros(7, 3))
    assert pair.rank == 3


# --- file-backed adapters (the worker's host tier) -------------------------------


def _mixed_types_adapter(tmp_path: Path) -> tuple[Path, dict]:
    """attn_q in F16, a Q8_0 pair, token_embd and experts in F32: every storage path."""
    t: dict = {
        "blk.0.attn_q.weight.lora_a": (_rand(R, K).astype(np.float16), gguf.GGMLQuantizationType.F16),
        "blk.0.attn_q.weight.lora_b": (_rand(D, R).astype(np.float16), gguf.GGMLQuantizationType.F16),
        "token_embd.weight.lora_a": _rand(V, R),
        "token_embd.weight.lora_b": _rand(D, R),
        "blk.0.ffn_up_exps.weight.lora_a": _rand(E, R, K),
        "blk.0.ffn_up_exps.weight.lora_b": _rand(E, D, R),
    }
    plain = {k: (v[0] if isinstance(v, tuple) else v) for k, v in t.items()}
    return write_adapter_gguf(tmp_path / "mixed.gguf", t), plain


def test_file_backed_adapter_reads_the_same_values(tmp_path):
    path, t = _mixed_types_adapter(tmp_path)
    mem = load_lora_adapter(path, base_arch="llama", base_tensors=BASE)
    fb = open_lora_adapter(path, base_arch="llama", base_tensors=BASE)
    assert fb.source is not None and (fb.sha256, fb.name, fb.ranks, fb.n_nodes) == (
        mem.sha256,
        mem.name,
        mem.ranks,
        mem.n_nodes,
    )
    q = fb.pairs["blk.0.attn_q.weight"]
    assert q.lora_a.device.type == "meta" and q.lora_a.dtype == torch.float16 and q.rank == R
    # side pairs stay in memory, in the storage dtype
    assert fb.pairs["token_embd.weight"].lora_a.device.type == "cpu"
    assert fb.size_bytes == 2 * (R * K + D * R) + 4 * (V * R + D * R) + 4 * (E * R * K + E * D * R)
    data = fb.tensors()
    for base, pair in data.items():
        assert pair.lora_a.device.type == "cpu"
        np.testing.assert_array_equal(pair.lora_a.float().numpy(), t[base + ".lora_a"].astype(np.float32))
        np.testing.assert_array_equal(pair.lora_b.float().numpy(), t[base + ".lora_b"].astype(np.float32))
        torch.testing.assert_close(pair.lora_a.float(), mem.pairs[base].lora_a, rtol=0, atol=0)
    assert set(fb.tensors(["blk.0.attn_q.weight"])) == {"blk.0.attn_q.weight"}


def test_file_backed_quantized_pair_is_dequantized_on_read(tmp_path):
    base = {"blk.0.attn_q.weight": (64, D)}
    a = _rand(R, 64)
    qa = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
    t = {
        "blk.0.attn_q.weight.lora_a": (qa, gguf.GGMLQuantizationType.Q8_0),
        "blk.0.attn_q.weight.lora_b": _rand(D, R),
    }
    path = write_adapter_gguf(tmp_path / "q8.gguf", t)
    mem = load_lora_adapter(path, base_arch="llama", base_tensors=base)
    fb = open_lora_adapter(path, base_arch="llama", base_tensors=base)
    got = fb.tensors()["blk.0.attn_q.weight"]
    assert got.lora_a.dtype == torch.float32
    torch.testing.assert_close(got.lora_a, mem.pairs["blk.0.attn_q.weight"].lora_a, rtol=0, atol=0)
    assert float((got.lora_a - torch.from_numpy(a)).abs().max()) < 0.05  # really Q8_0 data


def test_file_backed_adapter_refuses_a_changed_or_missing_file(tmp_path):
    path = write_adapter_gguf(tmp_path / "a.gguf", good_q())
    fb = open_lora_adapter(path, base_arch="llama", base_tensors=BASE)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(AdapterError) as info:
        fb.tensors()
    assert str(path) in str(info.value) and "changed on disk" in str(info.value)
    path.unlink()
    with pytest.raises(AdapterError) as info:
        fb.tensors()
    assert str(path) in str(info.value) and "cannot re-read" in str(info.value)
