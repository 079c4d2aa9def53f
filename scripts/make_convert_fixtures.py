"""Write small random PEFT LoRA folders in the shapes of ``tests/helpers/tiny_models.py`` (Llama 3, Qwen 2,
Phi-3 with its fused ``qkv_proj`` / ``gate_up_proj``) and convert each with llama.cpp's own
``convert_lora_to_gguf.py``: the references ``tests/parity/test_convert_peft.py`` holds our
``convert-peft`` to (``tests/fixtures/convert/``).

    python scripts/make_convert_fixtures.py LLAMA_CPP_DIR OUT_DIR

``LLAMA_CPP_DIR``: llama.cpp's source tree (e.g. the one ``bench/build_llama_server.sh``
unpacks from the llama-cpp-python sdist); needs ``transformers`` for the converter. The
converter reads the base model's ``config.json`` only (``--base``), written here beside each
folder and not kept.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

PREFIX = "base_model.model.model.layers"
# n_embd 64, 4 heads / 2 KV heads of 16, FFN 128, 2 layers: tests/helpers/tiny_models.py's shapes
SPECS = {
    "llama3": (
        "LlamaForCausalLM",
        "llama",
        "meta-llama/Llama-3.2-1B-Instruct",
        {
            "self_attn.q_proj": (64, 64),
            "self_attn.k_proj": (64, 32),
            "self_attn.v_proj": (64, 32),
            "self_attn.o_proj": (64, 64),
            "mlp.gate_proj": (64, 128),
            "mlp.up_proj": (64, 128),
            "mlp.down_proj": (128, 64),
        },
    ),
    "qwen2": (
        "Qwen2ForCausalLM",
        "qwen2",
        "Qwen/Qwen2.5-0.5B-Instruct",
        {
            "self_attn.q_proj": (64, 64),
            "self_attn.k_proj": (64, 32),
            "self_attn.v_proj": (64, 32),
            "self_attn.o_proj": (64, 64),
            "mlp.down_proj": (128, 64),
        },
    ),
    "phi3": (
        "Phi3ForCausalLM",
        "phi3",
        "microsoft/Phi-3-mini-4k-instruct",
        {
            "self_attn.qkv_proj": (64, 128),
            "self_attn.o_proj": (64, 64),
            "mlp.gate_up_proj": (64, 256),
            "mlp.down_proj": (128, 64),
        },
    ),
}


def write_peft(folder: Path, hub_name: str, modules: dict[str, tuple[int, int]], gen: torch.Generator) -> None:
    """A rank-4, alpha-8 PEFT folder with N(0, 0.1²) A and B on ``modules`` of 2 layers."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for il in range(2):
        for mod, (k, d) in modules.items():
            tensors[f"{PREFIX}.{il}.{mod}.lora_A.weight"] = torch.randn(4, k, generator=gen) * 0.1
            tensors[f"{PREFIX}.{il}.{mod}.lora_B.weight"] = torch.randn(d, 4, generator=gen) * 0.1
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 4,
        "lora_alpha": 8,
        "base_model_name_or_path": hub_name,
        "use_rslora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "bias": "none",
        "target_modules": sorted({m.split(".")[-1] for m in modules}),
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n")


def main(argv: list[str]) -> int:
    llama_cpp, out = Path(argv[0]), Path(argv[1])
    gen = torch.Generator().manual_seed(7)
    for name, (cls, model_type, hub_name, modules) in SPECS.items():
        write_peft(out / name / "peft", hub_name, modules, gen)
        with tempfile.TemporaryDirectory() as base:
            config = {
                "architectures": [cls],
                "model_type": model_type,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "vocab_size": 32000,
                "rms_norm_eps": 1e-5,
                "max_position_embeddings": 4096,
                "rope_theta": 10000.0,
                "tie_word_embeddings": False,
            }
            (Path(base) / "config.json").write_text(json.dumps(config))
            cmd = [sys.executable, str(llama_cpp / "convert_lora_to_gguf.py"), str(out / name / "peft")]
            cmd += ["--base", base, "--outtype", "f32", "--outfile", str(out / name / "llama_cpp.gguf")]
            subprocess.run(cmd, check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
