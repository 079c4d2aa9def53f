"""Read and validate a LoRA adapter GGUF (numpy only: both planes use it; no torch).

`read_lora_adapter` checks a file against a base model's tensors and returns an `AdapterFile`
(the pairs, rank, alpha, architecture), or raises one `AdapterError` listing every problem; it
only loads, never activates (that is ``worker.lora.plan``'s job). Mirrors llama.cpp
``llama_adapter_lora_init`` (src/llama-adapter.cpp); the shapes (ggml ``ne`` order in every
message) and the rules: docs/formats.md, "Adapter files".
"""

from __future__ import annotations

import math
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loraplane.formats.gguf.reader import (
    FLOAT_TYPES,
    SUPPORTED_QUANT_TYPES,
    GGUFError,
    GGUFFile,
    TensorRecord,
    dequantize,
    file_sha256,
    read_gguf,
)

MAX_RANK = 512  # largest rank we accept (vLLM's max_lora_rank default range tops out here)
NODES_PER_LORA_WEIGHT = 6  # llama.cpp graph_max_nodes reserves 6 nodes per lora tensor
TOKEN_EMBD = "token_embd.weight"
_SUFFIX_A = ".lora_a"
_SUFFIX_B = ".lora_b"
_SKIPPED_ENDING = "_norm.weight"

KEY_GENERAL_TYPE = "general.type"
KEY_ARCH = "general.architecture"
KEY_NAME = "general.name"
KEY_ADAPTER_TYPE = "adapter.type"
KEY_ALPHA = "adapter.lora.alpha"
KEY_TASK_NAME = "adapter.lora.task_name"
KEY_PROMPT_PREFIX = "adapter.lora.prompt_prefix"
KEY_INVOCATION = "adapter.alora.invocation_tokens"


class AdapterError(ValueError):
    """An adapter file cannot be used with this base model.

    Attributes:
        path: the adapter file.
        problems: every problem found, each naming the key or tensor at fault and giving
            expected vs found values (shapes in ggml ``ne`` order).
    """

    def __init__(self, path: str | os.PathLike[str], problems: list[str]):
        self.path = str(path)
        self.problems = list(problems)
        super().__init__(self.path, self.problems)

    def __str__(self) -> str:
        n = len(self.problems)
        head = f"{self.path}: LoRA adapter rejected ({n} problem{'s' if n != 1 else ''})"
        return head + "".join(f"\n  - {p}" for p in self.problems)


def lora_scale(adapter_scale: float, alpha: float, rank: int) -> float:
    """Effective multiplier of one pair's ``B @ A`` product.

    ``scale = adapter_scale * alpha / rank`` when ``alpha != 0``, else ``adapter_scale``
    (llama.cpp ``llama_adapter_lora::get_scale``; alpha 0 means the file has no alpha).
    ``rank`` is ``B.ne[0]`` of that pair.
    """
    if alpha != 0.0:
        return float(adapter_scale) * float(alpha) / float(rank)
    return float(adapter_scale)


