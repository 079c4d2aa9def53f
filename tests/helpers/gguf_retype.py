"""Rewrite a float GGUF with its 2-D and 3-D tensors in another float type (F32 ↔ F16), or in
block-quantized types (:func:`quantize_gguf`).

Two uses: it made ``tests/fixtures/tiny_moe/tiny-llama-moe-f16.gguf`` from llama.cpp's F32
original (halving the fixture; the goldens still hold, see ``tests/fixtures/README.md``), and
tests whose arithmetic is exact only in F32 (merge math, bit-equal copies) turn the F16 fixture
back into F32 with it. Metadata is copied key by key with its GGUF value type; 1-D tensors
(norms) keep their type, as llama.cpp's converters keep norms in F32.

    python -m tests.helpers.gguf_retype f16 SRC.gguf DST.gguf
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
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

    def convert(data: np.ndarray, _i: int) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
        return data.astype(_DTYPES[outtype]), None

    return _rewrite(src, dst, convert)


def quantize_gguf(src: Path, dst: Path, types: Sequence[gguf.GGMLQuantizationType]) -> Path:
    """Write ``dst``: ``src`` with its tensors of 2 or more dims quantized by gguf-py
    (``gguf.quants.quantize``), the i-th such tensor (file order) to ``types[i % len(types)]``;
    1-D tensors keep their type. The types must be ones gguf-py quantizes (Q4_0, Q4_1, Q5_0,
    Q5_1, Q8_0, BF16, F16, F32) and divide the tensors' row length.

    Returns:
        ``dst``.
    Raises:
        ValueError: a tensor that is not F32/F16 in ``src`` (named).
    """

    def convert(data: np.ndarray, i: int) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
        qtype = types[i % len(types)]
        return gguf.quants.quantize(data.astype(np.float32), qtype), qtype

    return _rewrite(src, dst, convert)


def _rewrite(
    src: Path, dst: Path, convert: Callable[[np.ndarray, int], tuple[np.ndarray, gguf.GGMLQuantizationType | None]]
) -> Path:
    """Copy ``src`` to ``dst`` key by key, each tensor of 2 or more dims (the i-th, file order)
    replaced by ``convert(data, i)`` = (data, raw type or None for a numpy float dtype)."""
    reader = gguf.GGUFReader(src)
    arch_field = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(dst, arch=bytes(arch_field.parts[arch_field.data[0]]).decode("utf-8"))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # written by the writer itself
        value, etype = _field_value(field)
        writer.add_key_value(key, value, field.types[0], sub_type=etype)
    n_mat = 0
    for t in reader.tensors:
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raise ValueError(f"{src}: tensor {t.name!r} is {t.tensor_type.name}, not F32/F16")
        data = np.asarray(t.data)
        if data.ndim < 2:
            writer.add_tensor(t.name, data)
            continue
        data, qtype = convert(data, n_mat)
        n_mat += 1
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit("usage: python -m tests.helpers.gguf_retype f32|f16 SRC.gguf DST.gguf")
    print(retype_gguf(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[1]))
