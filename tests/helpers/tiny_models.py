"""Tiny random-weight GGUF models and LoRA adapters, one per architecture, written
deterministically (fixed numpy seed, fixed key and tensor order) so a test regenerates the
exact file llama-server made the goldens of ``tests/fixtures/tiny_archs/`` from (the golden
records each file's sha256).

Every model: 2 layers, n_embd 64, 4 query heads / 2 KV heads of 16, FFN 128, F16 matrices and
F32 norms, with the tokenizer fields (``tokenizer.*``) copied byte for byte from its family's
llama.cpp vocab test file (``tests.helpers.registry_models.llama_cpp_vocabs``; ``VOCAB``), which also
sets the vocabulary size: Llama 3's byte-level BPE (``llama-bpe``, 128 256 tokens, adds BOS),
Qwen 2's (``qwen2``, 151 936, no BOS) for the three Qwen models, Phi-3's SentencePiece
(``phi-3``, 32 064) and, for Gemma 2, Llama's SentencePiece (``llama-spm``, 32 000; the sdist
ships no Gemma 2 vocabulary). The goldens' prompts are text, so llama-server's tokenization of
them is checked along with the forward pass. Each architecture's distinctive metadata is set to
values that matter in a short prompt (Llama 3 ``rope_freqs`` with factors 1…8, Gemma 2
soft-caps that bend the logits and a sliding window of 4, Qwen 2 non-zero q/k/v biases, Phi-3
LongRoPE short/long factors and attention factor).

Weights are scaled so a random model gives non-saturated next-token distributions with a clear
top 1: matrices ~ N(0, gain²/k) (k = input width), norms 1 + N(0, 0.1²), output rows scaled so
logits have a standard deviation of a few nats (on the golden prompts, even with the 128k/152k
vocabularies: greedy top-1 log-probs between -4.4 and -0.2, entropy 2.8–7.6 nats, most top-1/top-2
margins above 0.1).

    python -m tests.helpers.tiny_models OUT_DIR [ARCH ...]   # writes <arch>.gguf and <arch>-lora.gguf
    python -m tests.helpers.tiny_models --pre OUT_DIR        # writes <pre>.gguf per PRE_VOCAB value
"""

from __future__ import annotations

import functools
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import gguf
import numpy as np

N_LAYER, N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF = 2, 64, 4, 2, 16, 128
RANK, ALPHA = 4, 8.0
ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2")
"""Architectures with a tiny model (the keys of ``MODELS``)."""

VOCAB = {
    "llama": "llama-bpe",
    "qwen2": "qwen2",
    "qwen3": "qwen2",
    "qwen3moe": "qwen2",
    "phi3": "phi-3",
    "gemma2": "llama-spm",
}
"""Which ``ggml-vocab-<name>.gguf`` each tiny model copies its tokenizer from."""


_SCALAR = {
    gguf.GGUFValueType.UINT8: "<B",
    gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I",
    gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f",
    gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}


_KV = tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]
"""``(key, value, type, array element type or None)`` of one GGUF key/value."""


def _read_kv(buf: bytes) -> list[_KV]:
    """Every key/value of a GGUF (versions 2/3) as ``(key, value, type, array element type)``,
    array strings kept as ``bytes`` so the copy is byte for byte. ``gguf.GGUFReader`` takes seconds
    on a 150k-token vocabulary (a numpy view per element); this reads it in a fraction."""
    off = 8  # magic, version

    def scalar(fmt: str) -> Any:
        nonlocal off
        (v,) = struct.unpack_from(fmt, buf, off)
        off += struct.calcsize(fmt)
        return v

    def string() -> bytes:
        nonlocal off
        n = int(scalar("<Q"))
        off += n
        return buf[off - n : off]

    def value(vtype: gguf.GGUFValueType) -> object:
        if vtype == gguf.GGUFValueType.STRING:
            return string()
        return scalar(_SCALAR[vtype])

    scalar("<Q")  # tensor count
    out: list[_KV] = []
    for _ in range(int(scalar("<Q"))):
        key = string().decode("utf-8")
        vtype = gguf.GGUFValueType(scalar("<I"))
        if vtype == gguf.GGUFValueType.ARRAY:
            etype = gguf.GGUFValueType(scalar("<I"))
            if etype == gguf.GGUFValueType.ARRAY:
                raise ValueError(f"{key}: nested arrays are not copied")
            n = int(scalar("<Q"))
            if etype == gguf.GGUFValueType.STRING:
                items: list[object] = [string() for _ in range(n)]
            else:
                dt = np.dtype(_SCALAR[etype])
                items = np.frombuffer(buf, dtype=dt, count=n, offset=off).tolist()
                off += n * dt.itemsize
            out.append((key, items, vtype, etype))
        else:
            v = value(vtype)
            out.append((key, v.decode("utf-8") if isinstance(v, bytes) else v, vtype, None))
    return out


