"""Paged attention kernels (``worker.gpu.kernels.attention``) against the f64 reference
of the module's semantics, on CUDA or under Triton's interpreter (``tests/helpers/gpu.py``);
FlashInfer's backend against the same reference on a GPU that has it.

Cases: block tables whose pages are scattered (a random permutation of the pool, never
contiguous), rows of different lengths in one batch, lengths not multiples of the block size
(1, 17, 40, …), GQA ratios 1/4/8, head dims 64/128/256, a sliding window, logit soft-capping,
1 and several split-K pieces, f32/bf16/f16, padding rows of the KV write.

Tolerances (max abs error vs the f64 reference; V entries are N(0, 1), so outputs are O(1)):
f32 1e-5 (IEEE f32 dots, f32 softmax; measured ≤ 3e-6); bf16 3e-2 and f16 4e-3 (q·k in the
16-bit inputs with f32 accumulation, probabilities rounded to V's dtype before the V product,
FlashAttention's order; under the interpreter bf16 rounding truncates, measured ≤ 1.2e-2 /
≤ 5e-4).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.gpu import NO_TRITON, TRITON
from worker.gpu.kernels import flashinfer_backend, triton_env
from worker.gpu.kernels.attention import (
    attention_reference,
    decode_attention_reference,
    gather_pages,
    kv_write,
    kv_write_reference,
    paged_decode_attention,
    prefill_attention,
)

needs_triton = pytest.mark.skipif(not TRITON, reason=NO_TRITON)

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _paged(B, h_kv, D, block_size, max_blocks, dtype, device, seed, n_blocks=None):
    """K/V pools ``(n_blocks, block_size, H_kv, D)`` and a block table of scattered pages: row b
    owns ``max_blocks`` distinct pages of a random permutation of the pool."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = n_blocks or B * max_blocks + 3
    kc = torch.randn(n_blocks, block_size, h_kv, D, generator=g).to(dtype).to(device)
    vc = torch.randn(n_blocks, block_size, h_kv, D, generator=g).to(dtype).to(device)
    perm = torch.randperm(n_blocks, generator=g)[: B * max_blocks].view(B, max_blocks)
    return kc, vc, perm.to(torch.int32).to(device)


