"""worker.tools.export_lora: merged tensors equal base + scaled delta; the untie rule.

Structural checks on the tiny MoE model and a small synthetic tied gemma3-like model; the
expected values are recomputed here with numpy straight from the GGUF files.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from loraplane.formats.adapter_file import AdapterError
from loraplane.formats.gguf.reader import dequantize, read_gguf
from worker.tools.export_lora import export_lora

# slow tier: each test merges a whole model file and reads it back (12 s in all on a 2-core AMD EPYC)
pytestmark = pytest.mark.slow

ALPHA, RANK = 8.0, 4  # moe_lora.gguf


@pytest.fixture(scope="module")
def tiny(tiny_moe_f32, fixtures_dir) -> tuple[Path, Path]:
    return tiny_moe_f32, fixtures_dir / "tiny_moe" / "moe_lora.gguf"


def expected_merge(base: Path, adapters: list[tuple[Path, float]]) -> dict[str, np.ndarray]:
    """numpy: W + Σ s·delta for every patched tensor (s = scale·alpha/rank)."""
    gb = read_gguf(base)
    out: dict[str, np.ndarray] = {}
    for path, scale in adapters:
        ga = read_gguf(path)
        alpha = ga.metadata.get("adapter.lora.alpha", 0.0)
        for name in ga.tensors:
            if not name.endswith(".lora_a"):
                continue
            w_name = name[: -len(".lora_a")]
            a = dequantize(path, ga.tensors[name])
            b = dequantize(path, ga.tensors[w_name + ".lora_b"])
            s = scale * alpha / b.shape[-1] if alpha else scale
            if w_name == "token_embd.weight":
                delta = a @ b.T  # (V, r) @ (r, d)
            elif a.ndim == 3:
                delta = np.einsum("edr,erk->edk", b, a)
            else:
                delta = b @ a
            w = out.get(w_name, dequantize(base, gb.tensors[w_name]))
            out[w_name] = w + s * delta
    return out


def test_f32_merge_equals_base_plus_delta(tiny, tmp_path):
    base, lora = tiny
    out = export_lora(base, [(lora, 0.5)], tmp_path / "m.gguf")
    want = expected_merge(base, [(lora, 0.5)])
    assert set(want) == {
        "blk.0.attn_q.weight",
        "blk.0.ffn_up_exps.weight",
        "blk.1.ffn_up_exps.weight",
        "blk.1.ffn_down_exps.weight",
    }
    gm, gb = read_gguf(out), read_gguf(base)
    assert list(gm.tensors) == list(gb.tensors)
    for name, rec in gb.tensors.items():
        got = gm.tensors[name]
        assert got.ne == rec.ne and got.ggml_type == rec.ggml_type, name
        if name in want:
            np.testing.assert_allclose(dequantize(out, got), want[name], rtol=1e-5, atol=1e-5, err_msg=name)
            assert not np.allclose(dequantize(base, rec), want[name])  # the delta is not negligible
        else:
            assert got.raw.tobytes() == rec.raw.tobytes(), name
    assert gm.metadata == gb.metadata | {"general.type": "model"}


def test_several_adapters_add_up(tiny, tmp_path):
    base, lora = tiny
    out = export_lora(base, [(lora, 0.5), (lora, 0.25)], tmp_path / "m.gguf")
    single = export_lora(base, [(lora, 0.75)], tmp_path / "s.gguf")
    gm, gs = read_gguf(out), read_gguf(single)
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down_exps.weight"):
        np.testing.assert_allclose(
            dequantize(out, gm.tensors[name]), dequantize(single, gs.tensors[name]), rtol=1e-5, atol=1e-6
        )


def test_scale_zero_copies_base(tiny, tmp_path):
    base, lora = tiny
    out = export_lora(base, [(lora, 0.0)], tmp_path / "m.gguf")
    gm, gb = read_gguf(out), read_gguf(base)
    assert all(gm.tensors[n].raw.tobytes() == r.raw.tobytes() for n, r in gb.tensors.items())


@pytest.mark.parametrize("outtype,qtype,tol", [("f16", "F16", 2e-3), ("q8_0", "Q8_0", 1e-2)])
def test_f16_and_q8_0_outputs(tiny, tmp_path, outtype, qtype, tol):
    base, lora = tiny
    out = export_lora(base, [(lora, 1.0)], tmp_path / f"m_{outtype}.gguf", outtype=outtype)
    want = expected_merge(base, [(lora, 1.0)])
    gm, gb = read_gguf(out), read_gguf(base)
    for name, rec in gm.tensors.items():
        if name in want:
            assert rec.ggml_type.name == qtype, name
            got = dequantize(out, rec)
            # relative to the tensor's scale: f16 rounding / 8-bit blocks
            assert np.abs(got - want[name]).max() <= tol * np.abs(want[name]).max(), name
        else:
            assert rec.ggml_type == gb.tensors[name].ggml_type  # untouched: original type (F32)
            assert rec.raw.tobytes() == gb.tensors[name].raw.tobytes()


def test_adapter_for_other_arch_rejected(tiny, fixtures_dir, tmp_path):
    base, _ = tiny
    with pytest.raises(AdapterError, match="general.architecture: expected 'llama'"):
        export_lora(base, [(fixtures_dir / "adapters" / "sea.gguf", 1.0)], tmp_path / "m.gguf")
    assert not list(tmp_path.iterdir())


def test_bad_outtype(tiny, tmp_path):
    base, lora = tiny
    with pytest.raises(ValueError, match="outtype"):
        export_lora(base, [(lora, 1.0)], tmp_path / "m.gguf", outtype="q4_k")


# ---- tied output (gemma3-like, no output.weight) --------------------------------------------

D, V, R = 32, 40, 4
RNG = np.random.default_rng(1)


def _rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _write(path: Path, arch: str, tensors: dict, kv: dict) -> Path:
    w = gguf.GGUFWriter(path, arch)
    for key, (value, vtype, sub) in kv.items():
        w.add_key_value(key, value, vtype, sub)
    for name, t in tensors.items():
        w.add_tensor(name, t[0], raw_dtype=t[1]) if isinstance(t, tuple) else w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture()
def tied_base(tmp_path) -> Path:
    """A tied gemma3-like model: Q8_0 token_embd, one linear, one norm, no output.weight."""
    T = gguf.GGUFValueType
    emb = gguf.quants.quantize(_rand(V, D), gguf.GGMLQuantizationType.Q8_0)
    return _write(
        tmp_path / "tied.gguf",
        "gemma3",
        {
            "token_embd.weight": (emb, gguf.GGMLQuantizationType.Q8_0),
            "blk.0.attn_q.weight": _rand(D, D),
            "output_norm.weight": _rand(D),
        },
        {
            "general.type": ("model", T.STRING, None),
            "gemma3.embedding_length": (D, T.UINT32, None),
            "tokenizer.ggml.tokens": ([f"t{i}" for i in range(V)], T.ARRAY, T.STRING),
            "tokenizer.ggml.scores": ([0.5] * V, T.ARRAY, T.FLOAT32),
        },
    )


def _adapter(path: Path, tensors: dict) -> Path:
    T = gguf.GGUFValueType
    return _write(
        path,
        "gemma3",
        tensors,
        {
            "general.type": ("adapter", T.STRING, None),
            "adapter.type": ("lora", T.STRING, None),
            "adapter.lora.alpha": (8.0, T.FLOAT32, None),
        },
    )


def test_untie_keeps_original_output(tied_base, tmp_path):
    a_emb, b_emb, a_q, b_q = _rand(V, R), _rand(D, R), _rand(R, D), _rand(D, R)
    lora = _adapter(
        tmp_path / "embd.gguf",
        {
            "token_embd.weight.lora_a": a_emb,
            "token_embd.weight.lora_b": b_emb,  # ne [r, V], [r, d]
            "blk.0.attn_q.weight.lora_a": a_q,
            "blk.0.attn_q.weight.lora_b": b_q,
        },
    )
    out = export_lora(tied_base, [(lora, 1.0)], tmp_path / "m.gguf")
    gm, gb = read_gguf(out), read_gguf(tied_base)
    s = 8.0 / R
    emb = dequantize(tied_base, gb.tensors["token_embd.weight"])
    np.testing.assert_allclose(
        dequantize(out, gm.tensors["token_embd.weight"]), emb + s * a_emb @ b_emb.T, rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        dequantize(out, gm.tensors["blk.0.attn_q.weight"]),
        dequantize(tied_base, gb.tensors["blk.0.attn_q.weight"]) + s * b_q @ a_q,
        rtol=1e-5,
        atol=1e-5,
    )
    # output.weight = the original token_embd, byte for byte, in its original type
    outw = gm.tensors["output.weight"]
    assert outw.ggml_type == gguf.GGMLQuantizationType.Q8_0 and outw.ne == (D, V)
    assert outw.raw.tobytes() == gb.tensors["token_embd.weight"].raw.tobytes()
    assert gm.metadata["tokenizer.ggml.tokens"] == [f"t{i}" for i in range(V)]
    assert gm.metadata["gemma3.embedding_length"] == D and gm.metadata["general.type"] == "model"


def test_no_untie_without_embedding_adapter(tied_base, tmp_path):
    lora = _adapter(
        tmp_path / "q.gguf", {"blk.0.attn_q.weight.lora_a": _rand(R, D), "blk.0.attn_q.weight.lora_b": _rand(D, R)}
    )
    out = export_lora(tied_base, [(lora, 1.0)], tmp_path / "m.gguf", outtype="q8_0")
    gm = read_gguf(out)
    assert "output.weight" not in gm.tensors
    assert gm.tensors["blk.0.attn_q.weight"].ggml_type == gguf.GGMLQuantizationType.Q8_0
    assert gm.tensors["output_norm.weight"].ggml_type == gguf.GGMLQuantizationType.F32