@functools.cache
def _vocab_fields(name: str) -> tuple[list[_KV], int]:
    """``(key, value, type, array element type)`` of every ``tokenizer.*`` field of the vocab
    file ``name``, in file order, and the vocabulary size."""
    from tests.helpers.registry_models import llama_cpp_vocabs

    fields = _read_kv((llama_cpp_vocabs() / f"ggml-vocab-{name}.gguf").read_bytes())
    out = [f for f in fields if f[0].startswith("tokenizer.")]
    tokens = next(v for k, v, _, _ in out if k == "tokenizer.ggml.tokens")
    return out, len(cast(list, tokens))


class _Gen:
    """Seeded tensor factory: numpy arrays in torch order (ggml ``ne`` reversed)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def mat(self, d: int, k: int, gain: float = 1.0) -> np.ndarray:
        """``(d, k)`` F16 weight (ggml ne ``[k, d]``), entries ~ N(0, gain²/k)."""
        return (self.rng.standard_normal((d, k), dtype=np.float32) * (gain / np.sqrt(k))).astype(np.float16)

    def experts(self, e: int, d: int, k: int, gain: float = 1.0) -> np.ndarray:
        """``(e, d, k)`` F16 expert weights (ggml ne ``[k, d, e]``)."""
        return (self.rng.standard_normal((e, d, k), dtype=np.float32) * (gain / np.sqrt(k))).astype(np.float16)

    def norm(self, d: int) -> np.ndarray:
        """``(d,)`` F32 norm weight around 1."""
        return (1.0 + 0.1 * self.rng.standard_normal(d, dtype=np.float32)).astype(np.float32)

    def vec(self, d: int, std: float) -> np.ndarray:
        """``(d,)`` F32 vector ~ N(0, std²) (biases)."""
        return (std * self.rng.standard_normal(d, dtype=np.float32)).astype(np.float32)

    def embd(self, v: int, d: int, std: float) -> np.ndarray:
        """``(v, d)`` F16 embedding, entries ~ N(0, std²)."""
        return (self.rng.standard_normal((v, d), dtype=np.float32) * std).astype(np.float16)


_KEEP = object()
"""``_write``'s ``pre`` default: the vocab file's own ``tokenizer.ggml.pre``."""


def _write(
    path: Path,
    arch: str,
    kv: list[tuple[str, object, gguf.GGUFValueType]],
    tensors: dict[str, np.ndarray],
    vocab: str,
    *,
    pre: object = _KEEP,
) -> Path:
    """One GGUF: ``general.*``, the ``{arch}.*`` keys ``kv``, the vocab's tokenizer, tensors.
    ``pre`` (a string, or None for no key at all) replaces the vocab's ``tokenizer.ggml.pre``."""
    w = gguf.GGUFWriter(path, arch=arch)
    w.add_key_value("general.type", "model", gguf.GGUFValueType.STRING)
    w.add_key_value("general.name", f"tiny-{arch}", gguf.GGUFValueType.STRING)
    for key, value, vtype in kv:
        w.add_key_value(f"{arch}.{key}", value, vtype)
    fields, _ = _vocab_fields(vocab)
    for key, value, vtype, etype in fields:
        if key == "tokenizer.ggml.pre" and pre is not _KEEP:
            if pre is None:
                continue
            value = pre
        w.add_key_value(key, value, vtype, sub_type=etype)
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


U32, F32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32