def _decode_case(device, dtype, *, lens, H, h_kv, D, block_size=16, window=0, softcap=0.0, splits=1, seed=0):
    B = len(lens)
    max_blocks = -(-max(lens) // block_size) + 1
    kc, vc, table = _paged(B, h_kv, D, block_size, max_blocks, dtype, device, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(B, H, D, generator=g).to(dtype).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = D**-0.5
    out = paged_decode_attention(
        q, kc, vc, table, seq_lens, scale=scale, window=window, softcap=softcap, num_splits=splits
    )
    ref = decode_attention_reference(q, kc, vc, table, seq_lens, scale=scale, window=window, softcap=softcap)
    assert out.dtype == dtype and out.shape == (B, H, D)
    err = float((out.double() - ref).abs().max())
    assert err <= TOL[dtype], f"max abs error {err:.3g} > {TOL[dtype]:.3g}"
    return out, ref, (q, kc, vc, table, seq_lens)


# --- fast tier --------------------------------------------------------------------------------


@needs_triton
def test_decode_gqa_scattered_pages_f32(device):
    """GQA 4, lengths 1/17/40 over scattered 16-position pages, three split-K pieces."""
    _decode_case(device, torch.float32, lens=(1, 17, 40), H=8, h_kv=2, D=64, splits=3)


@needs_triton
def test_decode_window_and_softcap(device):
    """A sliding window of 5 (rows longer and shorter than it) and soft-cap 20, two splits; the
    window does change the answer of the long row."""
    out, ref, inputs = _decode_case(
        device, torch.float32, lens=(3, 29), H=4, h_kv=1, D=64, window=5, softcap=20.0, splits=2, seed=3
    )
    unwindowed = decode_attention_reference(*inputs, scale=64**-0.5, softcap=20.0)
    assert float((unwindowed[1] - ref[1]).abs().max()) > 0.1
    assert torch.equal(unwindowed[0], ref[0])  # a row shorter than the window sees every key


@needs_triton
def test_empty_row_gives_zeros(device):
    """A row of length 0 (an idle graph slot) yields zeros, with one split and with several."""
    for splits in (1, 2):
        out, _, _ = _decode_case(device, torch.float32, lens=(0, 5), H=2, h_kv=2, D=64, splits=splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))


@needs_triton
def test_kv_write_skips_padding_rows(device):
    """New tokens land at their flat slots (any page, any offset), cast to the cache dtype;
    a slot of -1 (a padding row) writes nothing."""
    g = torch.Generator().manual_seed(0)
    kc = torch.zeros(6, 4, 2, 64, dtype=torch.bfloat16, device=device)
    vc = torch.zeros(6, 4, 2, 32, dtype=torch.bfloat16, device=device)
    # f32 inputs holding bf16 values: the cast is exact whatever its rounding (the interpreter
    # truncates, torch and the GPU round to nearest)
    k = torch.randn(5, 2, 64, generator=g).bfloat16().float().to(device)
    v = torch.randn(5, 2, 32, generator=g).bfloat16().float().to(device)
    slots = torch.tensor([3, 17, -1, 0, 23], dtype=torch.int64, device=device)
    kv_write(kc, vc, slots, k, v)
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    kv_write_reference(kr, vr, slots, k, v)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    assert torch.equal(kc[4, 1], k[1].to(torch.bfloat16))  # slot 17 = page 4, offset 1
    assert int((kc != 0).any(-1).any(-1).sum()) == 4  # four positions written, padding dropped


def test_prefill_matches_reference():
    """Prefill over pages (torch SDPA; explicit softmax when soft-capped): a chunk at pos0 = 13
    after earlier tokens, GQA 4, with and without window / soft-cap, bf16 and f32."""
    kc, vc, table = _paged(1, 2, 64, 8, 5, torch.float32, torch.device("cpu"), 0)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(9, 8, 64, generator=g)
    pos0, end = 13, 22
    k, v = gather_pages(kc, table[0], end), gather_pages(vc, table[0], end)
    for window, softcap in ((0, 0.0), (6, 0.0), (0, 10.0), (6, 10.0)):
        ref = attention_reference(
            q, k, v, torch.arange(pos0, end), torch.arange(end), scale=0.125, window=window, softcap=softcap
        )
        out = prefill_attention(q, kc, vc, table[0], pos0, scale=0.125, window=window, softcap=softcap)
        assert float((out.double() - ref).abs().max()) < 1e-5
        out16 = prefill_attention(
            q.bfloat16(), kc.bfloat16(), vc.bfloat16(), table[0], pos0, scale=0.125, window=window, softcap=softcap
        )
        assert float((out16.double() - ref).abs().max()) < 6e-2


def test_flashinfer_page_list_and_backend_choice(monkeypatch):
    """The block table as FlashInfer's CSR page list; the backend falls back to Triton without
    CUDA and refuses a forced FlashInfer there."""
    table = torch.tensor([[7, 2, 9], [4, 0, 0], [5, 6, 1]], dtype=torch.int32)
    indptr, indices, last = flashinfer_backend.paged_kv_csr(table, torch.tensor([33, 16, 0]), 16)
    assert indptr.tolist() == [0, 3, 4, 4]
    assert indices.tolist() == [7, 2, 9, 4]
    assert last.tolist() == [1, 16, 0]
    cpu = torch.device("cpu")
    monkeypatch.delenv("LORAPLANE_GPU_ATTN", raising=False)
    assert flashinfer_backend.select_backend(cpu) == "triton"
    with pytest.raises(ValueError, match="needs CUDA"):
        flashinfer_backend.select_backend(cpu, "flashinfer")
    with pytest.raises(ValueError, match="must be one of"):
        flashinfer_backend.select_backend(cpu, "flash")


def test_errors_say_what_is_wrong(device, monkeypatch):
    kc, vc, table = _paged(2, 2, 64, 16, 2, torch.float32, torch.device("cpu"), 0)
    q, lens = torch.randn(2, 8, 64), torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens int32"):
        paged_decode_attention(q, kc, vc, table, lens.long(), scale=0.1)
    with pytest.raises(ValueError, match="block_tables int32"):
        paged_decode_attention(q, kc, vc, table.long(), lens, scale=0.1)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        kv_write(kc, vc, torch.zeros(1, dtype=torch.int32), torch.zeros(1, 2, 64), torch.zeros(1, 2, 64))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(triton_env.KernelUnavailableError, match="TRITON_INTERPRET=1"):
        paged_decode_attention(q, kc, vc, table, lens, scale=0.1)


# --- slow tier: the sweep --------------------------------------------------------------------


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("H,h_kv", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_decode_sweep(device, D, H, h_kv, dtype):
    """Head dims × GQA ratios × dtypes, lengths 1..45 around the block size, each with plain,
    windowed + soft-capped (Gemma 2's 50) and split-K variants."""
    lens = (1, 16, 17, 45)
    _decode_case(device, dtype, lens=lens, H=H, h_kv=h_kv, D=D, splits=1, seed=D + H)
    _decode_case(device, dtype, lens=lens, H=H, h_kv=h_kv, D=D, window=8, softcap=50.0, splits=3, seed=D + h_kv)


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_decode_block_sizes_f16(device, block_size):
    """Pages of 1, 8 and 32 positions (a 32-position page is one ``BLOCK_N`` step), f16."""
    _decode_case(device, torch.float16, lens=(2, 33, 50), H=6, h_kv=2, D=128, block_size=block_size, splits=2)


GPU_ONLY = "needs a CUDA GPU"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU_ONLY)
def test_decode_in_a_graph_follows_new_lengths():
    """Captured once, decode attention follows block tables and lengths rewritten between
    replays (sequences coming and going). Qwen2.5-1.5B heads: 12/2 of 128, bf16, 64 rows."""
    dev = torch.device("cuda")
    B, max_blocks = 64, 64
    kc, vc, table = _paged(B, 2, 128, 16, max_blocks, torch.bfloat16, dev, 0)
    q = torch.randn(B, 12, 128, device=dev, dtype=torch.bfloat16)
    lens = torch.full((B,), 5, dtype=torch.int32, device=dev)
    out = paged_decode_attention(q, kc, vc, table, lens, scale=128**-0.5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, kc, vc, table, lens, scale=128**-0.5, out=out)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        lens.copy_(torch.randint(1, max_blocks * 16, (B,), generator=g).to(torch.int32))
        table.copy_(table[torch.randperm(B, generator=g).to(dev)])
        graph.replay()
        ref = decode_attention_reference(q, kc, vc, table, lens, scale=128**-0.5)
        assert float((out.double() - ref).abs().max()) <= TOL[torch.bfloat16]


@pytest.mark.cuda
@pytest.mark.skipif(
    not (torch.cuda.is_available() and flashinfer_backend.flashinfer_available(torch.device("cuda"))),
    reason="needs a CUDA GPU and FlashInfer (the 'cuda' extra)",
)
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (32, 50.0)])
def test_flashinfer_matches_reference(window, softcap):
    """FlashInfer's decode and prefill on our page layout equal the reference (and so our
    Triton kernel), with Gemma's window and soft-cap."""
    dev = torch.device("cuda")
    lens = [1, 17, 100, 257]
    B, D, H, h_kv, bs = len(lens), 256, 8, 4, 16
    kc, vc, table = _paged(B, h_kv, D, bs, 18, torch.bfloat16, dev, 0)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
    dec = flashinfer_backend.FlashInferDecode(dev)
    kw = dict(n_head=H, n_head_kv=h_kv, head_dim=D, block_size=bs, scale=D**-0.5, window=window, softcap=softcap)
    dec.plan(table, seq_lens, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, **kw)
    ref = decode_attention_reference(q, kc, vc, table, seq_lens, scale=D**-0.5, window=window, softcap=softcap)
    assert float((dec.run(q, kc, vc).double() - ref).abs().max()) <= TOL[torch.bfloat16]
    # prefill: the last 9 positions of rows 2 and 3 as new rows
    pre = flashinfer_backend.FlashInferPrefill(dev)
    qp = torch.randn(18, H, D, device=dev, dtype=torch.bfloat16)
    qo = torch.tensor([0, 9, 18], dtype=torch.int32, device=dev)
    pre.plan(qo, table[2:], seq_lens[2:], q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, **kw)
    got = pre.run(qp, kc, vc)
    for i, b in enumerate((2, 3)):
        n = lens[b]
        want = prefill_attention(
            qp[9 * i : 9 * i + 9], kc, vc, table[b], n - 9, scale=D**-0.5, window=window, softcap=softcap
        )
        assert float((got[9 * i : 9 * i + 9].double() - want.double()).abs().max()) <= 2 * TOL[torch.bfloat16]
