"""Merge LoRA adapters into a base model GGUF (our ``llama-export-lora``).

`export_lora` dequantizes every base tensor some adapter patches to f32, adds each adapter's
scaled delta (`_delta`), and writes it in one of `OUTTYPES`; every other tensor and all base
metadata are copied. With a tied LM head and an embedding LoRA the unpatched ``token_embd`` is
also written as `OUTPUT`, as PEFT serves it. Bad inputs raise `ExportError`.

The deltas, the output types and the tied-output rule: docs/operations.md, "Merging adapters:
``export-lora``".
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from loraplane.formats.adapter_file import TOKEN_EMBD
from loraplane.formats.gguf.reader import GGUFError, TensorRecord, dequantize
from loraplane.formats.gguf.writer import write_and_close
from worker.lora.adapter import LoraAdapter, LoraPair, load_lora_adapter

OUTTYPES = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16, "q8_0": GGMLQuantizationType.Q8_0}
OUTPUT = "output.weight"
# keys the writer sets itself or that describe the old file's layout
_SKIP_KEYS = {"general.architecture", "general.alignment", "general.type"}


class ExportError(ValueError):
    """The merge cannot be done (bad arguments or unreadable base); names the file at fault."""


def _copy_metadata(reader: GGUFReader, writer: gguf.GGUFWriter) -> None:
    """Copy every key/value of the base with its exact GGUF type."""
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in _SKIP_KEYS:
            continue
        main = GGUFValueType(field.types[0])
        if main == GGUFValueType.ARRAY:
            if len(field.types) != 2:
                raise ExportError(f"{reader.data.filename}: nested array key '{key}' is not supported")
            sub = GGUFValueType(field.types[1])
            if not field.data:
                continue  # the writer cannot write an empty array
            if sub == GGUFValueType.STRING:
                value = [bytes(field.parts[i]) for i in field.data]  # raw bytes: no re-encoding
            else:
                value = field.contents()
            writer.add_key_value(key, value, main, sub)
        elif main == GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[field.data[0]]), main)
        else:
            writer.add_key_value(key, field.contents(), main)
    if "general.alignment" in reader.fields:
        writer.add_custom_alignment(int(reader.fields["general.alignment"].contents()))
    writer.add_type(gguf.GGUFType.MODEL)


def _delta(base_name: str, pair: LoraPair) -> torch.Tensor:
    """``B·A`` laid out like the base tensor (torch shape), f32, unscaled."""
    a, b = pair.lora_a.float(), pair.lora_b.float()
    if base_name.endswith(TOKEN_EMBD):
        return a @ b.T  # (V, r) @ (r, d) → (V, d)
    return b @ a  # (d, r) @ (r, k), batched over experts for 3-D


def _encode(w: np.ndarray, outtype: str) -> tuple[np.ndarray, GGMLQuantizationType]:
    qtype = OUTTYPES[outtype]
    if qtype == GGMLQuantizationType.F16:
        return w.astype(np.float16), qtype
    if qtype == GGMLQuantizationType.Q8_0 and w.ndim >= 2 and w.shape[-1] % 32 == 0:
        return gguf.quants.quantize(w, qtype), qtype
    return w.astype(np.float32), GGMLQuantizationType.F32


def _records(reader: GGUFReader) -> dict[str, TensorRecord]:
    return {
        t.name: TensorRecord(
            t.name, GGMLQuantizationType(t.tensor_type), tuple(int(n) for n in t.shape.tolist()), t.data
        )
        for t in reader.tensors
    }


def export_lora(
    base_gguf: str | os.PathLike[str],
    adapters: Sequence[tuple[str | os.PathLike[str], float]],
    out_path: str | os.PathLike[str],
    *,
    outtype: str = "f32",
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write ``base + Σ scale_eff · delta`` for every adapter as a new model GGUF.

    Args:
        base_gguf: the base model.
        adapters: ``(adapter GGUF, adapter_scale)`` pairs; each is validated against the base
            with ``load_lora_adapter``. Scale 0 adapters are validated and skipped.
        out_path: model GGUF to write (replaced atomically on success).
        outtype: ``f32``, ``f16`` or ``q8_0`` for patched tensors.
        progress: called as ``progress(done, total)`` after each base tensor is written.

    Returns:
        ``out_path`` as a Path.

    Raises:
        AdapterError: an adapter does not fit the base (every problem listed).
        ExportError / GGUFError: bad outtype, unreadable base.
    """
    if outtype not in OUTTYPES:
        raise ExportError(f"outtype: expected one of {', '.join(OUTTYPES)}, found {outtype!r}")
    base_path = Path(base_gguf)
    out = Path(out_path)
    try:
        reader = GGUFReader(base_path, "r")
    except Exception as exc:  # the reader raises bare ValueError/IndexError on bad files
        raise GGUFError(f"{base_path}: cannot read base model ({type(exc).__name__}: {exc})") from exc
    arch = str(reader.fields["general.architecture"].contents()) if "general.architecture" in reader.fields else ""
    records = _records(reader)
    index = {name: rec.ne for name, rec in records.items()}

    loaded: list[tuple[LoraAdapter, float]] = []
    for path, scale in adapters:
        adapter = load_lora_adapter(path, base_arch=arch, base_tensors=index)
        if float(scale) != 0.0:
            loaded.append((adapter, float(scale)))
    patches: dict[str, list[tuple[LoraPair, float]]] = {}
    for adapter, scale in loaded:
        for name, pair in adapter.pairs.items():
            patches.setdefault(name, []).append((pair, adapter.scale(scale, pair)))
    untie = OUTPUT not in records and TOKEN_EMBD in patches

    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    _copy_metadata(reader, writer)
    for done, (name, rec) in enumerate(records.items(), 1):
        if progress is not None:
            progress(done, len(records))
        if name in patches:
            w = torch.from_numpy(np.array(dequantize(base_path, rec), dtype=np.float32, copy=True))
            for pair, s in patches[name]:
                w.add_(_delta(name, pair), alpha=s)
            data, qtype = _encode(w.numpy(), outtype)
            writer.add_tensor(name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(name, rec.raw, raw_dtype=rec.ggml_type)
        if untie and name == TOKEN_EMBD:
            writer.add_tensor(OUTPUT, rec.raw, raw_dtype=rec.ggml_type)  # the unpatched lm_head
    write_and_close(writer, tmp)
    os.replace(tmp, out)
    return out
