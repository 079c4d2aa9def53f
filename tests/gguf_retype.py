"""Rewrite a float GGUF with its 2-D and 3-D tensors in another float type (F32 ↔ F16).

Two uses: it made ``tests/fixtures/tiny_moe/tiny-llama-moe-f16.gguf`` from llama.cpp's F32
original (halving the fixture; the goldens still hold, see ``tests/fixtures/README.md``), and
tests whose arithmetic is exact only in F32 (merge math, bit-equal copies) turn the F16 fixture
back into F32 with it. Metadata is copied key by key with its GGUF value type; 1-D tensors
(norms) keep their type, as llama.cpp's converters keep norms in F32.

    python -m tests.gguf_retype f16 SRC.gguf DST.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

_DTYPES = {"f32": np.float32, "f16": np.float16}


def _field_value(field: gguf.ReaderField) -> tuple[object, gguf.GGUFValueType | None]:
    """``(value, array element type or None)`` of one reader field, ready for ``add_key_value``."""
    vtype = field.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        etype = field.types[1]
        if etype == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data], etype
        return [field.parts[i][0].item() for i in field.data], etype
    if vtype == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8"), None
    return field.parts[field.data[0]][0].item(), None


def retype_gguf(src: Path, dst: Path, outtype: str) -> Path:
    """Write ``dst``: ``src`` with every float tensor of 2 or more dims stored as ``outtype``.

    Args:
        src: a GGUF whose matrices are F32 or F16 (quantized types are refused).
        dst: the file to write (overwritten).
        outtype: ``"f32"`` or ``"f16"``.

    Returns:
        ``dst``.

    Raises:
        ValueError: an unknown ``outtype`` or a tensor that is not F32/F16 (named).
    """
    if outtype not in _DTYPES:
        raise ValueError(f"outtype {outtype!r}: expected one of {sorted(_DTYPES)}")
    reader = gguf.GGUFReader(src)
    arch_field = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(dst, arch=bytes(arch_field.parts[arch_field.data[0]]).decode("utf-8"))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # written by the writer itself
        value, etype = _field_value(field)
        writer.add_key_value(key, value, field.types[0], sub_type=etype)
    for t in reader.tensors:
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raise ValueError(f"{src}: tensor {t.name!r} is {t.tensor_type.name}, not F32/F16")
        data = np.asarray(t.data)
        if data.ndim >= 2:
            data = data.astype(_DTYPES[outtype])
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: python -m tests.gguf_retype f32|f16 SRC.gguf DST.gguf")
    print(retype_gguf(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[1]))
