"""PEFT folders on the client side: ``adapters add PEFT_DIR`` converts before uploading.

Where conversion runs: the folder is read where it lies. An upload names a folder
on the client's machine, so the client converts it here — the same numpy-only
``loraplane.formats.convert_peft`` that the ``convert-peft`` command runs, without a base model, so
the bytes (and the content hash) equal ``convert-peft PEFT_DIR -o X.gguf`` — and uploads the
GGUF with ``source_format="peft"``. The control plane validates those bytes against its base
model like any upload, so nothing unchecked gets in, and the upload stays one GGUF stream that
clients in other languages already speak. A server-side path (``--server-path``, ``--lora``) is
converted by the control plane instead (``control_plane.registry``), against the base model
it holds, which also covers llama q/k (their row permutation needs the base's head counts).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PEFT_CONFIG = "adapter_config.json"


def is_peft_folder(path: str | os.PathLike[str]) -> bool:
    """True for a folder holding ``adapter_config.json``."""
    p = Path(path)
    return p.is_dir() and (p / PEFT_CONFIG).is_file()


def adapter_source_problem(path: str | os.PathLike[str], *, peft: bool = True) -> str | None:
    """What is wrong with ``path`` as an adapter to read (a GGUF file, or with ``peft`` a PEFT
    folder), or None when nothing is: it does not exist, it is a folder (without
    ``adapter_config.json``, or any folder where ``peft`` is False), or it is no regular file
    (a device, a socket). The message names the path and says what was expected."""
    p = Path(path)
    expected = "an adapter .gguf file or a PEFT folder holding adapter_config.json" if peft else "an adapter .gguf file"
    if p.is_dir():
        if peft and is_peft_folder(p):
            return None
        missing = f", without {PEFT_CONFIG}" if peft else ""
        return f"{str(path)!r} is a directory{missing}: expected {expected}"
    if p.is_file():
        return None
    if p.exists():
        return f"{str(path)!r} is not a regular file: expected {expected}"
    return f"{str(path)!r} does not exist: expected {expected}"


@contextmanager
def upload_source(path: str | os.PathLike[str], *, progress=None) -> Iterator[tuple[Path, str]]:
    """``(GGUF file to upload, source format)`` for ``path``: the file itself ("gguf"), or a
    temporary GGUF converted from a PEFT folder ("peft"), removed afterwards.

    Raises:
        loraplane.formats.convert_peft.ConvertError: the folder cannot be converted (a ValueError
            listing every problem; a llama adapter needs the base model: register it with
            ``--server-path`` so the control plane converts it).
    """
    if not is_peft_folder(path):
        yield Path(path), "gguf"
        return
    from loraplane.formats.convert_peft import convert_peft  # numpy only; imported when needed

    with tempfile.TemporaryDirectory(prefix="loraplane-peft-") as tmp:
        folder = Path(path).resolve()
        out = Path(tmp) / f"{folder.name}.gguf"
        convert_peft(folder, out, name=folder.name, progress=progress)
        yield out, "peft"
