"""``--kv-cache-dtype``: the CPU KV cache's storage (llama-server's ``--cache-type-k/-v``).

"auto" stores f16 on the packed path under f32 compute, as llama.cpp does by default; the f16 cache's fidelity
against llama.cpp's own outputs is what tests/parity checks (it runs the default). Here: the
resolution rule, the refusals, and that f16 and f32 caches give the same greedy tokens on a real
prompt with log-probs close.
"""

from __future__ import annotations

import pytest
import torch

from worker.lora.adapter_set import AdapterSet
from worker.runtime.context import UBatch
from worker.runtime.kv_cache import kv_cache_dtype


def test_auto_is_f16_under_f32_compute_and_the_compute_dtype_otherwise():
    assert kv_cache_dtype("auto", torch.float32) == torch.float16
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("auto", torch.float16) == torch.float16
    assert kv_cache_dtype("auto", torch.float32, "dequant") == torch.float32  # the reference stays f32
    assert kv_cache_dtype("f32", torch.float32) == torch.float32
    assert kv_cache_dtype("bf16", torch.float32) == torch.bfloat16
    with pytest.raises(ValueError, match=r"unknown KV cache dtype 'q8_0' \(expected one of auto, f32, f16, bf16\)"):
        kv_cache_dtype("q8_0", torch.float32)


def test_the_gpu_engine_takes_only_auto(gemma_packed):
    with pytest.raises(ValueError, match="--kv-cache-dtype f32: the GPU engine's paged KV cache takes only 'auto'"):
        gemma_packed.new_context(n_ctx_seq=16, engine="gpu", kv_dtype="f32")


def test_f16_cache_gives_the_f32_caches_greedy_tokens(gemma_packed):
    """A 40-token prompt then 12 greedy steps: the default (f16) and an f32 cache pick the same
    tokens where f32's top-2 margin exceeds 0.2, every prompt row's log-prob of its argmax
    within 0.05 (the attention reads K/V rounded to f16, 11 significant bits)."""
    tok = gemma_packed.base.tokenizer
    prompt = tok.encode("The history of the lighthouse keeper's family, told by the youngest daughter, begins")
    runs = {}
    for name in ("auto", "f32"):
        ctx = gemma_packed.new_context(n_ctx_seq=128, kv_dtype=name)
        try:
            ctx.set_adapters(AdapterSet())
            assert ctx.kv.dtype == (torch.float16 if name == "auto" else torch.float32)
            n = len(prompt)
            lp = torch.log_softmax(ctx.decode(UBatch(prompt, list(range(n)), [0] * n, [True] * n)).logits, -1)
            rows, toks = [lp], []
            for i in range(12):
                t = int(rows[-1][-1].argmax())
                toks.append(t)
                rows.append(torch.log_softmax(ctx.decode(UBatch([t], [n + i], [0], [True])).logits, -1))
            runs[name] = (lp, toks, torch.cat(rows[1:]))
        finally:
            ctx.close()
    (lp16, toks16, _), (lp32, toks32, dec32) = runs["auto"], runs["f32"]
    top2 = torch.topk(dec32, 2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.2
    assert int(clear.sum()) >= 6
    assert [t for t, c in zip(toks16, clear.tolist(), strict=True) if c] == [
        t for t, c in zip(toks32, clear.tolist(), strict=True) if c
    ]
    best = lp32.argmax(-1, keepdim=True)
    assert float((lp32.gather(1, best) - lp16.gather(1, best)).abs().max()) < 0.05
