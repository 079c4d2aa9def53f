"""The one architecture table (``loraplane.formats.arch``): the worker's graph builders, PEFT
conversion and the refusal of unknown architectures all read it."""

from __future__ import annotations

import pytest

from loraplane.formats import arch as table
from loraplane.formats.convert_peft import _infer_arch, _map_module
from worker.runtime import arch as builders
from worker.runtime.errors import ModelError

SERVED = ("gemma2", "gemma3", "llama", "phi3", "qwen2", "qwen3", "qwen3moe")


def test_every_table_entry_has_one_graph_builder():
    assert tuple(sorted(table.ARCHS)) == SERVED
    assert sorted(builders.BUILDERS) == sorted(table.ARCHS)
    for name, spec in table.ARCHS.items():
        assert spec.name == name
        assert builders.get(name) is builders.BUILDERS[name]


def test_unknown_architecture_names_it_and_lists_the_table():
    with pytest.raises(table.ArchError) as exc:
        table.get("mamba9", "/x/m.gguf")
    assert str(exc.value) == f"/x/m.gguf: unknown architecture 'mamba9' (supported: {', '.join(SERVED)})"
    with pytest.raises(ModelError) as worker_exc:
        builders.spec("mamba9", "/x/m.gguf")
    assert str(worker_exc.value) == str(exc.value)


def test_peft_names_map_onto_lora_targets():
    """Every GGUF tensor a PEFT module converts to is one the forward pass applies LoRA to."""
    assert table.peft_archs() == ("gemma2", "gemma3", "llama", "phi3", "qwen2", "qwen3")
    for spec in table.ARCHS.values():
        if spec.peft is None:
            continue
        for stem in spec.peft.modules.values():
            assert spec.is_lora_target(f"blk.7.{stem}.weight"), (spec.name, stem)
    assert table.ARCHS["phi3"].peft is not None
    assert table.ARCHS["phi3"].peft.modules["self_attn.qkv_proj"] == "attn_qkv"
    assert "self_attn.qkv_proj" not in table.PEFT_LAYER_MODULES
    assert "mlp.gate_proj" not in table.ARCHS["phi3"].peft.modules  # phi3 has no separate gate


@pytest.mark.parametrize(
    "arch, tensor, target",
    [
        ("gemma3", "blk.0.attn_q.weight", True),
        ("gemma3", "token_embd.weight", True),
        ("gemma3", "output.weight", True),
        ("gemma3", "blk.0.attn_norm.weight", False),
        ("gemma3", "blk.0.attn_qkv.weight", False),
        ("phi3", "blk.3.attn_qkv.weight", True),
        ("phi3", "blk.3.ffn_gate.weight", False),
        ("qwen3moe", "blk.1.ffn_up_exps.weight", True),
        ("qwen3moe", "blk.1.ffn_up.weight", False),
        ("llama", "blk.1.ffn_gate_inp.weight", True),
        ("qwen2", "blk.1.attn_q.bias", False),
    ],
)
def test_lora_targets(arch, tensor, target):
    assert table.ARCHS[arch].is_lora_target(tensor) is target


def test_convert_peft_reads_the_table():
    """Module names and architecture hints come from the table's ``PeftNames``."""
    assert _map_module("model.layers.2.self_attn.qkv_proj", "phi3") == "blk.2.attn_qkv.weight"
    assert _map_module("model.layers.2.self_attn.qkv_proj", "llama") is None
    assert _map_module("model.layers.2.mlp.down_proj", "qwen3moe") == "blk.2.ffn_down.weight"
    assert _infer_arch({"base_model_name_or_path": "google/gemma-3-270m"}) == "gemma3"
    assert _infer_arch({"base_model_name_or_path": "microsoft/Phi-4-mini-instruct"}) == "phi3"
    assert _infer_arch({"base_model_name_or_path": "Qwen/Qwen2.5-0.5B"}) == "qwen2"
    assert _infer_arch({"base_model_name_or_path": "some/model"}) is None
