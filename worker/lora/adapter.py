"""LoRA adapters as device tensors: ``LoraPair`` / ``LoraAdapter`` built from a validated
``loraplane.formats.adapter_file.AdapterFile`` (the rules and shapes are documented there).

Two storages. *In memory* (``load_lora_adapter``): the pairs hold the tensors. *File-backed*
(``open_lora_adapter``, the worker's host tier, ``worker.lora.host_cache``): the file is validated once (every
tensor read, checked, dropped), then the pairs hold ``meta`` tensors (shape and dtype only)
and ``LoraAdapter.tensors()`` re-reads the data from the file when the slot pool pages the
adapter in. The bytes then live in the OS page cache, shared and reclaimable, not in the
worker's heap, so a worker's RSS depends on its slot pool, not on how many adapters it has
validated (llama.cpp keeps model weights in a file mapping for the same reason,
``llama_mmap``). A file that changed on disk since it was validated is refused at re-read.

Mirrors llama.cpp ``llama_adapter_lora_init`` (src/llama-adapter.cpp) and
``llama_adapter_lora::get_scale``; it only loads, it never activates anything (that is the
context's job, see ``worker.lora.plan``). Torch shapes are ggml ``ne`` reversed.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from loraplane.formats.adapter_file import (
    MAX_RANK,
    NODES_PER_LORA_WEIGHT,
    TOKEN_EMBD,
    AdapterError,
    AdapterFile,
    lora_scale,
    read_lora_adapter,
)
from loraplane.formats.gguf.reader import GGUFError, read_gguf, read_tensor


@dataclass(frozen=True, eq=False)
class LoraPair:
    """The A/B matrices that patch one base tensor (torch shapes; see the module table).

    Attributes:
        base_name: the base tensor patched, e.g. ``blk.0.attn_q.weight``.
        lora_a: linear ``(r, k)``; token_embd ``(V, r)``; experts ``(E, r, k)``.
        lora_b: linear ``(d, r)``; token_embd ``(d, r)``; experts ``(E, d, r)``.
    """

    base_name: str
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    @property
    def rank(self) -> int:
        """``r`` = ``B.ne[0]`` = ``lora_b.shape[-1]`` (derived, never stored twice)."""
        return int(self.lora_b.shape[-1])


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's data sits in a validated file: ggml type, ``ne``, absolute offset."""

    ggml_type: int
    ne: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class FileTensors:
    """The tensors of a file-backed adapter: the file, its identity when validated, and the
    A/B location of every pair (base tensor name → (A, B))."""

    path: str
    size: int
    mtime_ns: int
    refs: Mapping[str, tuple[TensorRef, TensorRef]]


