"""The layer kernel (``worker/runtime/kernels/csrc/layer.cpp`` via ``worker.runtime.layer``) against
the op-by-op graph it replaces (``LORAPLANE_LAYER=torch``, the reference): the real Gemma 3 270M
(packed Q4_K_M) with and without its fixture adapters in mixed ubatches (prompt rows and decode
rows together), rows bit-identical alone or batched, one kernel call per layer; and (slow) every
tiny architecture quantized to the 32-element block types.

Bound: per row max |Δ log-prob| ≤ ``LOGP_TOL`` over the whole vocabulary and the same argmax. The
two paths differ by float rounding only: the kernel attends prompt rows with the decode
attention kernel (online softmax, f32) where the graph calls torch's SDPA, fuses its rope and
activation arithmetic in C, and adds q/k/v biases in another order; Gemma's residual outliers
(|x| ≈ 250) carry a last-bit difference through the int16 activation roundings of 18 layers.
The LM head runs int16 here whatever the architecture's policy (``_head_at_int16``): an int8 head
turns such a last-bit difference of its input into whole rounding steps (measured 0.034 on the
worst of 262144 log-probs) and is not what these tests compare; the parity tests hold it to the
llama.cpp goldens.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from worker.lora.adapter import load_lora_adapter
from worker.lora.adapter_set import AdapterSet
from worker.runtime.context import Model, UBatch
from worker.runtime.kernels import QuantLinear, cpu, library
from worker.runtime.kernels.layer import LayerKernel
from worker.runtime.model import LM_HEAD_NAMES, load_model

LOGP_TOL = 0.03

pytestmark = pytest.mark.skipif(not cpu.supported("avx2"), reason="the layer kernel needs the avx2 C kernels")


@pytest.fixture
def count_calls(monkeypatch):
    calls = []
    orig = LayerKernel.forward

    def forward(self, x, *args, **kwargs):
        calls.append(x.shape[0])
        return orig(self, x, *args, **kwargs)

    monkeypatch.setattr(LayerKernel, "forward", forward)
    return calls


def _head_at_int16(model: Model, monkeypatch) -> None:
    """Run the model's packed LM head with int16 activations for this test (module docstring)."""
    for name in LM_HEAD_NAMES:
        w = model.base.weights.get(name)
        if isinstance(w, QuantLinear):
            monkeypatch.setattr(w, "act", "i16")
            return


def _script(model: Model, sets: list[AdapterSet]) -> list[torch.Tensor]:
    """Log-probs of every output row of three ubatches: two prompts (7 and 12 rows, one per
    set), then a mixed ubatch (a third prompt of 5 rows + one decode row of each sequence).
    An f32 KV cache: the comparison is of the two paths' arithmetic; under the default f16
    cache, K values a last bit apart round to different f16 values and the gap reads ~3x larger
    (the f16 cache's fidelity against llama.cpp is what tests/parity checks)."""
    ctx = model.new_context(n_ctx_seq=64, n_seq=4, kv_dtype="f32")
    try:
        ctx.set_adapters(sets)
        g = torch.Generator().manual_seed(5)
        tok = lambda n: torch.randint(3, 5000, (n,), generator=g).tolist()  # noqa: E731
        out = []
        ub = UBatch(tok(19), list(range(7)) + list(range(12)), [0] * 7 + [1] * 12, [True] * 19)
        ub.set_index = [0] * 7 + [len(sets) - 1] * 12
        out.append(ctx.decode(ub).logits)
        ub = UBatch(tok(7), list(range(5)) + [7, 12], [2] * 5 + [0, 1], [True] * 7)
        ub.set_index = [0] * 5 + [0, len(sets) - 1]
        out.append(ctx.decode(ub).logits)
        return [torch.log_softmax(t.float(), -1) for t in out]
    finally:
        ctx.close()


def _compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    worst = 0.0
    for a, b in zip(ref, got, strict=True):
        assert a.shape == b.shape
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        worst = max(worst, float((a - b).abs().max()))
    return worst


def _kernel_vs_graph(model: Model, sets: list[AdapterSet], monkeypatch, count_calls, calls: list[int]) -> float:
    """:func:`_script` through the graph, then through the kernel (``calls``: the rows of each
    kernel call, in order); the worst |Δ log-prob| between the two (:func:`_compare`).

    Every matmul at int16 activations: the comparison is of the two paths' composition. bf16
    activations (the weights' default on the amx path) round each value to 8 significant bits,
    so a last-bit difference upstream (the graph's norm against the kernel's) moves a whole
    rounding step and the two paths drift apart by bf16 noise (up to ~1 nat in a log-prob over
    Gemma's 18 layers); the bf16 matmul itself is checked against torch in test_kernels.py and
    the layer kernel's bf16 rows alone against batched below."""
    monkeypatch.setenv("LORAPLANE_KERNEL_ACT", "i16")
    monkeypatch.setenv("LORAPLANE_LAYER", "torch")
    ref = _script(model, sets)
    assert count_calls == []
    monkeypatch.setenv("LORAPLANE_LAYER", "c")
    got = _script(model, sets)
    assert count_calls == calls
    return _compare(ref, got)


