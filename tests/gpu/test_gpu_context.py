"""The GPU engine's context (``worker.gpu.context``) against the CPU context, on CPU
tensors under Triton's interpreter (capture off), on CUDA when the machine has one.

Every tiny architecture, f32, one adapter: a prompt with the adapter, two prompts in one ubatch
(base and the adapter at half scale), a mixed decode step (three sequences, three adapter sets),
then a base-only and an adapter decode step after the sequences were dropped. The two contexts
must give the same logits within 1e-4 (f32; the kernels sum in other orders than the CPU's).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.gpu import CUDA, NO_TRITON, TRITON
from tests.helpers.tiny_models import ARCHS, MODELS, adapter
from worker.lora.adapter import load_lora_adapter
from worker.lora.adapter_set import EMPTY_SET, AdapterSet
from worker.runtime.context import DecodeError, Model, UBatch
from worker.runtime.model import load_model

# under the interpreter a tiny model's five steps take 10-20 s: the slow tier
pytestmark = [pytest.mark.skipif(not TRITON, reason=NO_TRITON), pytest.mark.slow]

TOL = 1e-4
CPU_ARCHS = ("llama", "gemma2", "qwen3moe")
"""Under the interpreter (10-20 s a model): the dense path, the windowed and soft-capped one and
the eager MoE one; every architecture on CUDA."""


def _steps(ctx) -> list[torch.Tensor]:
    toks = [1, 5, 9, 13, 17, 21]
    out = [
        ctx.decode(UBatch(toks, list(range(6)), [0] * 6, [True] * 6, [0] * 6)),
        ctx.decode(UBatch(toks[:3] + toks[:2], [0, 1, 2, 0, 1], [1, 1, 1, 2, 2], [True] * 5, [1, 1, 1, 2, 2])),
        ctx.decode(UBatch([7, 8, 9], [6, 3, 2], [0, 1, 2], [True] * 3, [0, 1, 2])),
    ]
    for s in (0, 1, 2):
        ctx.kv.seq_rm(s)
    out.append(ctx.decode(UBatch([3], [0], [0], [True], [1])))
    out.append(ctx.decode(UBatch([4], [1], [0], [True], [0])))
    return [r.logits.float().cpu() for r in out]


def _context(model_path: Path, lora_path: Path, arch: str, engine: str, device: str):
    weights = "dequant" if engine == "cpu" else "device-dense"
    base = load_model(model_path, device=device if engine == "gpu" else "cpu", dtype="f32", weights=weights)
    model = Model(base, max_loras=4)
    a = load_lora_adapter(
        lora_path, base_arch=arch, base_tensors=base.tensor_ne, device_for=base.device_of, dtype=base.dtype
    )
    model.adapters.add(0, a)
    ctx = model.new_context(n_ctx_seq=64, n_seq=4, engine=engine)
    ctx.set_adapters([AdapterSet.of([(0, a, 1.0)]), EMPTY_SET, AdapterSet.of([(0, a, 0.5)])])
    return ctx


@pytest.mark.parametrize("arch", ARCHS)
def test_the_gpu_context_computes_what_the_cpu_context_does(arch, tmp_path, device):
    if not CUDA and arch not in CPU_ARCHS:
        pytest.skip(f"under Triton's interpreter only {', '.join(CPU_ARCHS)} (the same GPU code paths); all on CUDA")
    model_path = MODELS[arch](tmp_path / f"{arch}.gguf")
    lora_path = adapter(arch, tmp_path / f"{arch}-lora.gguf")
    want = _steps(_context(model_path, lora_path, arch, "cpu", "cpu"))
    gpu = _context(model_path, lora_path, arch, "gpu", str(device))
    assert type(gpu).__name__ == "GpuWorkerContext"
    got = _steps(gpu)
    base_vs_lora = (want[3] - want[4]).abs().max().item()
    assert base_vs_lora > 0.05, "the adapter must change the logits for this test to mean anything"
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert g.shape == w.shape, (i, g.shape, w.shape)
        d = (g - w).abs().max().item()
        assert d <= TOL, f"{arch} step {i}: max |Δ logit| {d:.2e} > {TOL}"
    stats = gpu.cuda_graph_stats
    if CUDA and arch != "qwen3moe":
        assert stats.cuda_graphs_captured > 0 and stats.cuda_graph_replays >= 3
    else:
        assert stats.cuda_graphs_captured == 0 and stats.cuda_graph_replays == 0
    assert stats.cuda_graph_eager_fallbacks >= 2  # the prompts
    if arch == "qwen3moe":  # MoE routing reads expert ids on the host: every step eager
        assert stats.cuda_graphs_captured == 0 and stats.cuda_graph_eager_fallbacks == 5


def test_a_failed_ubatch_keeps_nothing_in_the_paged_cache(tmp_path, device):
    model_path = MODELS["llama"](tmp_path / "llama.gguf")
    lora_path = adapter("llama", tmp_path / "llama-lora.gguf")
    ctx = _context(model_path, lora_path, "llama", "gpu", str(device))
    ctx.decode(UBatch([1, 2], [0, 1], [0, 0], [False, True]))
    with pytest.raises(DecodeError, match="out of range"):
        ctx.decode(UBatch([3, 10**9], [2, 0], [0, 1], [True, True]))
    with pytest.raises(DecodeError, match="seq 0: ubatch starts at pos 5 but the sequence holds 2"):
        ctx.decode(UBatch([3, 4], [0, 5], [1, 0], [True, True]))
    assert ctx.kv.seq_len(0) == 2 and ctx.kv.seq_len(1) == 0
    free = ctx.kv.pages.n_free_blocks
    snap = ctx.kv.export(0, 2)
    ctx.kv.import_(1, snap)
    assert ctx.kv.seq_len(1) == 2 and ctx.kv.pages.n_free_blocks == free  # shared, not copied
    r = ctx.decode(UBatch([3, 3], [2, 2], [0, 1], [True, True]))
    assert (r.logits[0] - r.logits[1]).abs().max().item() == 0.0  # same prefix, same token
    # the partial block is shared three ways (seq 0, seq 1, the snapshot): each writer copies it
    assert ctx.kv.pages.n_free_blocks == free - 2
    del snap  # dropping the prefix-cache entry releases its references
    ctx.kv.seq_rm(0)
    ctx.kv.seq_rm(1)
    assert ctx.kv.pages.n_free_blocks == ctx.kv.pages.allocator.n_blocks - 1
