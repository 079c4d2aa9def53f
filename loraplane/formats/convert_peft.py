"""Convert a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) to an adapter GGUF.

Our own implementation of llama.cpp's ``convert_lora_to_gguf.py`` for the architectures of
``loraplane.formats.arch`` that have PEFT names, plus rsLoRA and ``rank_pattern`` /
``alpha_pattern`` folded in exactly. `convert_peft` writes the file, `is_peft_dir` recognises a
folder, `read_safetensors` reads tensors with numpy (no torch: the control plane, the CLI and the
``convert-peft`` tool run the same code). The name map, the layouts, the llama q/k permutation and
the scale rules: docs/formats.md, "PEFT conversion".
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from loraplane.formats.adapter_file import AdapterError, read_lora_adapter
from loraplane.formats.arch import ARCHS, PEFT_LAYER_MODULES, peft_archs
from loraplane.formats.gguf.reader import GGUFFile, read_gguf
from loraplane.formats.gguf.writer import write_and_close

OUTTYPES = {"f32": np.float32, "f16": np.float16}

_KEY_RE = re.compile(
    r"^base_model\.model\.(?P<module>.+)\."
    r"(?P<kind>lora_A\.weight|lora_B\.weight|lora_embedding_A|lora_embedding_B)$"
)
_LAYER_RE = re.compile(r"^model\.layers\.(?P<i>\d+)\.(?P<sub>.+)$")
# multimodal wrappers put the text model one level down
_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.", ""))


PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
# safetensors dtype name → numpy dtype (BF16 is widened by hand: numpy has no bfloat16)
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}


class ConvertError(AdapterError):
    """The PEFT folder cannot be converted; ``problems`` lists every reason."""


def is_peft_dir(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a folder holding ``adapter_config.json`` (a PEFT adapter folder)."""
    p = Path(path)
    return p.is_dir() and (p / PEFT_CONFIG).is_file()


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a float32 numpy array (torch shape order).

    Format (huggingface/safetensors): an 8-byte little-endian header length, a JSON header
    ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` (offsets relative to the byte
    after the header), then the raw little-endian data. F64 is rounded to f32 like
    ``torch.Tensor.to(float32)``; F16 and BF16 widen exactly.

    Raises:
        ConvertError: truncated file, bad header, or a dtype other than F64/F32/F16/BF16.
    """
    src = Path(path)
    data = np.memmap(src, dtype=np.uint8, mode="r")
    problems: list[str] = []
    if data.size < 8:
        raise ConvertError(src, ["safetensors: file shorter than its 8-byte header length"])
    n = int(np.frombuffer(data[:8].tobytes(), dtype="<u8")[0])
    try:
        header = json.loads(data[8 : 8 + n].tobytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConvertError(src, [f"safetensors: header is not JSON ({exc})"]) from None
    out: dict[str, np.ndarray] = {}
    base = 8 + n
    for name, info in sorted(header.items()):  # by name, as safetensors' ``safe_open.keys()``
        if name == "__metadata__":
            continue
        dtype, shape = info.get("dtype"), tuple(int(x) for x in info.get("shape", ()))
        begin, end = (int(x) for x in info.get("data_offsets", (0, 0)))
        raw = data[base + begin : base + end]
        if base + end > data.size:
            problems.append(f"tensor '{name}': data runs past the end of the file")
            continue
        if dtype == "BF16":
            arr = (np.frombuffer(raw.tobytes(), dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif dtype in _ST_DTYPES:
            arr = np.frombuffer(raw.tobytes(), dtype=np.dtype(_ST_DTYPES[dtype]).newbyteorder("<"))
            arr = arr.astype(np.float32)
        else:
            problems.append(f"tensor '{name}': dtype {dtype} is not a float type (F64/F32/F16/BF16)")
            continue
        out[name] = arr.reshape(shape)
    if problems:
        raise ConvertError(src, problems)
    return out


@dataclass
class _Module:
    """One PEFT LoRA module on its way to a GGUF pair (numpy f32, torch shape order)."""

    peft_name: str  # e.g. model.layers.0.self_attn.q_proj (what PEFT patterns match against)
    gguf_name: str  # e.g. blk.0.attn_q.weight
    a: np.ndarray | None = None  # f32 (r, k); token embedding: (r, V)
    b: np.ndarray | None = None  # f32 (d, r)
    embedding: bool = False


def _layer_modules(arch: str) -> Mapping[str, str]:
    """PEFT layer sub-module → GGUF tensor stem for ``arch`` (the architecture table's map; the
    common one for an architecture it does not convert)."""
    spec = ARCHS.get(arch)
    return spec.peft.modules if spec is not None and spec.peft is not None else PEFT_LAYER_MODULES


def _map_module(module: str, arch: str = "") -> str | None:
    """GGUF base tensor name for a PEFT module path of an ``arch`` model, or None when unknown."""
    for old, new in _PREFIXES:
        if module.startswith(old):
            module = new + module[len(old) :]
            break
    if module == "model.embed_tokens":
        return "token_embd.weight"
    if module == "lm_head":
        return "output.weight"
    m = _LAYER_RE.match(module)
    layer_modules = _layer_modules(arch)
    if m and m["sub"] in layer_modules:
        return f"blk.{m['i']}.{layer_modules[m['sub']]}.weight"
    return None


def _infer_arch(cfg: dict[str, Any]) -> str | None:
    auto = cfg.get("auto_mapping") or {}
    text = " ".join(
        str(x)
        for x in (cfg.get("base_model_name_or_path"), auto.get("base_model_class"), auto.get("parent_library"))
        if x
    )
    text = text.lower()
    found = [name for name, spec in ARCHS.items() if spec.peft and any(n in text for n in spec.peft.hints)]
    return found[0] if len(found) == 1 else None


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT ``get_pattern_key``: first pattern (insertion order) matching the module's tail."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _check_config(cfg: dict[str, Any], problems: list[str]) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type: expected 'LORA', found {cfg.get('peft_type')!r}")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or isinstance(cfg.get(key), bool):
            problems.append(f"{key}: expected a number, found {cfg.get(key)!r}")
    if cfg.get("use_dora"):
        problems.append("use_dora: DoRA magnitude vectors cannot be stored in a LoRA GGUF")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        problems.append(
            f"bias/lora_bias: LoRA biases are not supported (bias={cfg.get('bias')!r}, "
            f"lora_bias={cfg.get('lora_bias')!r})"
        )
    if cfg.get("trainable_token_indices"):
        problems.append("trainable_token_indices: trainable token rows are full weights, not LoRA")
    if cfg.get("invocation_string") and not cfg.get("alora_invocation_tokens"):
        problems.append(
            "invocation_string without alora_invocation_tokens: tokenize it with the "
            "base tokenizer and add alora_invocation_tokens to adapter_config.json"
        )
    tokens = cfg.get("alora_invocation_tokens")
    if tokens is not None and not (
        isinstance(tokens, list)
        and tokens
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in tokens)
    ):
        problems.append(f"alora_invocation_tokens: expected a non-empty list of token ids, found {tokens!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(cfg.get(key) or {}, dict):
            problems.append(f"{key}: expected a mapping, found {cfg.get(key)!r}")


def _read_modules(st_path: Path, arch: str, problems: list[str]) -> list[_Module]:
    modules: dict[str, _Module] = {}
    unknown: list[str] = []
    for key, t in read_safetensors(st_path).items():
        m = _KEY_RE.match(key)
        if m is None:
            problems.append(
                f"tensor '{key}': not a LoRA A/B tensor (full weights from "
                "modules_to_save, DoRA or biases cannot go into a LoRA GGUF)"
            )
            continue
        module, kind = m["module"], m["kind"]
        gguf_name = _map_module(module, arch)
        if gguf_name is None:
            unknown.append(module)
            continue
        entry = modules.setdefault(gguf_name, _Module(module, gguf_name))
        if kind.startswith("lora_A") or kind == "lora_embedding_A":
            entry.a = t
        else:
            entry.b = t
        entry.embedding = entry.embedding or kind.startswith("lora_embedding")
    for name in sorted(set(unknown)):
        problems.append(
            f"module '{name}': no GGUF tensor name for it (known: layers.N."
            f"{{{', '.join(_layer_modules(arch))}}}, embed_tokens, lm_head)"
        )
    out = []
    for mod in modules.values():
        if mod.a is None or mod.b is None:
            problems.append(f"module '{mod.peft_name}': missing lora_{'B' if mod.b is None else 'A'}")
            continue
        if mod.a.ndim != 2 or mod.b.ndim != 2 or mod.a.shape[0] != mod.b.shape[1]:
            problems.append(
                f"module '{mod.peft_name}': expected A (r, k) and B (d, r) with equal r, "
                f"found A {tuple(mod.a.shape)}, B {tuple(mod.b.shape)}"
            )
            continue
        if mod.embedding != (mod.gguf_name == "token_embd.weight"):
            problems.append(f"module '{mod.peft_name}': embedding/linear LoRA kind does not match the module")
            continue
        out.append(mod)
    return out


def _rope_permute_rows(b: np.ndarray, n_head: int) -> np.ndarray:
    """Permute B's rows like convert_hf_to_gguf ``LlamaModel.permute`` does W's rows."""
    d, r = b.shape
    return b.reshape(n_head, 2, d // n_head // 2, r).swapaxes(1, 2).reshape(d, r)


def convert_peft(
    peft_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    base_gguf: str | GGUFFile | None = None,
    outtype: str = "f32",
    name: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write the adapter GGUF for a PEFT LoRA folder.

    Args:
        peft_dir: folder with ``adapter_config.json`` and ``adapter_model.safetensors``.
        out_path: GGUF file to write (replaced atomically on success).
        base_gguf: the base model GGUF (a path, or an already parsed ``GGUFFile``: the
            control plane holds one). Gives the architecture and head counts (needed for
            llama q/k), and the written adapter is validated against it.
        outtype: ``f32`` or ``f16`` for the A/B tensors.
        name: ``general.name`` to write; None means the folder's name (what ``convert-peft``
            writes, so a converted upload hashes the same as the tool's output).
        progress: called as ``progress(done, total)`` after each module is converted
            (``loraplane.progress`` draws a bar from it on a terminal).

    Returns:
        ``out_path`` as a Path.

    Raises:
        ConvertError: every problem found (unsupported config, unknown module, unknown
            architecture, ...); with ``base_gguf``, also the adapter validation problems.
    """
    src = Path(peft_dir)
    out = Path(out_path)
    if outtype not in OUTTYPES:
        raise ConvertError(src, [f"outtype: expected one of {', '.join(OUTTYPES)}, found {outtype!r}"])
    inputs = _read_inputs(src, base_gguf)
    cfg = inputs.cfg
    r_default, lora_alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    alpha = lora_alpha * math.sqrt(r_default) if cfg.get("use_rslora") else lora_alpha

    problems: list[str] = []
    tensors: list[tuple[str, np.ndarray]] = []
    for done, mod in enumerate(inputs.modules, 1):
        if progress is not None:
            progress(done, len(inputs.modules))
        pair = _module_pair(mod, inputs, alpha, problems)
        if pair is not None:
            np_type = OUTTYPES[outtype]
            tensors.append((mod.gguf_name + ".lora_a", np.ascontiguousarray(pair[0]).astype(np_type)))
            tensors.append((mod.gguf_name + ".lora_b", np.ascontiguousarray(pair[1]).astype(np_type)))
    if problems:
        raise ConvertError(src, problems)

    tmp = out.with_name(out.name + ".tmp")
    _write_adapter(tmp, inputs.arch, alpha, src.name if name is None else name, cfg, tensors)
    if base_gguf is not None:
        try:
            read_lora_adapter(tmp, base_arch=inputs.arch, base_tensors=inputs.base_index)
        except AdapterError as exc:
            tmp.unlink(missing_ok=True)
            raise ConvertError(
                src,
                [f"converted adapter does not fit {getattr(base_gguf, 'path', base_gguf)}: {p}" for p in exc.problems],
            ) from exc
    os.replace(tmp, out)
    return out


@dataclass
class _Inputs:
    """A PEFT folder read and checked: its config, the architecture, the base model's metadata
    and tensor index (empty without a base), and the complete A/B modules."""

    cfg: dict[str, Any]
    arch: str
    base_meta: dict[str, Any]
    base_index: dict[str, tuple[int, ...]]
    modules: list[_Module]


def _read_inputs(src: Path, base_gguf: str | GGUFFile | None) -> _Inputs:
    """Read ``src``'s config and tensors and check them (and against ``base_gguf`` if given).

    Raises:
        ConvertError: every problem found (missing files, unsupported config, architecture,
            no tensors, an ``lm_head`` LoRA on a tied base).
    """
    cfg_path, st_path = src / PEFT_CONFIG, src / PEFT_WEIGHTS
    missing = [str(p) for p in (cfg_path, st_path) if not p.is_file()]
    if missing:
        raise ConvertError(src, [f"missing file {p}" for p in missing])
    cfg = json.loads(cfg_path.read_text())

    problems: list[str] = []
    _check_config(cfg, problems)
    base_meta: dict[str, Any] = {}
    base_index: dict[str, tuple[int, ...]] = {}
    if base_gguf is not None:
        # read once: parsing a large vocab takes seconds
        base = base_gguf if isinstance(base_gguf, GGUFFile) else read_gguf(base_gguf)
        base_meta, arch = base.metadata, base.arch
        base_index = {name: tuple(rec.ne) for name, rec in base.tensors.items()}
    else:
        arch = _infer_arch(cfg) or ""
        if not arch:
            problems.append(
                f"architecture: cannot tell it from base_model_name_or_path "
                f"{cfg.get('base_model_name_or_path')!r}; pass base_gguf"
            )
    if arch and arch not in peft_archs():
        problems.append(f"architecture '{arch}': no PEFT name map (supported: {', '.join(peft_archs())})")
    modules = _read_modules(st_path, arch, problems)
    if not modules and not problems:
        problems.append(f"{st_path.name}: no LoRA A/B tensors found")
    if (
        base_gguf is not None
        and "output.weight" not in base_index
        and any(m.gguf_name == "output.weight" for m in modules)
    ):
        problems.append(
            "module 'lm_head': the base model has no output.weight (tied to "
            "token_embd), so an lm_head LoRA cannot be applied; target embed_tokens"
        )
    if problems:
        raise ConvertError(src, problems)
    return _Inputs(cfg, arch, base_meta, base_index, modules)


def _module_pair(mod: _Module, inputs: _Inputs, alpha: float, problems: list[str]) -> tuple[Any, Any] | None:
    """``(lora_a, lora_b)`` of one module in llama.cpp's layout, or None after appending the
    problem to ``problems``.

    The module's own PEFT scale (``rank_pattern`` / ``alpha_pattern``, rsLoRA) is folded into
    B where it differs from the file's ``alpha / r``; llama q/k rows get the rope permutation
    of ``convert_hf_to_gguf.py`` (``LlamaModel.permute``); an embedding's A is transposed to
    ne ``[r, V]`` (llama.cpp's token_embd exception).
    """
    cfg = inputs.cfg
    r_default, lora_alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    rslora = bool(cfg.get("use_rslora"))
    a, b = mod.a, mod.b
    assert a is not None and b is not None  # _collect reported incomplete modules
    r = int(b.shape[1])
    want_r = int(_pattern_value(cfg.get("rank_pattern") or {}, mod.peft_name, r_default))
    if r != want_r:
        problems.append(
            f"module '{mod.peft_name}': rank {r} from its tensors, but the config (r / rank_pattern) says {want_r}"
        )
        return None
    mod_alpha = float(_pattern_value(cfg.get("alpha_pattern") or {}, mod.peft_name, lora_alpha))
    peft_scale = mod_alpha / (math.sqrt(r) if rslora else r)
    fold = peft_scale / (alpha / r)
    if not math.isclose(fold, 1.0, rel_tol=1e-6):
        b = b * fold  # this module's PEFT scale differs from alpha / r: fold it into B
    if inputs.arch == "llama" and mod.gguf_name.endswith((".attn_q.weight", ".attn_k.weight")):
        key = "head_count" if ".attn_q." in mod.gguf_name else "head_count_kv"
        n_head = inputs.base_meta.get(f"llama.attention.{key}")
        if not isinstance(n_head, int) or n_head <= 0:
            problems.append(
                f"module '{mod.peft_name}': llama q/k need llama.attention.{key} "
                "from base_gguf for the rope row permutation; pass base_gguf"
            )
            return None
        b = _rope_permute_rows(b, n_head)
    if mod.embedding:
        a = a.T  # (r, V) → (V, r): ne [r, V], llama.cpp's token_embd exception
    return a, b


def _write_adapter(
    tmp: Path, arch: str, alpha: float, name: str, cfg: dict[str, Any], tensors: list[tuple[str, np.ndarray]]
) -> None:
    """Write the adapter GGUF (``general.type`` adapter, ``adapter.lora.alpha``, the aLoRA
    invocation tokens when the config has them) to ``tmp``; removed again on failure."""
    writer = gguf.GGUFWriter(tmp, arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    writer.add_name(name)
    if cfg.get("alora_invocation_tokens"):
        writer.add_key_value(
            gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS,
            [int(t) for t in cfg["alora_invocation_tokens"]],
            gguf.GGUFValueType.ARRAY,
            gguf.GGUFValueType.UINT32,
        )
    for tensor_name, arr in tensors:
        writer.add_tensor(tensor_name, arr)
    write_and_close(writer, tmp)