def _base_kv(n_ff: int = N_FF, *, eps: float = 1e-6, rope_base: float = 10000.0, ctx: int = 4096) -> list:
    return [
        ("context_length", ctx, U32),
        ("embedding_length", N_EMBD, U32),
        ("block_count", N_LAYER, U32),
        ("feed_forward_length", n_ff, U32),
        ("attention.head_count", N_HEAD, U32),
        ("attention.head_count_kv", N_HEAD_KV, U32),
        ("attention.key_length", HEAD_DIM, U32),
        ("attention.value_length", HEAD_DIM, U32),
        ("attention.layer_norm_rms_epsilon", eps, F32),
        ("rope.freq_base", rope_base, F32),
        ("rope.dimension_count", HEAD_DIM, U32),
    ]


def _attn(g: _Gen, b: str, *, qk_gain: float = 1.5) -> dict[str, np.ndarray]:
    return {
        b + "attn_norm.weight": g.norm(N_EMBD),
        b + "attn_q.weight": g.mat(N_HEAD * HEAD_DIM, N_EMBD, qk_gain),
        b + "attn_k.weight": g.mat(N_HEAD_KV * HEAD_DIM, N_EMBD, qk_gain),
        b + "attn_v.weight": g.mat(N_HEAD_KV * HEAD_DIM, N_EMBD),
        b + "attn_output.weight": g.mat(N_EMBD, N_HEAD * HEAD_DIM),
    }


def _ffn(g: _Gen, b: str) -> dict[str, np.ndarray]:
    return {
        b + "ffn_norm.weight": g.norm(N_EMBD),
        b + "ffn_gate.weight": g.mat(N_FF, N_EMBD, 1.5),
        b + "ffn_up.weight": g.mat(N_FF, N_EMBD),
        b + "ffn_down.weight": g.mat(N_EMBD, N_FF),
    }


def _head(g: _Gen, n_vocab: int, *, tied: bool, logit_std: float = 3.0) -> dict[str, np.ndarray]:
    """Embedding (std 1) and, untied, an output matrix giving logits of std ``logit_std``."""
    t = {"token_embd.weight": g.embd(n_vocab, N_EMBD, 1.0)}
    if not tied:
        t["output.weight"] = g.embd(n_vocab, N_EMBD, logit_std / np.sqrt(N_EMBD))
    return t


