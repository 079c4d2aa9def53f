"""PEFT folders are accepted where adapter GGUFs are: ``adapters add PEFT_DIR`` (converted by
the CLI, uploaded as GGUF), ``adapters add --server-path PEFT_DIR`` and start-up ``--lora
PEFT_DIR`` (converted by the control plane). Every way gives the content hash of
``convert-peft`` followed by ``adapters add`` of the GGUF, and records ``source_format``."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("shout", "sea", "shout_embd", "critic_alora", "shout_rs")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clients.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.fixture
def peft_dir(fixtures_dir: Path) -> Path:
    return fixtures_dir / "adapters" / "peft"


# slow: converts a PEFT folder twice and uploads both (about 8 s)
@pytest.mark.slow
def test_adapters_add_peft_folder_equals_convert_then_add(start_control_plane, peft_dir, tmp_path):
    cp = start_control_plane(adapter_dirs=(str(peft_dir),))
    for name in FOLDERS:
        folder = peft_dir / name
        r = cli("adapters", "add", str(folder), "--addr", cp.addr, "--json")
        assert r.returncode == 0, r.stderr
        added = json.loads(r.stdout)
        out = tmp_path / f"{name}.gguf"
        conv = cli("convert-peft", str(folder), "-o", str(out))
        assert conv.returncode == 0, conv.stderr
        r2 = cli("adapters", "add", str(out), "--addr", cp.addr, "--json")
        assert r2.returncode == 0, r2.stderr
        again = json.loads(r2.stdout)
        assert added["sha256"] == again["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
        assert added["id"] == again["id"]  # same content: same registration
        assert (added["source_format"], added["name"]) == ("peft", name)
        # the control plane converts a server-side folder to the same bytes
        r3 = cli("adapters", "add", "--server-path", str(folder), "--addr", cp.addr, "--json")
        assert r3.returncode == 0, r3.stderr
        assert json.loads(r3.stdout)["sha256"] == added["sha256"]


def test_startup_lora_peft_folder(start_control_plane, peft_dir, tmp_path):
    out = tmp_path / "sea.gguf"
    assert cli("convert-peft", str(peft_dir / "sea"), "-o", str(out)).returncode == 0
    cp = start_control_plane(lora=(str(peft_dir / "sea"),))
    (rec,) = cp.state.registry.list()
    assert (rec.id, rec.sha256, rec.source_format, rec.default_scale) == (
        0,
        hashlib.sha256(out.read_bytes()).hexdigest(),
        "peft",
        1.0,
    )
    assert Path(rec.path).parent == Path(cp.config.data_dir) / "adapters"


def test_unconvertible_peft_folder_is_refused_with_every_problem(start_control_plane, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    import numpy as np
    from safetensors.numpy import save_file

    (bad / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": True})
    )
    save_file({"base_model.model.model.norm.weight": np.zeros(4, np.float32)}, str(bad / "adapter_model.safetensors"))
    cp = start_control_plane(adapter_dirs=(str(tmp_path),))
    r = cli("adapters", "add", "--server-path", str(bad), "--addr", cp.addr, "--json")
    assert r.returncode == 1
    err = json.loads(r.stdout)["error"]
    assert err["code"] == "INVALID_ARGUMENT"
    assert "use_dora" in err["message"] and "not a LoRA A/B tensor" in err["message"]
    r = cli("adapters", "add", str(bad), "--addr", cp.addr, "--json")
    assert r.returncode == 1 and "use_dora" in json.loads(r.stdout)["error"]["message"]
    assert cp.state.registry.list() == []


def test_convert_peft_reads_bf16_and_f16_without_torch(tmp_path, fixtures_dir):
    """The numpy safetensors reader widens F16/BF16 exactly: a bf16 copy of the shout folder
    converts to the bytes of its f32-widened copy."""
    import numpy as np
    from safetensors.numpy import save_file

    from loraplane.formats.convert_peft import read_safetensors

    src = fixtures_dir / "adapters" / "peft" / "shout"
    tensors = read_safetensors(src / "adapter_model.safetensors")
    f16 = {k: v.astype(np.float16) for k, v in tensors.items()}
    for name, arrays in (("f16", f16), ("f32", {k: v.astype(np.float32) for k, v in f16.items()})):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
        save_file(arrays, str(d / "adapter_model.safetensors"))
    back = read_safetensors(tmp_path / "f16" / "adapter_model.safetensors")
    assert all(np.array_equal(back[k], f16[k].astype(np.float32)) for k in f16)
    # bf16: top 16 bits of f32, written by hand (numpy has no bfloat16)
    raw = {k: (v.view(np.uint32) >> 16).astype(np.uint16) for k, v in tensors.items()}
    header = {k: {"dtype": "BF16", "shape": list(v.shape), "data_offsets": [0, 0]} for k, v in raw.items()}
    off, blobs = 0, []
    for k in sorted(raw):
        b = raw[k].tobytes()
        header[k]["data_offsets"] = [off, off + len(b)]
        off += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    (tmp_path / "bf16.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))
    bf = read_safetensors(tmp_path / "bf16.safetensors")
    assert all(np.array_equal(bf[k], (raw[k].astype(np.uint32) << 16).view(np.float32)) for k in raw)