# eq=False: identity equality/hash (tensors cannot be compared with ==); content identity
# is ``sha256``.
@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A validated LoRA adapter, tensors on their target devices. Immutable.

    Attributes:
        path: the GGUF file; sha256: hex digest of its bytes (content identity).
        arch: ``general.architecture``; name: ``general.name``, else the file stem.
        alpha: ``adapter.lora.alpha``; 0.0 when absent (no alpha/rank factor).
        pairs: base tensor name → ``LoraPair`` (read-only mapping, file order).
        alora_invocation_tokens: ``adapter.alora.invocation_tokens`` (empty: not an aLoRA).
        task_name / prompt_prefix: ``adapter.lora.task_name`` / ``.prompt_prefix`` or "".
        size_bytes: bytes of all A/B tensors as loaded (dtype and count), i.e. the memory the
            adapter occupies when its tensors are read; not the file size.
        source: for a file-backed adapter (``open_lora_adapter``), where its tensors are;
            its ``pairs`` then hold ``meta`` tensors (use ``tensors()`` for data). None: in memory.
    """

    path: str
    sha256: str
    arch: str
    name: str
    alpha: float
    pairs: Mapping[str, LoraPair]
    alora_invocation_tokens: tuple[int, ...]
    task_name: str
    prompt_prefix: str
    size_bytes: int
    source: FileTensors | None = None

    def tensors(
        self, names: Collection[str] | None = None, *, device_for: Callable[[str], torch.device] | None = None
    ) -> Mapping[str, LoraPair]:
        """Pairs with data (all, or those of ``names``): ``pairs`` itself when in memory, else
        read from the file now (F16 stays F16, F32 stays F32, other types dequantized to f32;
        on ``device_for(base name)``, default CPU). The caller converts while copying.

        Raises:
            AdapterError: the file is gone, changed on disk since it was validated (size or
                modification time), or cannot be read.
        """
        want = self.pairs if names is None else {n: self.pairs[n] for n in names if n in self.pairs}
        src = self.source
        if src is None:
            return want
        try:
            st = os.stat(src.path)
            if (st.st_size, st.st_mtime_ns) != (src.size, src.mtime_ns):
                raise AdapterError(
                    src.path,
                    [
                        f"the file changed on disk since adapter '{self.name}' was validated "
                        f"(size {src.size} -> {st.st_size}); register it again"
                    ],
                )
            out: dict[str, LoraPair] = {}
            with open(src.path, "rb") as fh:
                for name in want:
                    if name not in src.refs:  # a side pair: kept in memory
                        out[name] = self.pairs[name]
                        continue
                    ra, rb = src.refs[name]
                    dev = torch.device(device_for(name)) if device_for is not None else torch.device("cpu")
                    a = _read_ref(fh, src.path, ra).to(dev)
                    b = _read_ref(fh, src.path, rb).to(dev)
                    out[name] = LoraPair(name, a, b)
            return out
        except (OSError, GGUFError) as exc:
            raise AdapterError(src.path, [f"cannot re-read adapter '{self.name}' tensors: {exc}"]) from exc

    @property
    def n_nodes(self) -> int:
        """Graph nodes llama.cpp reserves for this adapter: 6 per patched weight."""
        return NODES_PER_LORA_WEIGHT * len(self.pairs)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Sorted distinct ranks over all pairs."""
        return tuple(sorted({p.rank for p in self.pairs.values()}))

    def scale(self, adapter_scale: float, pair: LoraPair) -> float:
        """Effective scale of ``pair`` at ``adapter_scale`` (see ``lora_scale``)."""
        return lora_scale(adapter_scale, self.alpha, pair.rank)


def load_lora_adapter(
    path: str | os.PathLike[str],
    *,
    base_arch: str,
    base_tensors: Mapping[str, tuple[int, ...]],
    device_for: Callable[[str], torch.device] = lambda name: torch.device("cpu"),
    dtype: torch.dtype = torch.float32,
) -> LoraAdapter:
    """Load and validate an adapter GGUF against a base model (llama_adapter_lora_init).

    Args:
        path: the adapter GGUF.
        base_arch: the base model's ``general.architecture``.
        base_tensors: base tensor name → ggml ``ne`` (e.g. from ``base_tensor_index``).
        device_for: device of the base tensor a pair patches; A and B go there.
        dtype: torch dtype the A/B tensors are converted to.

    Returns:
        The adapter, pairs keyed by base tensor name.

    Raises:
        AdapterError: listing every problem found (``loraplane.formats.adapter_file`` rules).
    """
    return adapter_from_file(
        read_lora_adapter(path, base_arch=base_arch, base_tensors=base_tensors), device_for=device_for, dtype=dtype
    )


def _read_ref(fh, path: str, ref: TensorRef) -> torch.Tensor:
    return torch.from_numpy(read_tensor(fh, path, GGMLQuantizationType(ref.ggml_type), ref.ne, ref.offset))


def is_pooled(name: str, pair: LoraPair) -> bool:
    """True for plain 2-D matmul branches (the slot pool's); token_embd and 3-D expert
    branches are side branches, kept per slot (``worker.lora.pool.SideBranch``)."""
    return name != TOKEN_EMBD and pair.lora_a.dim() == 2


