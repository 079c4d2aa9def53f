"""Synthetic LoRA adapters for the benchmarks, written by the bench itself.

Every adapter is rank ``r`` on all linear weights of the base model (``attn_q``, ``attn_k``,
``attn_v``, ``attn_output``, ``ffn_gate``, ``ffn_up``, ``ffn_down`` of every layer), with
seeded random A/B. Layout (ggml ``ne`` order, fastest dimension first; numpy shapes are ``ne``
reversed), as ``worker.lora.adapter`` validates it: base ``W`` is ``ne [k, d]`` (k inputs, d
outputs), ``A`` is ``ne [k, r]`` = numpy ``(r, k)``, ``B`` is ``ne [r, d]`` = numpy ``(d, r)``.

Values: ``A ~ N(0, 1/k)`` and ``B ~ N(0, 0.02²)``, so ``scale · B(A x)`` with
``scale = alpha / r = 2`` changes the output a little without blowing it up (the benchmark
only needs realistic shapes, but a finite, sane output keeps greedy decoding meaningful).
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np

ATTENTION_WEIGHT = re.compile(r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_output)\.weight$")
LINEAR_WEIGHT = re.compile(r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")
DEFAULT_RANK = 8
DEFAULT_ALPHA = 16.0


def linear_targets(
    base_tensors: dict[str, tuple[int, ...]], *, pattern: re.Pattern[str] = LINEAR_WEIGHT
) -> list[tuple[str, int, int]]:
    """``(name, k, d)`` of every linear weight a synthetic adapter patches, in layer order
    (``pattern``: all linear weights, or ``ATTENTION_WEIGHT``)."""
    out = []
    for name, ne in base_tensors.items():
        if pattern.match(name) and len(ne) == 2:
            out.append((name, int(ne[0]), int(ne[1])))
    if not out:
        raise ValueError("the base model has no attn_*/ffn_* linear weights to patch")
    return out


def write_adapter(
    path: Path,
    *,
    arch: str,
    targets: list[tuple[str, int, int]],
    seed: int,
    rank: int = DEFAULT_RANK,
    alpha: float = DEFAULT_ALPHA,
    name: str = "",
    dtype: type = np.float32,
) -> Path:
    """Write one adapter GGUF (A/B in ``dtype``: F32, or F16 for the paging scenario) at
    ``path``; returns ``path``.

    Args:
        arch: ``general.architecture`` (the base model's).
        targets: ``(base tensor name, k, d)`` from `linear_targets`.
        seed: RNG seed; the same seed always writes the same bytes.
    """
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    writer.add_name(name or path.stem)
    for tname, k, d in targets:
        a = rng.standard_normal((rank, k), dtype=np.float32) / np.float32(np.sqrt(k))
        b = rng.standard_normal((d, rank), dtype=np.float32) * np.float32(0.02)
        writer.add_tensor(f"{tname}.lora_a", a.astype(dtype))
        writer.add_tensor(f"{tname}.lora_b", b.astype(dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class AdapterFactory:
    """Writes (once) and hands out synthetic adapters ``lora-<i>.gguf`` in one directory.

    Adapter ``i`` always has seed ``base_seed + i``, so two runs write identical files; A/B are
    stored in ``dtype`` (F32 by default, F16 for the synthetic models' adapters).
    """

    def __init__(
        self,
        out_dir: Path,
        *,
        arch: str,
        base_tensors: dict[str, tuple[int, ...]],
        base_seed: int,
        rank: int = DEFAULT_RANK,
        alpha: float = DEFAULT_ALPHA,
        dtype: type = np.float32,
    ):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.arch = arch
        self.targets = linear_targets(base_tensors)
        self.base_seed = base_seed
        self.rank = rank
        self.alpha = alpha
        self.dtype = dtype

    @property
    def n_pairs(self) -> int:
        return len(self.targets)

    def path(self, i: int) -> Path:
        p = self.out_dir / f"lora-{i:03d}.gguf"
        if not p.exists():
            tmp = p.with_suffix(".part")
            write_adapter(
                tmp,
                arch=self.arch,
                targets=self.targets,
                seed=self.base_seed + i,
                rank=self.rank,
                alpha=self.alpha,
                name=f"bench-lora-{i}",
                dtype=self.dtype,
            )
            tmp.replace(p)
        return p

    def paths(self, n: int, start: int = 0) -> list[Path]:
        return [self.path(i) for i in range(start, start + n)]
