"""loraplane.formats.convert_peft: PEFT folders → adapter GGUFs equal to llama.cpp's converter output.

The fixture GGUFs were written by llama.cpp's ``convert_lora_to_gguf.py --outtype f32`` from
the fixture PEFT folders. Ours must hold the same names, ne, values and alpha — except
``shout_rs`` (rsLoRA), where we write alpha = lora_alpha·√r = 32 instead of their 8.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from loraplane.formats.convert_peft import ConvertError, convert_peft
from loraplane.formats.gguf.reader import dequantize, read_gguf
from worker.lora.adapter import load_lora_adapter

# name → alpha we must write

EXPECTED_ALPHA = {"shout": 16.0, "sea": 8.0, "shout_embd": 8.0, "critic_alora": 16.0, "shout_rs": 32.0}


def compare_to_fixture(ours: Path, ref: Path, *, atol: float, rtol: float) -> None:
    a, b = read_gguf(ours), read_gguf(ref)
    assert set(a.tensors) == set(b.tensors)
    for name, rec in b.tensors.items():
        assert a.tensors[name].ne == rec.ne, name
        np.testing.assert_allclose(
            dequantize(ours, a.tensors[name]), dequantize(ref, rec), atol=atol, rtol=rtol, err_msg=name
        )
    assert a.metadata["general.type"] == "adapter" and a.metadata["adapter.type"] == "lora"
    assert a.metadata["general.architecture"] == b.metadata["general.architecture"]
    assert a.metadata.get("adapter.alora.invocation_tokens") == b.metadata.get("adapter.alora.invocation_tokens")


@pytest.mark.parametrize("name", sorted(EXPECTED_ALPHA))
def test_convert_fixture_f32(fixtures_dir, tmp_path, name):
    out = convert_peft(fixtures_dir / "adapters" / "peft" / name, tmp_path / f"{name}.gguf")
    compare_to_fixture(out, fixtures_dir / "adapters" / f"{name}.gguf", atol=0, rtol=0)
    meta = read_gguf(out).metadata
    assert meta["adapter.lora.alpha"] == EXPECTED_ALPHA[name] and meta["general.name"] == name


def test_rslora_alpha_gives_peft_scale(fixtures_dir, tmp_path):
    cfg = json.loads((fixtures_dir / "adapters" / "peft" / "shout_rs" / "adapter_config.json").read_text())
    assert cfg["use_rslora"] and (cfg["r"], cfg["lora_alpha"]) == (16, 8)
    out = convert_peft(fixtures_dir / "adapters" / "peft" / "shout_rs", tmp_path / "rs.gguf")
    alpha = read_gguf(out).metadata["adapter.lora.alpha"]
    assert alpha / cfg["r"] == pytest.approx(cfg["lora_alpha"] / math.sqrt(cfg["r"]))  # = 2


def test_convert_fixture_f16_against_base(fixtures_dir, tmp_path, base_model_path, base_index):
    name = "shout_embd"  # token_embd exception + linear pairs, validated against the real base
    out = convert_peft(
        fixtures_dir / "adapters" / "peft" / name,
        tmp_path / f"{name}.gguf",
        base_gguf=str(base_model_path),
        outtype="f16",
    )
    assert all(r.ggml_type.name == "F16" for r in read_gguf(out).tensors.values())
    compare_to_fixture(out, fixtures_dir / "adapters" / f"{name}.gguf", atol=1e-6, rtol=1e-3)
    arch, index = base_index
    a = load_lora_adapter(out, base_arch=arch, base_tensors=index)
    assert a.alpha == EXPECTED_ALPHA[name]


# ---- synthetic PEFT folders ----------------------------------------------------------------

PREFIX = "base_model.model.model.layers"
RNG = torch.Generator().manual_seed(0)


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=RNG)


def write_peft(folder: Path, tensors: dict[str, torch.Tensor], **cfg) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "base_model_name_or_path": "google/gemma-3-270m",
        "use_rslora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "bias": "none",
    }
    config.update(cfg)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(folder / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    return folder


def pair(module: str, r: int, k: int, d: int) -> dict[str, torch.Tensor]:
    return {f"{PREFIX}.{module}.lora_A.weight": _rand(r, k), f"{PREFIX}.{module}.lora_B.weight": _rand(d, r)}


def tensor(path: Path, name: str) -> np.ndarray:
    gf = read_gguf(path)
    return dequantize(path, gf.tensors[name])


def test_name_map_and_layouts(tmp_path):
    t = {}
    for mod, (k, d) in {
        "self_attn.q_proj": (16, 32),
        "self_attn.k_proj": (16, 8),
        "self_attn.v_proj": (16, 8),
        "self_attn.o_proj": (32, 16),
        "mlp.gate_proj": (16, 40),
        "mlp.up_proj": (16, 40),
        "mlp.down_proj": (40, 16),
    }.items():
        t.update(pair(f"1.{mod}", 4, k, d))
    t["base_model.model.model.embed_tokens.lora_embedding_A"] = _rand(4, 100)  # (r, V)
    t["base_model.model.model.embed_tokens.lora_embedding_B"] = _rand(16, 4)  # (d, r)
    t["base_model.model.lm_head.lora_A.weight"] = _rand(4, 16)
    t["base_model.model.lm_head.lora_B.weight"] = _rand(100, 4)
    out = convert_peft(write_peft(tmp_path / "p", t), tmp_path / "p.gguf")
    gf = read_gguf(out)
    names = {n[: -len(".lora_a")] for n in gf.tensors if n.endswith(".lora_a")}
    assert names == {
        "blk.1.attn_q.weight",
        "blk.1.attn_k.weight",
        "blk.1.attn_v.weight",
        "blk.1.attn_output.weight",
        "blk.1.ffn_gate.weight",
        "blk.1.ffn_up.weight",
        "blk.1.ffn_down.weight",
        "token_embd.weight",
        "output.weight",
    }
    assert gf.tensors["blk.1.ffn_down.weight.lora_a"].ne == (40, 4)  # [k, r]
    assert gf.tensors["blk.1.ffn_down.weight.lora_b"].ne == (4, 16)  # [r, d]
    assert gf.tensors["token_embd.weight.lora_a"].ne == (4, 100)  # [r, V] (exception)
    assert gf.tensors["token_embd.weight.lora_b"].ne == (4, 16)  # [r, d]
    np.testing.assert_array_equal(
        tensor(out, "token_embd.weight.lora_a"), t["base_model.model.model.embed_tokens.lora_embedding_A"].T.numpy()
    )
    assert gf.metadata["general.architecture"] == "gemma3" and gf.metadata["general.name"] == "p"
    assert "adapter.alora.invocation_tokens" not in gf.metadata


def test_unknown_module_is_an_error(tmp_path):
    t = (
        pair("0.self_attn.q_proj", 4, 16, 32)
        | pair("0.self_attn.qkv_proj", 4, 16, 48)
        | pair("0.mlp.experts.3.w1", 4, 16, 40)
    )
    with pytest.raises(ConvertError) as info:
        convert_peft(write_peft(tmp_path / "p", t), tmp_path / "p.gguf")
    msg = str(info.value)
    assert "module 'model.layers.0.self_attn.qkv_proj': no GGUF tensor name" in msg
    assert "module 'model.layers.0.mlp.experts.3.w1': no GGUF tensor name" in msg
    assert not (tmp_path / "p.gguf").exists()


def test_non_lora_tensor_is_an_error(tmp_path):
    t = pair("0.self_attn.q_proj", 4, 16, 32)
    t["base_model.model.lm_head.weight"] = _rand(100, 16)  # modules_to_save
    with pytest.raises(ConvertError, match=r"tensor 'base_model.model.lm_head.weight': not a LoRA A/B tensor"):
        convert_peft(write_peft(tmp_path / "p", t), tmp_path / "p.gguf")


def test_unsupported_config(tmp_path):
    t = pair("0.self_attn.q_proj", 4, 16, 32)
    with pytest.raises(ConvertError) as info:
        convert_peft(
            write_peft(tmp_path / "p", t, use_dora=True, base_model_name_or_path="org/some-model"), tmp_path / "p.gguf"
        )
    msg = str(info.value)
    assert "use_dora" in msg and "architecture: cannot tell it from base_model_name_or_path 'org/some-model'" in msg


def test_arch_inferred_llama(tmp_path):
    t = pair("0.self_attn.v_proj", 4, 16, 8)
    out = convert_peft(
        write_peft(tmp_path / "p", t, base_model_name_or_path="meta-llama/Llama-3.2-1B"), tmp_path / "p.gguf"
    )
    assert read_gguf(out).metadata["general.architecture"] == "llama"


def test_alora_tokens_written(tmp_path):
    t = pair("0.self_attn.q_proj", 4, 16, 32)
    out = convert_peft(write_peft(tmp_path / "p", t, alora_invocation_tokens=[7, 8, 9]), tmp_path / "p.gguf")
    assert read_gguf(out).metadata["adapter.alora.invocation_tokens"] == [7, 8, 9]


def test_alpha_pattern_folded_into_b(tmp_path):
    t = pair("0.self_attn.q_proj", 4, 16, 32) | pair("0.self_attn.v_proj", 4, 16, 8)
    out = convert_peft(
        write_peft(tmp_path / "p", t, r=4, lora_alpha=8, alpha_pattern={"q_proj": 32}), tmp_path / "p.gguf"
    )
    assert read_gguf(out).metadata["adapter.lora.alpha"] == 8.0
    # served scale alpha/r = 2; PEFT's q scale is 32/4 = 8, so B_q carries the factor 4
    np.testing.assert_allclose(
        tensor(out, "blk.0.attn_q.weight.lora_b"),
        4 * t[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"].numpy(),
        rtol=1e-6,
    )
    np.testing.assert_array_equal(
        tensor(out, "blk.0.attn_v.weight.lora_b"), t[f"{PREFIX}.0.self_attn.v_proj.lora_B.weight"].numpy()
    )


def test_rank_pattern(tmp_path):
    t = pair("0.self_attn.q_proj", 2, 16, 32) | pair("0.self_attn.v_proj", 4, 16, 8)
    folder = write_peft(tmp_path / "p", t, r=4, lora_alpha=8, rank_pattern={"q_proj": 2})
    out = convert_peft(folder, tmp_path / "p.gguf")
    # per-module ranks need no folding: the loader's alpha / B.ne[0] is PEFT's alpha / r_module
    np.testing.assert_array_equal(
        tensor(out, "blk.0.attn_q.weight.lora_b"), t[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"].numpy()
    )
    bad = write_peft(tmp_path / "bad", t, r=4, lora_alpha=8, rank_pattern={"q_proj": 3})
    with pytest.raises(ConvertError, match=r"rank 2 from its tensors, but the config .* says 3"):
        convert_peft(bad, tmp_path / "bad.gguf")


def test_rslora_with_rank_pattern(tmp_path):
    t = pair("0.self_attn.q_proj", 16, 16, 32) | pair("0.self_attn.v_proj", 4, 16, 8)
    out = convert_peft(
        write_peft(tmp_path / "p", t, r=16, lora_alpha=8, use_rslora=True, rank_pattern={"v_proj": 4}),
        tmp_path / "p.gguf",
    )
    alpha = read_gguf(out).metadata["adapter.lora.alpha"]
    assert alpha == 32.0
    # v: PEFT scale 8/√4 = 4, served 32/4 = 8 → B_v halved; q: 8/√16 = 2 = 32/16 → unchanged
    np.testing.assert_allclose(
        tensor(out, "blk.0.attn_v.weight.lora_b"),
        0.5 * t[f"{PREFIX}.0.self_attn.v_proj.lora_B.weight"].numpy(),
        rtol=1e-6,
    )
    np.testing.assert_array_equal(
        tensor(out, "blk.0.attn_q.weight.lora_b"), t[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"].numpy()
    )


def test_llama_qk_rows_permuted_like_base(fixtures_dir, tmp_path):
    base = fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"  # n_embd 64, 4 heads / 2 kv, head dim 16
    t = (
        pair("0.self_attn.q_proj", 4, 64, 64)
        | pair("0.self_attn.k_proj", 4, 64, 32)
        | pair("0.self_attn.v_proj", 4, 64, 32)
    )
    folder = write_peft(tmp_path / "p", t, base_model_name_or_path="meta-llama/tiny")
    with pytest.raises(ConvertError, match="pass base_gguf"):
        convert_peft(folder, tmp_path / "nobase.gguf")
    out = convert_peft(folder, tmp_path / "p.gguf", base_gguf=str(base))

    def hf_to_gguf_rows(w: np.ndarray, n_head: int) -> np.ndarray:
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for mod, gname, n_head in (("q_proj", "attn_q", 4), ("k_proj", "attn_k", 2), ("v_proj", "attn_v", None)):
        a = t[f"{PREFIX}.0.self_attn.{mod}.lora_A.weight"].numpy()
        b = t[f"{PREFIX}.0.self_attn.{mod}.lora_B.weight"].numpy()
        hf_delta = b @ a
        want = hf_delta if n_head is None else hf_to_gguf_rows(hf_delta, n_head)
        got = tensor(out, f"blk.0.{gname}.weight.lora_b") @ tensor(out, f"blk.0.{gname}.weight.lora_a")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_shape_mismatch_with_base_rejected(fixtures_dir, tmp_path):
    base = fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"
    t = pair("0.self_attn.v_proj", 4, 64, 48)  # base attn_v is ne [64, 32]
    folder = write_peft(tmp_path / "p", t, base_model_name_or_path="meta-llama/tiny")
    with pytest.raises(ConvertError, match=r"blk.0.attn_v.weight.lora_b.*expected ne \[4, 32\].*found \[4, 48\]"):
        convert_peft(folder, tmp_path / "p.gguf", base_gguf=str(base))
    assert not (tmp_path / "p.gguf").exists() and not list(tmp_path.glob("*.tmp"))


# llama3 and qwen2 are slow: their tiny bases carry 128k/152k-token vocabularies (~2 s each to
# write); the fast tier keeps phi3 (32k) and test_llama_qk_rows_permuted_like_base (llama's
# q/k row permutation against the tiny MoE base).
@pytest.mark.parametrize(
    "name", [pytest.param("llama3", marks=pytest.mark.slow), pytest.param("qwen2", marks=pytest.mark.slow), "phi3"]
)
def test_convert_equals_llama_cpp_converter_per_arch(fixtures_dir, tmp_path, name):
    """Llama 3 (q/k rows permuted for NORM rope, GQA head counts), Qwen 2 (NEOX rope: nothing
    permuted) and Phi-3 (fused ``qkv_proj`` / ``gate_up_proj`` → ``attn_qkv`` / ``ffn_up``):
    every tensor equal to what llama.cpp's ``convert_lora_to_gguf.py`` wrote from the same PEFT
    folder (``scripts/make_convert_fixtures.py``), against the tiny base model of that shape."""
    from tests.helpers.tiny_models import MODELS

    arch = {"llama3": "llama"}.get(name, name)
    base = MODELS[arch](tmp_path / f"{name}-base.gguf")
    src = fixtures_dir / "convert" / name
    out = convert_peft(src / "peft", tmp_path / f"{name}.gguf", base_gguf=str(base))
    ref = read_gguf(src / "llama_cpp.gguf")
    assert read_gguf(out).arch == ref.arch == arch
    assert len(ref.tensors) >= 16
    compare_to_fixture(out, src / "llama_cpp.gguf", atol=0.0, rtol=0.0)
    assert read_gguf(out).metadata["adapter.lora.alpha"] == ref.metadata["adapter.lora.alpha"] == 8.0