@pytest.mark.parametrize("with_lora", [False, True])
def test_gemma_layer_kernel_matches_the_graph(gemma_packed, fixtures_dir: Path, monkeypatch, count_calls, with_lora):
    model = gemma_packed
    sets = [AdapterSet()]
    ids = []
    if with_lora:
        base = model.base
        for i, name in enumerate(("shout", "sea")):
            a = load_lora_adapter(
                fixtures_dir / "adapters" / f"{name}.gguf",
                base_arch=base.arch,
                base_tensors=base.tensor_ne,
                device_for=base.device_of,
                dtype=base.dtype,
            )
            model.adapters.add(900 + i, a)
            ids.append(900 + i)
        shout, sea = (model.adapters.by_id[i] for i in ids)
        sets = [AdapterSet.of({ids[0]: (shout, 1.0)}), AdapterSet.of({ids[0]: (shout, 0.5), ids[1]: (sea, 1.0)})]
    _head_at_int16(model, monkeypatch)
    try:
        n_layer = model.base.hparams.n_layer
        # one call per layer per ubatch
        worst = _kernel_vs_graph(model, sets, monkeypatch, count_calls, [19] * n_layer + [7] * n_layer)
        print(f"gemma lora={with_lora}: max |Δ log-prob| {worst:.3g}")
        assert worst <= LOGP_TOL
    finally:
        for i in ids:
            model.adapters.free(i)


@pytest.fixture(params=[0, 1000], ids=lambda us: f"burst{us}")
def burst_us(request):
    """The pool's burst budget (``library.set_threads(burst_us=)``) for one test, restored after."""
    saved = library.threads_config()
    library.set_threads(burst_us=request.param)
    yield request.param
    library.set_threads(*saved)


def test_gemma_layer_kernel_rows_alone_equal_batched(gemma_packed, monkeypatch, burst_us):
    """A decode row's logits are bit-identical whether its ubatch holds 1 or 5 sequences, under
    the weights' own precisions (bf16 tiles for most of Gemma's layers where the CPU has them),
    with the pool's threads polling within a layer call (burst) or sleeping between its
    dispatches (``LORAPLANE_KERNEL_BURST_US=0``)."""
    assert library.threads_config()[3] == burst_us
    monkeypatch.setenv("LORAPLANE_LAYER", "c")
    monkeypatch.delenv("LORAPLANE_KERNEL_ACT", raising=False)
    acts = {w.resolved_act() for w in gemma_packed.base.weights.values() if isinstance(w, QuantLinear)}
    assert ("bf16" in acts) == cpu.bf16_tiles_supported()
    ctx = gemma_packed.new_context(n_ctx_seq=32, n_seq=5)
    try:
        ctx.set_adapters(AdapterSet())
        prompts = [[2, 10 + s, 300 + 7 * s, 41] for s in range(5)]
        for s, p in enumerate(prompts):
            ctx.decode(UBatch(p, list(range(4)), [s] * 4, [False] * 4))
        batched = ctx.decode(UBatch([77, 78, 79, 80, 81], [4] * 5, list(range(5)), [True] * 5)).logits
        for s in range(5):
            ctx.kv.seq_rm(s, 4)
        for s in range(5):
            alone = ctx.decode(UBatch([77 + s], [4], [s], [True])).logits
            assert torch.equal(alone[0], batched[s])
    finally:
        ctx.close()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2"])
def test_tiny_archs_layer_kernel_matches_the_graph(arch, tmp_path, monkeypatch, count_calls):
    """Each tiny architecture (``tests/helpers/tiny_models.py``) with its matrices quantized
    (Q8_0, Q4_0, Q5_1 in turn), base and with its rank-4 adapter: the kernel takes every dense
    layer (the mixture of experts too, with its adapter's expert LoRA) and gives the graph's
    log-probs."""
    from tests.helpers.gguf_retype import quantize_gguf
    from tests.helpers.tiny_models import MODELS
    from tests.helpers.tiny_models import adapter as tiny_adapter

    T = gguf.GGMLQuantizationType
    src = MODELS[arch](tmp_path / f"{arch}.gguf")
    path = quantize_gguf(src, tmp_path / f"{arch}-q.gguf", [T.Q8_0, T.Q4_0, T.Q5_1])
    base = load_model(path, dtype="f32", device="cpu", weights="packed")
    model = Model(base)
    a = load_lora_adapter(
        tiny_adapter(arch, tmp_path / f"{arch}-lora.gguf"),
        base_arch=base.arch,
        base_tensors=base.tensor_ne,
        device_for=base.device_of,
        dtype=base.dtype,
    )
    model.adapters.add(1, a)
    sets = [AdapterSet(), AdapterSet.of({1: (a, 1.0)})]
    _head_at_int16(model, monkeypatch)
    n_layer = base.hparams.n_layer
    calls = [19] * n_layer + [7] * n_layer  # qwen3moe: the adapter's expert LoRA in the kernel too
    # float rounding through 2 layers (module docstring)
    assert _kernel_vs_graph(model, sets, monkeypatch, count_calls, calls) <= 5e-3