@dataclass(frozen=True, eq=False)
class AdapterFile:
    """A validated adapter file, its A/B tensors as f32 numpy arrays (torch order). Immutable.

    What the control plane validates a registration with and what ``worker.lora.adapter``
    turns into device tensors. Shapes per pair (torch order, see the module table): linear
    A ``(r, k)`` / B ``(d, r)``; token_embd A ``(V, r)`` / B ``(d, r)``; experts A
    ``(E, r, k)`` / B ``(E, d, r)``.

    Attributes:
        path / sha256 / arch / name / alpha / alora_invocation_tokens / task_name /
        prompt_prefix: as ``worker.lora.adapter.LoraAdapter``.
        pairs: base tensor name → (A, B) f32 arrays, file order.
    """

    path: str
    sha256: str
    arch: str
    name: str
    alpha: float
    pairs: Mapping[str, tuple[np.ndarray, np.ndarray]]
    alora_invocation_tokens: tuple[int, ...]
    task_name: str
    prompt_prefix: str

    @property
    def n_nodes(self) -> int:
        """Graph nodes llama.cpp reserves for this adapter: 6 per patched weight."""
        return NODES_PER_LORA_WEIGHT * len(self.pairs)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Sorted distinct ranks (``B.ne[0]``) over all pairs."""
        return tuple(sorted({int(b.shape[-1]) for _, b in self.pairs.values()}))

    @property
    def size_bytes(self) -> int:
        """Bytes of all A/B tensors in f32."""
        return sum(a.nbytes + b.nbytes for a, b in self.pairs.values())


def read_adapter_gguf(path: str | os.PathLike[str]) -> tuple[GGUFFile, str]:
    """Parse an adapter file and hash its bytes.

    Returns:
        (the parsed GGUF, sha256 hex digest of the file).

    Raises:
        AdapterError: missing file, not a GGUF, truncated or corrupt (wraps ``GGUFError``).
    """
    try:
        gf = read_gguf(path)
    except GGUFError as exc:
        raise AdapterError(path, [f"cannot read the file as GGUF: {exc}"]) from exc
    return gf, file_sha256(path)


def base_tensor_index(base_gguf: str | os.PathLike[str]) -> tuple[str, dict[str, tuple[int, ...]]]:
    """``(general.architecture, {tensor name: ne})`` of a base model, without loading weights.

    This is what ``read_lora_adapter`` needs; the control plane can call it on a model
    path. Raises ``GGUFError`` when the file cannot be read.
    """
    gf = read_gguf(base_gguf)
    return gf.arch, {name: tuple(rec.ne) for name, rec in gf.tensors.items()}


def _ne(ne: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(int(n)) for n in ne) + "]"


def _check_metadata(meta: dict[str, Any], base_arch: str, problems: list[str]) -> None:
    gtype = meta.get(KEY_GENERAL_TYPE)
    if gtype != "adapter":
        found = "missing" if gtype is None else f"'{gtype}'"
        problems.append(
            f"{KEY_GENERAL_TYPE}: expected 'adapter', found {found}"
            + (" (this looks like a model file, not an adapter)" if gtype == "model" else "")
        )
    arch = meta.get(KEY_ARCH)
    if arch != base_arch:
        found = "missing" if arch is None else f"'{arch}'"
        problems.append(
            f"{KEY_ARCH}: expected '{base_arch}' (the base model's), found {found} (hint: wrong base model?)"
        )
    atype = meta.get(KEY_ADAPTER_TYPE)
    if atype != "lora":
        found = "missing" if atype is None else f"'{atype}'"
        problems.append(f"{KEY_ADAPTER_TYPE}: expected 'lora', found {found}")


def _read_alpha(meta: dict[str, Any], problems: list[str]) -> float:
    raw = meta.get(KEY_ALPHA)
    if raw is None:
        return 0.0
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
        problems.append(f"{KEY_ALPHA}: expected a finite float, found {raw!r}")
        return 0.0
    return float(raw)


def _read_tokens(meta: dict[str, Any], problems: list[str]) -> tuple[int, ...]:
    raw = meta.get(KEY_INVOCATION)
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in raw
    ):
        problems.append(f"{KEY_INVOCATION}: expected an array of uint32 token ids, found {raw!r}")
        return ()
    return tuple(int(t) for t in raw)


def _read_str(meta: dict[str, Any], key: str, problems: list[str]) -> str:
    raw = meta.get(key)
    if raw is None:
        return ""
    if not isinstance(raw, str):
        problems.append(f"{key}: expected a string, found {raw!r}")
        return ""
    return raw


def _pair_tensors(tensors: Mapping[str, TensorRecord], problems: list[str]) -> dict[str, list[TensorRecord | None]]:
    """Group tensors into ``base name → [A record, B record]`` (llama.cpp ``ab_map``)."""
    halves: dict[str, list[TensorRecord | None]] = {}
    for name, rec in tensors.items():
        if name.endswith(_SUFFIX_A):
            base, slot = name[: -len(_SUFFIX_A)], 0
        elif name.endswith(_SUFFIX_B):
            base, slot = name[: -len(_SUFFIX_B)], 1
        elif name.endswith(_SKIPPED_ENDING):
            continue  # norm vectors (mergekit-extract-lora): not applied, like llama.cpp
        else:
            problems.append(
                f"tensor '{name}': unexpected suffix (expected '{_SUFFIX_A}' or "
                f"'{_SUFFIX_B}', or a name ending '{_SKIPPED_ENDING}')"
            )
            continue
        if base.endswith(_SKIPPED_ENDING):
            continue  # a low-rank pair on a norm vector: skipped like the bare norm
        halves.setdefault(base, [None, None])[slot] = rec
    return halves


def _check_pair_shapes(base: str, a_ne: tuple[int, ...], b_ne: tuple[int, ...], w_ne: tuple[int, ...]) -> list[str]:
    """Shape problems of one pair against its base tensor (empty list: fine)."""
    an, bn = f"'{base}{_SUFFIX_A}'", f"'{base}{_SUFFIX_B}'"
    where = f"base '{base}' is ne {_ne(w_ne)}"
    if base.endswith(TOKEN_EMBD):
        layout = "token_embd"
        if len(w_ne) != 2 or len(a_ne) != 2 or len(b_ne) != 2:
            return [
                f"pair '{base}': expected 2-D W [d, V], A [r, V], B [r, d]; found W "
                f"{_ne(w_ne)}, A {_ne(a_ne)}, B {_ne(b_ne)}"
            ]
        d, n_vocab = w_ne
        r = b_ne[0]
        want_a, want_b = (r, n_vocab), (r, d)
    elif len(w_ne) in (2, 3):
        layout = "linear" if len(w_ne) == 2 else "expert"
        if len(a_ne) != len(w_ne) or len(b_ne) != len(w_ne):
            dims = "[k, r], B [r, d]" if len(w_ne) == 2 else "[k, r, E], B [r, d, E]"
            return [
                f"pair '{base}': {where}, so A must be {dims}; found A {_ne(a_ne)}, "
                f"B {_ne(b_ne)} (wrong number of dimensions)"
            ]
        k, d = w_ne[0], w_ne[1]
        r = b_ne[0]
        want_a, want_b = (k, r, *w_ne[2:]), (r, d, *w_ne[2:])  # type: ignore[assignment]
    else:
        return [f"pair '{base}': {where}; only 2-D (linear, token_embd) and 3-D (expert) tensors can carry a LoRA pair"]

    out: list[str] = []
    if r <= 0:
        out.append(f"{bn}: rank B.ne[0] = {r}, expected > 0")
    elif r > MAX_RANK:
        out.append(f"{bn}: rank {r} exceeds max_rank {MAX_RANK}")
    if tuple(b_ne) != want_b:
        out.append(
            f"{bn}: expected ne {_ne(want_b)} ({layout} layout [r, d{', E' if layout == 'expert' else ''}]), "
            f"found {_ne(b_ne)}; {where}; hint: wrong base model?"
        )
    if tuple(a_ne) != want_a:
        if layout == "token_embd":
            if tuple(a_ne) == (n_vocab, r):
                hint = "A is stored like a linear A; token_embd's A must be [r, V] (re-convert)"
            else:
                hint = "hint: wrong base model?"
        elif a_ne[1] != b_ne[0]:
            hint = (
                f"A.ne[1] = {a_ne[1]} != B.ne[0] = {b_ne[0]}: lora_a appears not transposed "
                "(old exporter format; re-convert the adapter)"
            )
        else:
            hint = "hint: wrong base model?"
        out.append(f"{an}: expected ne {_ne(want_a)}, found {_ne(a_ne)}; {where}; {hint}")
    return out


def _check_type(rec: TensorRecord) -> list[str]:
    if rec.ggml_type in FLOAT_TYPES or rec.ggml_type in SUPPORTED_QUANT_TYPES:
        return []
    return [
        f"tensor '{rec.name}': type {rec.ggml_type.name} is not supported (expected F32, F16 "
        "or BF16, or a block type we can dequantize; re-convert with outtype f32/f16)"
    ]


def _to_array(path: str, rec: TensorRecord, problems: list[str]) -> np.ndarray | None:
    """Tensor ``rec`` as an f32 array (shape = reversed ne), copied out of the file mapping."""
    try:
        arr = dequantize(path, rec)
    except GGUFError as exc:
        problems.append(f"tensor '{rec.name}': {exc}")
        return None
    t = np.array(arr, dtype=np.float32, copy=True)
    finite = np.isfinite(t)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        problems.append(f"tensor '{rec.name}': {bad} NaN/Inf value(s) (type {rec.ggml_type.name})")
        return None
    return t


def read_lora_adapter(
    path: str | os.PathLike[str],
    *,
    base_arch: str,
    base_tensors: Mapping[str, tuple[int, ...]],
) -> AdapterFile:
    """Read and validate an adapter GGUF against a base model (llama_adapter_lora_init).

    Args:
        path: the adapter GGUF.
        base_arch: the base model's ``general.architecture``.
        base_tensors: base tensor name → ggml ``ne`` (e.g. from ``base_tensor_index``).

    Returns:
        The adapter, pairs keyed by base tensor name.

    Raises:
        AdapterError: listing every problem found (see the module docstring for the rules).
    """
    spath = str(path)
    gf, sha = read_adapter_gguf(path)
    meta = gf.metadata
    problems: list[str] = []
    _check_metadata(meta, base_arch, problems)
    alpha = _read_alpha(meta, problems)
    tokens = _read_tokens(meta, problems)
    task_name = _read_str(meta, KEY_TASK_NAME, problems)
    prompt_prefix = _read_str(meta, KEY_PROMPT_PREFIX, problems)
    name = _read_str(meta, KEY_NAME, problems) or Path(spath).stem

    ready: list[tuple[str, TensorRecord, TensorRecord]] = []
    for base, (rec_a, rec_b) in _pair_tensors(gf.tensors, problems).items():
        if rec_a is None or rec_b is None:
            have, miss = (rec_a, _SUFFIX_B) if rec_b is None else (rec_b, _SUFFIX_A)
            only = have.name if have is not None else "neither"
            problems.append(f"pair '{base}': missing '{base}{miss}' (found only '{only}')")
            continue
        if base not in base_tensors:
            problems.append(
                f"pair '{base}': base tensor '{base}' does not exist in the base model "
                f"(arch '{base_arch}', {len(base_tensors)} tensors; hint: wrong base model?)"
            )
            continue
        w_ne = tuple(int(n) for n in base_tensors[base])
        found = _check_pair_shapes(base, rec_a.ne, rec_b.ne, w_ne)
        found += _check_type(rec_a) + _check_type(rec_b)
        problems += found
        if not found:
            ready.append((base, rec_a, rec_b))
    if problems:
        raise AdapterError(spath, problems)

    pairs: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for base, rec_a, rec_b in ready:
        a = _to_array(spath, rec_a, problems)
        b = _to_array(spath, rec_b, problems)
        if a is not None and b is not None:
            pairs[base] = (a, b)
    if problems:
        raise AdapterError(spath, problems)

    return AdapterFile(
        path=spath,
        sha256=sha,
        arch=str(meta.get(KEY_ARCH)),
        name=name,
        alpha=alpha,
        pairs=types.MappingProxyType(pairs),
        alora_invocation_tokens=tokens,
        task_name=task_name,
        prompt_prefix=prompt_prefix,
    )
