"""Random-weight GGUF models of real shapes, and matching LoRA adapters, written by the bench
itself (no downloads): what ``loraplane bench --synthetic`` and ``scripts/gpu_check.sh`` run on.

``python -m bench.synthetic qwen2.5-1.5b -o PATH [--tiny] [--dtype f16|bf16|q8_0]``:
`write_model` streams a `SyntheticShape` of `SHAPES` (qwen2.5-1.5b, llama-3-8b; ``--tiny``
shrinks one for a CPU) to a GGUF, tensor by tensor (`tensor_plan`, `tensor_values`,
deterministic from the seed), with a made-up BPE vocabulary (`bench.synthetic_vocab`);
`adapter_factory` writes rank-16 adapters on every linear weight; `ensure_model` caches a model
and its adapters under `cache_root` once.

The shapes, the weight distribution, streaming and the adapters: ``bench/README.md``, "Details
per tool".
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from bench.synth import AdapterFactory
from bench.synthetic_vocab import FAMILIES, add_tokenizer

FORMAT_VERSION = 1
"""Part of every cached file name: a change to what the generator writes must bump it."""
DTYPES = ("f16", "bf16", "q8_0")
DEFAULT_RANK = 16
GGML = gguf.GGMLQuantizationType
_FILE_TYPE = {"f16": 1, "q8_0": 7, "bf16": 32}  # general.file_type (llama_ftype MOSTLY_*)
_MANTISSA_RMS = math.sqrt(7.0 / 3.0)  # RMS of a uniform magnitude on [1, 2)
_Q8_RMS = 73.9  # RMS of a uniform int8 on [-128, 127]


@dataclass(frozen=True)
class Dims:
    """The sizes that differ between a shape and its ``--tiny`` variant."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int


@dataclass(frozen=True)
class SyntheticShape:
    """A real model's architecture and sizes.

    Attributes:
        name: the CLI name (``qwen2.5-1.5b``).
        arch: ``general.architecture`` (selects the worker's forward pass).
        dims / tiny: full sizes and the ``--tiny`` ones.
        tied: no ``output.weight`` (the LM head is ``token_embd``).
        qkv_bias: ``attn_{q,k,v}.bias`` tensors (Qwen 2).
        rope_theta / eps / n_ctx_train: ``rope.freq_base``, ``attention.layer_norm_rms_epsilon``,
            ``context_length``.
        vocab: the tokenizer family (`bench.synthetic_vocab.FAMILIES`).
    """

    name: str
    arch: str
    dims: Dims
    tiny: Dims
    tied: bool
    qkv_bias: bool
    rope_theta: float
    eps: float
    n_ctx_train: int
    vocab: str


