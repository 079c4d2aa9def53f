"""Finishing a GGUF file written with ``gguf.GGUFWriter`` (shared by convert-peft and export-lora)."""

from __future__ import annotations

from pathlib import Path

import gguf


def write_and_close(writer: gguf.GGUFWriter, tmp: Path) -> None:
    """Write header, key/values and tensors of ``writer`` (opened on ``tmp``) and close it.

    On any failure the half-written ``tmp`` is removed and the error re-raised, so callers
    that rename ``tmp`` into place on success never leave a truncated GGUF behind.
    """
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    writer.close()