def llama3_rope_freqs(n_rot: int, base: float, *, factor: float, low: float, high: float, orig_ctx: int) -> np.ndarray:
    """Llama 3 "llama3" rope scaling factors ``(n_rot/2,)`` as the HF → GGUF converter computes
    them: 1 for wavelengths below ``orig_ctx/high``, ``factor`` above ``orig_ctx/low``, a smooth
    blend between (llama.cpp ``convert_hf_to_gguf.py``, LlamaModel ``generate_extra_tensors``)."""
    freqs = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < orig_ctx / high:
            out.append(1.0)
        elif wavelen > orig_ctx / low:
            out.append(factor)
        else:
            smooth = (orig_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def model_llama(path: Path) -> Path:
    """Llama 3.x style: NORM rope, ``rope_freqs.weight`` (factors 1, 3.3, 8, …: base 10000,
    factor 8, low 1, high 4, original context 32), untied output."""
    _, n_vocab = _vocab_fields(VOCAB["llama"])
    g = _Gen(3)
    t = _head(g, n_vocab, tied=False)
    t["output_norm.weight"] = g.norm(N_EMBD)
    t["rope_freqs.weight"] = llama3_rope_freqs(HEAD_DIM, 10000.0, factor=8.0, low=1.0, high=4.0, orig_ctx=32)
    for il in range(N_LAYER):
        b = f"blk.{il}."
        t |= _attn(g, b) | _ffn(g, b)
    return _write(path, "llama", _base_kv(eps=1e-5), t, VOCAB["llama"])


def model_qwen2(path: Path) -> Path:
    """Qwen 2: q/k/v biases (std 0.5), NEOX rope, tied output (embedding scaled for the logits)."""
    _, n_vocab = _vocab_fields(VOCAB["qwen2"])
    g = _Gen(4)
    t = {"token_embd.weight": g.embd(n_vocab, N_EMBD, 3.0 / np.sqrt(N_EMBD))}
    t["output_norm.weight"] = g.norm(N_EMBD)
    for il in range(N_LAYER):
        b = f"blk.{il}."
        t |= _attn(g, b)
        t[b + "attn_q.bias"] = g.vec(N_HEAD * HEAD_DIM, 0.5)
        t[b + "attn_k.bias"] = g.vec(N_HEAD_KV * HEAD_DIM, 0.5)
        t[b + "attn_v.bias"] = g.vec(N_HEAD_KV * HEAD_DIM, 0.5)
        t |= _ffn(g, b)
    return _write(path, "qwen2", _base_kv(rope_base=1e6), t, VOCAB["qwen2"])


def _qk_norms(g: _Gen, b: str) -> dict[str, np.ndarray]:
    return {b + "attn_q_norm.weight": g.norm(HEAD_DIM) * 1.5, b + "attn_k_norm.weight": g.norm(HEAD_DIM) * 1.5}


def model_qwen3(path: Path) -> Path:
    """Qwen 3: per-head q/k RMS norms, no biases, NEOX rope, untied output."""
    _, n_vocab = _vocab_fields(VOCAB["qwen3"])
    g = _Gen(5)
    t = _head(g, n_vocab, tied=False)
    t["output_norm.weight"] = g.norm(N_EMBD)
    for il in range(N_LAYER):
        b = f"blk.{il}."
        t |= _attn(g, b) | _qk_norms(g, b) | _ffn(g, b)
    return _write(path, "qwen3", _base_kv(rope_base=1e6), t, VOCAB["qwen3"])


N_EXPERT, N_EXPERT_USED, N_FF_EXP = 4, 2, 64


def model_qwen3moe(path: Path) -> Path:
    """Qwen 3 MoE: Qwen 3 attention, 4 experts of width 64, top 2 renormalised, no shared expert."""
    _, n_vocab = _vocab_fields(VOCAB["qwen3moe"])
    g = _Gen(6)
    t = _head(g, n_vocab, tied=False)
    t["output_norm.weight"] = g.norm(N_EMBD)
    for il in range(N_LAYER):
        b = f"blk.{il}."
        t |= _attn(g, b) | _qk_norms(g, b)
        t[b + "ffn_norm.weight"] = g.norm(N_EMBD)
        t[b + "ffn_gate_inp.weight"] = g.mat(N_EXPERT, N_EMBD, 2.0)
        t[b + "ffn_gate_exps.weight"] = g.experts(N_EXPERT, N_FF_EXP, N_EMBD, 1.5)
        t[b + "ffn_up_exps.weight"] = g.experts(N_EXPERT, N_FF_EXP, N_EMBD)
        t[b + "ffn_down_exps.weight"] = g.experts(N_EXPERT, N_EMBD, N_FF_EXP)
    kv = _base_kv(n_ff=N_FF, rope_base=1e6) + [
        ("expert_count", N_EXPERT, U32),
        ("expert_used_count", N_EXPERT_USED, U32),
        ("expert_feed_forward_length", N_FF_EXP, U32),
    ]
    return _write(path, "qwen3moe", kv, t, VOCAB["qwen3moe"])


def model_phi3(path: Path) -> Path:
    """Phi-3: fused ``attn_qkv`` and gate|up ``ffn_up`` (2·n_ff rows), NEOX rope with LongRoPE
    short factors (1…2; long ones 1…8, unused within the original context of 4096) and
    attention factor 1.1, untied output."""
    _, n_vocab = _vocab_fields(VOCAB["phi3"])
    g = _Gen(7)
    t = _head(g, n_vocab, tied=False)
    t["output_norm.weight"] = g.norm(N_EMBD)
    t["rope_factors_short.weight"] = np.linspace(1.0, 2.0, HEAD_DIM // 2, dtype=np.float32)
    t["rope_factors_long.weight"] = np.linspace(1.0, 8.0, HEAD_DIM // 2, dtype=np.float32)
    for il in range(N_LAYER):
        b = f"blk.{il}."
        a = _attn(g, b)
        t[b + "attn_norm.weight"] = a[b + "attn_norm.weight"]
        t[b + "attn_qkv.weight"] = np.concatenate(
            [a[b + "attn_q.weight"], a[b + "attn_k.weight"], a[b + "attn_v.weight"]]
        )
        t[b + "attn_output.weight"] = a[b + "attn_output.weight"]
        f = _ffn(g, b)
        t[b + "ffn_norm.weight"] = f[b + "ffn_norm.weight"]
        t[b + "ffn_up.weight"] = np.concatenate([f[b + "ffn_gate.weight"], f[b + "ffn_up.weight"]])
        t[b + "ffn_down.weight"] = f[b + "ffn_down.weight"]
    kv = _base_kv(eps=1e-5, ctx=131072) + [
        ("rope.scaling.original_context_length", 4096, U32),
        ("rope.scaling.attn_factor", 1.1, F32),
    ]
    return _write(path, "phi3", kv, t, VOCAB["phi3"])


GEMMA2_SWA, GEMMA2_ATTN_CAP, GEMMA2_FINAL_CAP = 4, 3.0, 20.0


def model_gemma2(path: Path) -> Path:
    """Gemma 2: embedding × sqrt(64), sliding window 4 on layer 0 (layer 1 global), attention
    soft-cap 3, final soft-cap 20, post-attention / post-FFN norms, GELU, tied output."""
    _, n_vocab = _vocab_fields(VOCAB["gemma2"])
    g = _Gen(8)
    t = {"token_embd.weight": g.embd(n_vocab, N_EMBD, 0.45)}
    t["output_norm.weight"] = g.norm(N_EMBD)
    for il in range(N_LAYER):
        b = f"blk.{il}."
        t |= _attn(g, b, qk_gain=2.0)
        t[b + "post_attention_norm.weight"] = g.norm(N_EMBD) * 4.0
        t |= _ffn(g, b)
        t[b + "post_ffw_norm.weight"] = g.norm(N_EMBD) * 4.0
    kv = _base_kv(ctx=8192) + [
        ("attention.sliding_window", GEMMA2_SWA, U32),
        ("attn_logit_softcapping", GEMMA2_ATTN_CAP, F32),
        ("final_logit_softcapping", GEMMA2_FINAL_CAP, F32),
    ]
    return _write(path, "gemma2", kv, t, VOCAB["gemma2"])


PRE_VOCAB = {
    "tekken": "llama-bpe",
    "smollm": "llama-bpe",
    "deepseek-r1-qwen": "qwen2",
    "default": "llama-bpe",
    "": "llama-bpe",
    "llama3": "llama-bpe",
    "dbrx": "llama-bpe",
    "smaug-bpe": "llama-bpe",
}
"""``tokenizer.ggml.pre`` values checked on their own (no llama.cpp vocab test file has them) ->
the vocab file whose tokens and merges the model carries; ``""`` stands for no key at all."""


def model_pre(path: Path, pre: str) -> Path:
    """Tokenizer-only check model: a 1-layer llama (tied output) with ``PRE_VOCAB[pre]``'s
    tokenizer fields and ``tokenizer.ggml.pre`` set to ``pre`` (removed for ``""``)."""
    vocab = PRE_VOCAB[pre]
    _, n_vocab = _vocab_fields(vocab)
    g = _Gen(11)
    t = _head(g, n_vocab, tied=True)
    t["output_norm.weight"] = g.norm(N_EMBD)
    t |= _attn(g, "blk.0.") | _ffn(g, "blk.0.")
    kv = [(k, 1 if k == "block_count" else v, vt) for k, v, vt in _base_kv(eps=1e-5)]
    return _write(path, "llama", kv, t, vocab, pre=pre or None)


MODELS: dict[str, Callable[[Path], Path]] = {
    "llama": model_llama,
    "qwen2": model_qwen2,
    "qwen3": model_qwen3,
    "qwen3moe": model_qwen3moe,
    "phi3": model_phi3,
    "gemma2": model_gemma2,
}


def lora_targets(arch: str) -> dict[str, tuple[int, ...]]:
    """Base tensor name → its torch shape ``(d, k)`` (experts ``(E, d, k)``) for every tensor
    the arch's tiny adapter patches: q/k/v/o and the FFN of both layers (Phi-3: the fused
    ``attn_qkv`` and ``ffn_up``; Qwen 3 MoE: up/down experts)."""
    q, kv = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    out: dict[str, tuple[int, ...]] = {}
    for il in range(N_LAYER):
        b = f"blk.{il}."
        if arch == "phi3":
            out[b + "attn_qkv.weight"] = (q + 2 * kv, N_EMBD)
        else:
            out |= {
                b + "attn_q.weight": (q, N_EMBD),
                b + "attn_k.weight": (kv, N_EMBD),
                b + "attn_v.weight": (kv, N_EMBD),
            }
        out[b + "attn_output.weight"] = (N_EMBD, q)
        if arch == "phi3":
            out |= {b + "ffn_up.weight": (2 * N_FF, N_EMBD), b + "ffn_down.weight": (N_EMBD, N_FF)}
        elif arch == "qwen3moe":
            out |= {
                b + "ffn_up_exps.weight": (N_EXPERT, N_FF_EXP, N_EMBD),
                b + "ffn_down_exps.weight": (N_EXPERT, N_EMBD, N_FF_EXP),
            }
        else:
            out |= {
                b + "ffn_gate.weight": (N_FF, N_EMBD),
                b + "ffn_up.weight": (N_FF, N_EMBD),
                b + "ffn_down.weight": (N_EMBD, N_FF),
            }
    return out


def adapter(arch: str, path: Path, *, seed: int = 100) -> Path:
    """Rank-4, alpha-8 LoRA GGUF for the arch's tiny model (``general.type adapter``,
    ``adapter.type lora``): per target, F32 ``.lora_a`` ``(r, k)`` (ne ``[k, r]``) ~ N(0, 1/k)
    and ``.lora_b`` ``(d, r)`` (ne ``[r, d]``) ~ N(0, 0.1²); experts ``(E, r, k)`` /
    ``(E, d, r)``. Scale at 1: alpha/r = 2."""
    rng = np.random.default_rng(seed + ARCHS.index(arch))
    w = gguf.GGUFWriter(path, arch=arch)
    w.add_key_value("general.type", "adapter", gguf.GGUFValueType.STRING)
    w.add_key_value("general.name", f"tiny-{arch}-lora", gguf.GGUFValueType.STRING)
    w.add_key_value("adapter.type", "lora", gguf.GGUFValueType.STRING)
    w.add_key_value("adapter.lora.alpha", ALPHA, F32)
    for name, shape in lora_targets(arch).items():
        *e, d, k = shape
        a = rng.standard_normal((*e, RANK, k), dtype=np.float32) / np.float32(np.sqrt(k))
        bm = rng.standard_normal((*e, d, RANK), dtype=np.float32) * np.float32(0.1)
        w.add_tensor(name + ".lora_a", a.astype(np.float32))
        w.add_tensor(name + ".lora_b", bm.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_all(out_dir: Path, archs: tuple[str, ...] = ARCHS) -> dict[str, tuple[Path, Path]]:
    """``arch -> (model, adapter)`` written under ``out_dir`` as ``<arch>.gguf`` / ``<arch>-lora.gguf``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return {a: (MODELS[a](out_dir / f"{a}.gguf"), adapter(a, out_dir / f"{a}-lora.gguf")) for a in archs}


def write_pre(out_dir: Path) -> dict[str, Path]:
    """``pre -> model_pre`` file for every ``PRE_VOCAB`` value, as ``<pre>.gguf`` (``none.gguf``
    for the absent key) under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return {p: model_pre(out_dir / f"{p or 'none'}.gguf", p) for p in PRE_VOCAB}


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m tests.helpers.tiny_models OUT_DIR [ARCH ...] | --pre OUT_DIR")
    if sys.argv[1] == "--pre":
        for pre, m in write_pre(Path(sys.argv[2])).items():
            print(pre or "(absent)", m)
        raise SystemExit(0)
    for arch, (m, lo) in write_all(Path(sys.argv[1]), tuple(sys.argv[2:]) or ARCHS).items():
        print(arch, m, lo)