SHAPES = {
    s.name: s
    for s in (
        SyntheticShape(
            "qwen2.5-1.5b",
            "qwen2",
            Dims(n_layer=28, n_embd=1536, n_head=12, n_head_kv=2, head_dim=128, n_ff=8960, n_vocab=151936),
            Dims(n_layer=2, n_embd=96, n_head=6, n_head_kv=1, head_dim=16, n_ff=256, n_vocab=4096),
            tied=True,
            qkv_bias=True,
            rope_theta=1e6,
            eps=1e-6,
            n_ctx_train=32768,
            vocab="qwen2",
        ),
        SyntheticShape(
            "llama-3-8b",
            "llama",
            Dims(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_ff=14336, n_vocab=128256),
            Dims(n_layer=2, n_embd=64, n_head=4, n_head_kv=1, head_dim=16, n_ff=224, n_vocab=4096),
            tied=False,
            qkv_bias=False,
            rope_theta=5e5,
            eps=1e-5,
            n_ctx_train=8192,
            vocab="llama3",
        ),
    )
}


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: name, torch-order shape (ggml ``ne`` reversed), kind and std.

    ``kind``: ``"matrix"`` (the ``--dtype`` type), ``"norm"`` or ``"bias"`` (F32).
    """

    name: str
    shape: tuple[int, ...]
    kind: str
    std: float = 0.0

    @property
    def ne(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))


def tensor_plan(shape: SyntheticShape, dims: Dims) -> list[TensorPlan]:
    """Every tensor of the model in file order (the tensor set llama.cpp's converter writes for
    the arch: embedding, per layer attention then FFN, output norm, untied head)."""
    d, q, kv = dims.n_embd, dims.n_head * dims.head_dim, dims.n_head_kv * dims.head_dim
    head_std = 3.0 / math.sqrt(d)
    out = [TensorPlan("token_embd.weight", (dims.n_vocab, d), "matrix", head_std)]
    for il in range(dims.n_layer):
        b = f"blk.{il}."
        out += [
            TensorPlan(b + "attn_norm.weight", (d,), "norm"),
            TensorPlan(b + "attn_q.weight", (q, d), "matrix", 1 / math.sqrt(d)),
            TensorPlan(b + "attn_k.weight", (kv, d), "matrix", 1 / math.sqrt(d)),
            TensorPlan(b + "attn_v.weight", (kv, d), "matrix", 1 / math.sqrt(d)),
        ]
        if shape.qkv_bias:
            out += [
                TensorPlan(b + "attn_q.bias", (q,), "bias"),
                TensorPlan(b + "attn_k.bias", (kv,), "bias"),
                TensorPlan(b + "attn_v.bias", (kv,), "bias"),
            ]
        out += [
            TensorPlan(b + "attn_output.weight", (d, q), "matrix", 1 / math.sqrt(q)),
            TensorPlan(b + "ffn_norm.weight", (d,), "norm"),
            TensorPlan(b + "ffn_gate.weight", (dims.n_ff, d), "matrix", 1 / math.sqrt(d)),
            TensorPlan(b + "ffn_up.weight", (dims.n_ff, d), "matrix", 1 / math.sqrt(d)),
            TensorPlan(b + "ffn_down.weight", (d, dims.n_ff), "matrix", 1 / math.sqrt(dims.n_ff)),
        ]
    out.append(TensorPlan("output_norm.weight", (d,), "norm"))
    if not shape.tied:
        out.append(TensorPlan("output.weight", (dims.n_vocab, d), "matrix", head_std))
    return out


def _ggml_type(kind: str, dtype: str) -> gguf.GGMLQuantizationType:
    if kind != "matrix":
        return GGML.F32
    return {"f16": GGML.F16, "bf16": GGML.BF16, "q8_0": GGML.Q8_0}[dtype]


def tensor_nbytes(t: TensorPlan, dtype: str) -> int:
    """Bytes of ``t``'s data in the file (Q8_0: 34 bytes per 32 values)."""
    block, size = gguf.GGML_QUANT_SIZES[_ggml_type(t.kind, dtype)]
    return math.prod(t.shape) // block * size


def _exponent(std: float) -> int:
    return round(math.log2(std / _MANTISSA_RMS))


def _random_bits(rng: np.random.Generator, shape: tuple[int, ...], std: float, *, mantissa_bits: int, bias: int):
    """16-bit floats of one magnitude class as uint16 bit patterns: random sign and mantissa,
    exponent fixed at ``std``'s (see the module docstring)."""
    keep = np.uint16(0x8000 | ((1 << mantissa_bits) - 1))
    exp = np.uint16((_exponent(std) + bias) << mantissa_bits)
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    np.bitwise_and(bits, keep, out=bits)
    np.bitwise_or(bits, exp, out=bits)
    return bits