def open_lora_adapter(
    path: str | os.PathLike[str],
    *,
    base_arch: str,
    base_tensors: Mapping[str, tuple[int, ...]],
    device_for: Callable[[str], torch.device] = lambda name: torch.device("cpu"),
) -> LoraAdapter:
    """Validate an adapter GGUF like ``load_lora_adapter`` and return it *file-backed*: its
    pooled pairs (2-D matmul branches) hold ``meta`` tensors of the storage shape and dtype
    (F16 for F16 data, else f32) and ``LoraAdapter.tensors()`` reads them when the pool pages
    the adapter in (see the module docstring). Side pairs (token_embd, experts) are kept in
    memory in the storage dtype on ``device_for(base name)``: the side fusion reads them at
    every pool generation.

    Raises:
        AdapterError: listing every problem found (``loraplane.formats.adapter_file`` rules).
    """
    st = os.stat(path)
    af = read_lora_adapter(path, base_arch=base_arch, base_tensors=base_tensors)
    gf = read_gguf(path)  # the index again (offsets); parsing is cheap, the data is not touched
    refs: dict[str, tuple[TensorRef, TensorRef]] = {}
    pairs: dict[str, LoraPair] = {}
    size = 0
    for base in af.pairs:
        ra, rb = gf.tensors[base + ".lora_a"], gf.tensors[base + ".lora_b"]
        ab = []
        for rec in (ra, rb):
            dt = torch.float16 if rec.ggml_type == GGMLQuantizationType.F16 else torch.float32
            ab.append(torch.empty(rec.shape, dtype=dt, device="meta"))
            size += ab[-1].numel() * ab[-1].element_size()
        pair = LoraPair(base, ab[0], ab[1])
        if is_pooled(base, pair):
            pairs[base] = pair
            refs[base] = tuple(TensorRef(int(r.ggml_type), r.ne, r.offset) for r in (ra, rb))  # type: ignore[assignment]
        else:
            dev = torch.device(device_for(base))
            a_np, b_np = af.pairs[base]
            a_t = torch.from_numpy(a_np).to(dtype=ab[0].dtype, device=dev)
            pairs[base] = LoraPair(base, a_t, torch.from_numpy(b_np).to(dtype=ab[1].dtype, device=dev))
    sha, arch, name, alpha = af.sha256, af.arch, af.name, af.alpha
    tokens, task_name, prompt_prefix = af.alora_invocation_tokens, af.task_name, af.prompt_prefix
    del gf, af  # drop the mapping and the validation copies
    st2 = os.stat(path)
    if (st.st_size, st.st_mtime_ns) != (st2.st_size, st2.st_mtime_ns):
        raise AdapterError(str(path), ["the file changed on disk while it was being validated"])
    return LoraAdapter(
        path=str(path),
        sha256=sha,
        arch=arch,
        name=name,
        alpha=alpha,
        pairs=types.MappingProxyType(pairs),
        alora_invocation_tokens=tokens,
        task_name=task_name,
        prompt_prefix=prompt_prefix,
        size_bytes=size,
        source=FileTensors(str(path), st.st_size, st.st_mtime_ns, types.MappingProxyType(refs)),
    )


def adapter_from_file(
    af: AdapterFile,
    *,
    device_for: Callable[[str], torch.device] = lambda name: torch.device("cpu"),
    dtype: torch.dtype = torch.float32,
) -> LoraAdapter:
    """``LoraAdapter`` with ``af``'s A/B as ``dtype`` tensors on ``device_for(base name)``."""
    pairs: dict[str, LoraPair] = {}
    size = 0
    for base, (a_np, b_np) in af.pairs.items():
        dev = torch.device(device_for(base))
        a = torch.from_numpy(a_np).to(dtype=dtype, device=dev)
        b = torch.from_numpy(b_np).to(dtype=dtype, device=dev)
        pairs[base] = LoraPair(base, a, b)
        size += a.numel() * a.element_size() + b.numel() * b.element_size()
    return LoraAdapter(
        path=af.path,
        sha256=af.sha256,
        arch=af.arch,
        name=af.name,
        alpha=af.alpha,
        pairs=types.MappingProxyType(pairs),
        alora_invocation_tokens=af.alora_invocation_tokens,
        task_name=af.task_name,
        prompt_prefix=af.prompt_prefix,
        size_bytes=size,
    )


__all__ = [
    "MAX_RANK",
    "NODES_PER_LORA_WEIGHT",
    "TOKEN_EMBD",
    "FileTensors",
    "LoraAdapter",
    "LoraPair",
    "TensorRef",
    "adapter_from_file",
    "is_pooled",
    "load_lora_adapter",
    "open_lora_adapter",
]