def _moe_model(which: str, fixtures_dir: Path, tmp_path: Path) -> tuple[Model, list[AdapterSet]]:
    """A quantized tiny mixture of experts and the sets [base, adapters]: the llama-MoE fixture
    with its ``moe_lora`` (attn_q, both layers' up experts, layer 1's down experts: pool weights
    and expert side branches) and a synthetic rank-2 LoRA on both routers (``ffn_gate_inp``), or
    the tiny Qwen 3 MoE with a synthetic rank-8 adapter on the attention weights."""
    from bench.synth import ATTENTION_WEIGHT, linear_targets, write_adapter
    from tests.helpers.gguf_retype import quantize_gguf
    from tests.helpers.tiny_models import MODELS

    T = gguf.GGMLQuantizationType
    if which == "llama-moe":
        src = fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"
    else:
        src = MODELS["qwen3moe"](tmp_path / "qwen3moe.gguf")
    base = load_model(quantize_gguf(src, tmp_path / "moe-q.gguf", [T.Q8_0, T.Q4_0, T.Q5_1]), weights="packed")
    model = Model(base)
    if which == "llama-moe":
        path = fixtures_dir / "tiny_moe" / "moe_lora.gguf"
    else:
        targets = linear_targets(base.tensor_ne, pattern=ATTENTION_WEIGHT)
        path = write_adapter(tmp_path / "attn.gguf", arch=base.arch, targets=targets, seed=3, rank=8)
    a = load_lora_adapter(path, base_arch=base.arch, base_tensors=base.tensor_ne, dtype=base.dtype)
    model.adapters.add(1, a)
    if which != "llama-moe":
        return model, [AdapterSet(), AdapterSet.of({1: (a, 1.0)})]
    ne = base.tensor_ne
    routers = [(n, int(ne[n][0]), int(ne[n][1])) for n in ne if n.endswith(".ffn_gate_inp.weight")]
    rpath = write_adapter(tmp_path / "router.gguf", arch=base.arch, targets=routers, seed=4, rank=2)
    r = load_lora_adapter(rpath, base_arch=base.arch, base_tensors=ne, dtype=base.dtype)
    model.adapters.add(2, r)
    return model, [AdapterSet(), AdapterSet.of({1: (a, 1.0), 2: (r, 1.0)})]


@pytest.mark.parametrize("which", ["llama-moe", pytest.param("qwen3moe", marks=pytest.mark.slow)])
def test_moe_layer_kernel_matches_the_graph(which, fixtures_dir: Path, tmp_path, monkeypatch, count_calls):
    """A mixture of experts in the layer kernel (router, top-k, each expert on its rows) gives
    the graph's log-probs, one call per layer per ubatch, and a decode row's logits are
    bit-identical alone or batched (its experts do not depend on the other rows)."""
    model, sets = _moe_model(which, fixtures_dir, tmp_path)
    _head_at_int16(model, monkeypatch)
    n_layer = model.base.hparams.n_layer
    assert _kernel_vs_graph(model, sets, monkeypatch, count_calls, [19] * n_layer + [7] * n_layer) <= 5e-3
    ctx = model.new_context(n_ctx_seq=32, n_seq=4)
    try:
        ctx.set_adapters(sets)
        for s in range(4):
            ctx.decode(UBatch([5, 20 + 3 * s, 7 + s], [0, 1, 2], [s] * 3, [False] * 3))
        ub = UBatch([40, 41, 42, 43], [3] * 4, list(range(4)), [True] * 4)
        ub.set_index = [s % len(sets) for s in range(4)]
        batched = ctx.decode(ub).logits
        for s in range(4):
            ctx.kv.seq_rm(s, 3)
        for s in range(4):
            one = UBatch([40 + s], [3], [s], [True])
            one.set_index = [s % len(sets)]
            assert torch.equal(ctx.decode(one).logits[0], batched[s])
    finally:
        ctx.close()
