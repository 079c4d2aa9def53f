"""Synthetic adapter GGUF files against a small synthetic base (``BASE``: tensor name → ggml ne),
for the adapter loader's and the pool's unit tests. Shapes in arguments are numpy/torch order."""

from __future__ import annotations

from pathlib import Path

import gguf

K, D, V, E, R = 32, 24, 50, 4, 4
"""Synthetic base: input width K, output width D, vocabulary V, experts E; adapter rank R."""
BASE = {  # ggml ne: what ``load_lora_adapter(base_tensors=...)`` checks adapters against
    "blk.0.attn_q.weight": (K, D),
    "blk.0.attn_norm.weight": (K,),
    "token_embd.weight": (D, V),
    "blk.0.ffn_up_exps.weight": (K, D, E),
}


def write_adapter_gguf(
    path: Path,
    tensors: dict,
    *,
    arch: str = "llama",
    gtype: str | None = "adapter",
    atype: str | None = "lora",
    alpha: float | None = 8.0,
    extra: dict | None = None,
) -> Path:
    """Write an adapter GGUF at ``path`` and return ``path``: ``tensors`` maps names to arrays (numpy
    order) or ``(raw array, ggml type)`` tuples; ``gtype`` (``general.type``), ``atype``
    (``adapter.type``) and ``alpha`` (``adapter.lora.alpha``) are left out when None; ``extra``
    maps further keys to ``(value, GGUFValueType, array element type or None)``."""
    w = gguf.GGUFWriter(path, arch)
    if gtype is not None:
        w.add_type(gtype)
    if atype is not None:
        w.add_string("adapter.type", atype)
    if alpha is not None:
        w.add_float32("adapter.lora.alpha", alpha)
    for key, (value, vtype, sub) in (extra or {}).items():
        w.add_key_value(key, value, vtype, sub)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=t[1])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