def tensor_values(t: TensorPlan, dtype: str, rng: np.random.Generator) -> np.ndarray:
    """The data of ``t`` as the array ``GGUFWriter.write_tensor_data`` takes: F32 values,
    F16 values, BF16 bit patterns (uint16) or Q8_0 blocks (uint8, ``(rows, bytes per row)``)."""
    if t.kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(t.shape, dtype=np.float32)).astype(np.float32)
    if t.kind == "bias":
        return (0.1 * rng.standard_normal(t.shape, dtype=np.float32)).astype(np.float32)
    if dtype == "f16":
        return _random_bits(rng, t.shape, t.std, mantissa_bits=10, bias=15).view(np.float16)
    if dtype == "bf16":
        return _random_bits(rng, t.shape, t.std, mantissa_bits=7, bias=127)
    rows, k = t.shape
    blocks = rng.integers(-128, 128, size=(rows, k // 32, 34), dtype=np.int8).view(np.uint8)
    scale = np.full((rows, k // 32, 1), t.std / _Q8_RMS, dtype=np.float16).view(np.uint8)
    blocks[:, :, 0:2] = scale
    return blocks.reshape(rows, k // 32 * 34)


def _add_metadata(w: gguf.GGUFWriter, shape: SyntheticShape, dims: Dims, dtype: str, tiny: bool) -> None:
    a = shape.arch
    u32, f32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    w.add_key_value("general.type", "model", gguf.GGUFValueType.STRING)
    w.add_key_value("general.name", f"synthetic-{shape.name}{'-tiny' if tiny else ''}", gguf.GGUFValueType.STRING)
    w.add_key_value("general.file_type", _FILE_TYPE[dtype], u32)
    for key, value, vtype in (
        ("context_length", shape.n_ctx_train, u32),
        ("embedding_length", dims.n_embd, u32),
        ("block_count", dims.n_layer, u32),
        ("feed_forward_length", dims.n_ff, u32),
        ("attention.head_count", dims.n_head, u32),
        ("attention.head_count_kv", dims.n_head_kv, u32),
        ("attention.key_length", dims.head_dim, u32),
        ("attention.value_length", dims.head_dim, u32),
        ("attention.layer_norm_rms_epsilon", shape.eps, f32),
        ("rope.freq_base", shape.rope_theta, f32),
        ("rope.dimension_count", dims.head_dim, u32),
        ("vocab_size", dims.n_vocab, u32),
    ):
        w.add_key_value(f"{a}.{key}", value, vtype)


def write_model(
    path: str | os.PathLike[str],
    shape_name: str,
    *,
    tiny: bool = False,
    dtype: str = "f16",
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Write the random-weight GGUF of ``shape_name`` at ``path`` (see the module docstring);
    returns the path. Deterministic: the same arguments write the same bytes.

    Raises:
        KeyError: unknown shape (the message lists `SHAPES`).
        ValueError: unknown dtype.
    """
    if shape_name not in SHAPES:
        raise KeyError(f"unknown synthetic shape '{shape_name}' (known: {', '.join(SHAPES)})")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype '{dtype}' (expected one of {', '.join(DTYPES)})")
    shape = SHAPES[shape_name]
    dims = shape.tiny if tiny else shape.dims
    plan = tensor_plan(shape, dims)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    t0 = time.monotonic()
    w = gguf.GGUFWriter(tmp, arch=shape.arch)
    try:
        _add_metadata(w, shape, dims, dtype, tiny)
        add_tokenizer(w, FAMILIES[shape.vocab], dims.n_vocab)
        for t in plan:
            gt = _ggml_type(t.kind, dtype)
            nbytes = tensor_nbytes(t, dtype)
            if gt == GGML.Q8_0:  # given as bytes per row: the writer turns it into values per row
                w.add_tensor_info(t.name, (t.shape[0], nbytes // t.shape[0]), np.dtype(np.uint8), nbytes, raw_dtype=gt)
            else:
                np_dtype = {GGML.F32: np.float32, GGML.F16: np.float16, GGML.BF16: np.uint16}[gt]
                w.add_tensor_info(t.name, t.shape, np.dtype(np_dtype), nbytes, raw_dtype=gt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        total = sum(tensor_nbytes(t, dtype) for t in plan)
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="synthetic") as pool:

            def make(i: int) -> np.ndarray:
                return tensor_values(plan[i], dtype, np.random.default_rng((seed, i)))

            nxt = pool.submit(make, 0)
            done, quarter = 0, 0
            for i in range(len(plan)):
                data = nxt.result()
                if i + 1 < len(plan):
                    nxt = pool.submit(make, i + 1)
                w.write_tensor_data(data)
                done += data.nbytes
                del data
                if log and total > 1e9 and done * 4 >= (quarter + 1) * total and done < total:
                    quarter = done * 4 // total
                    log(f"synthetic {shape.name}: {done / 1e9:.2f} / {total / 1e9:.2f} GB written")
        w.close()
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(out)
    if log:
        log(f"synthetic {shape.name}{' (tiny)' if tiny else ''} {dtype}: {out} in {time.monotonic() - t0:.1f} s")
    return out


def base_tensor_ne(shape_name: str, *, tiny: bool = False) -> dict[str, tuple[int, ...]]:
    """``{tensor name: ggml ne}`` of the model `write_model` writes (what adapters are
    validated against), without reading the file."""
    shape = SHAPES[shape_name]
    return {t.name: t.ne for t in tensor_plan(shape, shape.tiny if tiny else shape.dims)}


def adapter_factory(
    out_dir: str | os.PathLike[str], shape_name: str, *, tiny: bool = False, seed: int = 0, rank: int = DEFAULT_RANK
) -> AdapterFactory:
    """The bench's adapter writer for this shape: rank ``rank`` on every linear weight, F16
    A/B, alpha ``2 · rank``; ``factory.path(i)`` writes (once) and returns adapter ``i``."""
    return AdapterFactory(
        Path(out_dir),
        arch=SHAPES[shape_name].arch,
        base_tensors=base_tensor_ne(shape_name, tiny=tiny),
        base_seed=seed,
        rank=rank,
        alpha=2.0 * rank,
        dtype=np.float16,
    )


@dataclass(frozen=True)
class SyntheticModel:
    """A written synthetic model: the GGUF and the folder of its adapters (``factory``)."""

    path: Path
    factory: AdapterFactory


def cache_root() -> Path:
    """``$LORAPLANE_CACHE/synthetic`` (default ``~/.cache/loraplane/synthetic``)."""
    root = os.environ.get("LORAPLANE_CACHE") or str(Path.home() / ".cache" / "loraplane")
    return Path(root) / "synthetic"


def ensure_model(
    shape_name: str,
    *,
    tiny: bool = False,
    dtype: str = "f16",
    seed: int = 0,
    rank: int = DEFAULT_RANK,
    cache_dir: str | os.PathLike[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> SyntheticModel:
    """The synthetic model in ``cache_dir`` (default `cache_root`), written on first use; the
    file name holds every argument and `FORMAT_VERSION`, so a cached file is always the one
    asked for. Adapters are written when first asked for (``.factory.path(i)``)."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    stem = f"{shape_name}{'-tiny' if tiny else ''}-{dtype}-seed{seed}-v{FORMAT_VERSION}"
    path = root / f"{stem}.gguf"
    if not path.exists():
        write_model(path, shape_name, tiny=tiny, dtype=dtype, seed=seed, log=log)
    elif log:
        log(f"synthetic {shape_name}: cached {path}")
    return SyntheticModel(
        path, adapter_factory(root / f"{stem}-lora-r{rank}", shape_name, tiny=tiny, seed=seed, rank=rank)
    )


def shape_summary(shape_name: str, *, tiny: bool = False, dtype: str = "f16") -> str:
    """One line: arch, sizes and file bytes of the shape."""
    shape = SHAPES[shape_name]
    dims = shape.tiny if tiny else shape.dims
    total = sum(tensor_nbytes(t, dtype) for t in tensor_plan(shape, dims))
    return (
        f"{shape.name}{' (tiny)' if tiny else ''}: arch {shape.arch}, {dims.n_layer} layers, n_embd {dims.n_embd}, "
        f"{dims.n_head}/{dims.n_head_kv} heads of {dims.head_dim}, FFN {dims.n_ff}, vocab {dims.n_vocab}, "
        f"{'tied' if shape.tied else 'untied'} output, {dtype}: {total / 1e9:.2f} GB of tensors"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.synthetic", description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("-o", "--output", required=True, metavar="PATH", help="the model GGUF to write")
    ap.add_argument("--tiny", action="store_true", help="2 layers, small widths, 4 096 ids: the CPU tests' model")
    ap.add_argument("--dtype", choices=DTYPES, default="f16", help="matrix type (default f16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--adapters", type=int, default=0, metavar="N", help="also write N adapters (default 0)")
    ap.add_argument("--rank", type=int, default=DEFAULT_RANK, help=f"adapter rank (default {DEFAULT_RANK})")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    out = Path(args.output)
    log(shape_summary(args.shape, tiny=args.tiny, dtype=args.dtype))
    write_model(out, args.shape, tiny=args.tiny, dtype=args.dtype, seed=args.seed, log=log)
    print(out)
    if args.adapters:
        factory = adapter_factory(
            out.with_name(out.stem + f"-lora-r{args.rank}"), args.shape, tiny=args.tiny, seed=args.seed, rank=args.rank
        )
        t0 = time.monotonic()
        for p in factory.paths(args.adapters):
            print(p)
        log(f"{args.adapters} adapters (rank {args.rank}, F16) in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
