"""Quantized matmul kernels (worker.runtime.kernels) against the f32 dequantized reference.

Weights are real GGUF tensors: quantized with ``gguf.quants.quantize`` where the gguf package
can (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16), crafted as random block bytes where it cannot
(Q4_K, Q5_K, Q6_K), written into a tiny GGUF with ``gguf.GGUFWriter`` and read back with
``loraplane.formats.gguf.reader``. The reference is ``loraplane.formats.gguf.reader.dequantize``.

Tolerances (stated per path):

- repack: ``QuantLinear.dequantize()`` and ``get_rows`` equal the reference bit for bit.
- C paths (avx2, avx512) x activation precisions (i16, i8) vs the emulated integer product
  (x quantized per row and per 32 with ``d = amax / 32767`` or ``amax / 127`` — the latter
  is llama.cpp's ``quantize_row_q8_0`` — then ``x_q @ W_ref.T`` in f64):
  ``|y - y_emul| <= 1e-5 * (|x_q| @ |W|.T) + 1e-6`` (f32 accumulation only).
- C paths vs the unquantized ``x @ W_ref.T``: the activation-rounding bound
  ``|y - y_ref| <= sum_k (d_a(row, k) / 2) * |W[:, k]| * 1.001 + 1e-5`` (rigorous: each
  activation moves by at most half its block's step).
- float weights (F32, F16, BF16) and the torch path: ``rtol 1e-5, atol 1e-5`` vs the reference.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants

from loraplane.formats.gguf.reader import dequantize, read_gguf
from tests.helpers.gguf_blocks import weight_array
from worker.runtime import graph as graph_mod
from worker.runtime.graph import GraphContext
from worker.runtime.kernels import (
    KernelError,
    KernelPathError,
    QuantLinear,
    library,
    pack_experts,
    pack_tensor,
    quantize_activations,
    resolve_act,
    resolve_path,
    supported,
)
from worker.runtime.kernels.cpu import bf16_tiles_supported
from worker.runtime.kernels.repack import decode, interleave
from worker.runtime.model import LM_HEAD_RESCORE, ModelError, assign_acts, bf16_tiles_wanted

ACT_QMAX = {"i16": 32767.0, "i8": 127.0}
C_PATHS = [
    pytest.param("avx2", marks=pytest.mark.skipif(not supported("avx2"), reason="CPU lacks AVX2/FMA/F16C")),
    pytest.param(
        "avx512",
        marks=pytest.mark.skipif(
            not supported("avx512"), reason="CPU lacks AVX-512 F/BW/VL/VNNI: only the AVX2 path is tested here"
        ),
    ),
]
K_TYPES = {T.Q4_K, T.Q5_K, T.Q6_K}
# (type, d, k): k not a multiple of 256 wherever the block size allows, d not a multiple of 16
CASES = [
    (T.Q8_0, 40, 96),
    (T.Q8_0, 16, 640),
    (T.Q5_0, 37, 160),
    (T.Q5_0, 64, 640),
    (T.Q4_0, 24, 64),
    (T.Q4_1, 19, 96),
    (T.Q5_1, 33, 128),
    (T.Q4_K, 40, 256),
    (T.Q4_K, 17, 1024),
    (T.Q5_K, 20, 512),
    (T.Q6_K, 40, 256),
    (T.Q6_K, 9, 768),
    (T.F16, 23, 100),
    (T.F32, 31, 72),
    (T.BF16, 18, 64),
]
NS = [1, 3, 16, 64, 70]  # 70 > the kernel's 64-row activation chunk


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    """A tiny GGUF holding one weight per case (name ``w.<TYPE>.<d>x<k>``)."""
    path = tmp_path_factory.mktemp("kernels") / "tiny.gguf"
    rng = np.random.default_rng(1234)
    wr = GGUFWriter(str(path), "llama")
    for t, d, k in CASES:
        arr = weight_array(t, d, k, rng)
        raw = None if t in (T.F32, T.F16) else t
        wr.add_tensor(f"w.{t.name}.{d}x{k}", arr, raw_dtype=raw)
    experts = rng.standard_normal((3, 20, 64)).astype(np.float32) * 0.05  # torch (E, d, k)
    wr.add_tensor("experts.Q5_0", quants.quantize(experts, T.Q5_0), raw_dtype=T.Q5_0)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


@pytest.fixture(scope="module")
def packed(gguf_file: Path) -> dict[str, tuple[QuantLinear, torch.Tensor]]:
    """name -> (packed weight, f32 reference (d, k))."""
    gf = read_gguf(gguf_file)
    out = {}
    for name, rec in gf.tensors.items():
        if len(rec.ne) != 2:
            continue
        ref = torch.from_numpy(np.array(dequantize(gguf_file, rec), dtype=np.float32))
        out[name] = (pack_tensor(rec), ref)
    return out


def _name(t: T, d: int, k: int) -> str:
    return f"w.{t.name}.{d}x{k}"


def _act_quant_emul(x: torch.Tensor, act: str = "i16") -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q as f32 values q*d, per-element step d) as the kernels quantize (i8: exactly
    llama.cpp's quantize_row_q8_0)."""
    qmax = ACT_QMAX[act]
    n, k = x.shape
    xb = x.reshape(n, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / qmax
    inv = torch.where(amax != 0, torch.tensor(qmax) / amax, torch.zeros_like(amax))
    q = (xb * inv).round()  # ties to even, like _mm256_round_ps(_MM_FROUND_TO_NEAREST_INT)
    return (q * d).reshape(n, k), d.expand(-1, -1, 32).reshape(n, k)


@pytest.mark.parametrize("t,d,k", CASES, ids=[_name(*c) for c in CASES])
def test_repack_is_exact(packed, t, d, k):
    ql, ref = packed[_name(t, d, k)]
    assert (ql.d, ql.k) == (d, k)
    assert torch.equal(ql.dequantize(), ref)
    ids = torch.tensor([0, d - 1, d // 2, 0])
    assert torch.equal(ql.get_rows(ids), ref[ids])


@pytest.mark.parametrize("act", ["i16", "i8"])
@pytest.mark.parametrize("path", C_PATHS)
@pytest.mark.parametrize(
    "t,d,k",
    [c for c in CASES if c[0] not in (T.F16, T.F32, T.BF16)],
    ids=[_name(*c) for c in CASES if c[0] not in (T.F16, T.F32, T.BF16)],
)
def test_c_matmul_vs_reference(packed, path, act, t, d, k):
    ql, ref = packed[_name(t, d, k)]
    g = torch.Generator().manual_seed(d * 1000 + k)
    ref64 = ref.double()
    for n in NS:
        x = torch.randn(n, k, generator=g)
        y = ql.matmul(x, path=path, act=act)
        assert y.shape == (n, d) and y.dtype == torch.float32
        xq, step = _act_quant_emul(x, act)
        y_emul = xq.double() @ ref64.T
        mag = xq.abs().double() @ ref64.abs().T
        assert ((y.double() - y_emul).abs() <= 1e-5 * mag + 1e-6).all(), (path, act, n)
        bound = (step.double() / 2) @ ref64.abs().T * 1.001 + 1e-5
        assert ((y.double() - x.double() @ ref64.T).abs() <= bound).all(), (path, act, n)


BF16_CASES = [c for c in CASES if c[0] not in (T.F16, T.F32, T.BF16, T.Q8_0)]


@pytest.mark.skipif(
    not bf16_tiles_supported(), reason="needs the amx path with AMX-BF16, AVX512-BF16 and VBMI (the bf16 tiles)"
)
@pytest.mark.parametrize("t,d,k", BF16_CASES, ids=[_name(*c) for c in BF16_CASES])
def test_bf16_tiles_vs_reference(packed, t, d, k, monkeypatch):
    """The bf16 tiles (``csrc/qmmbf16.cpp``) on every unsigned type, blocks of 32 and Q6_K's 16:
    y equals torch's f64 product of the bf16-rounded x and the exact weights to 4e-7 of
    |x| @ (|W| + 128 |s|) (the tile's f32 sums run over s * (128 + u), whose 128 s * sum(x) the
    scaling cancels: f32 rounding of those larger terms is the kernel's error); a row is the
    same alone, in any batch (1, 3, 16, 17 rows: a zero-padded tile) and with 1 or 2 threads,
    bit for bit; rows with |x| = 250 outliers do not disturb the others."""
    ql, ref = packed[_name(t, d, k)]
    assert ql.takes_bf16 and ql.resolved_act("bf16", "amx") == "bf16"
    g = torch.Generator().manual_seed(d * 1000 + k + 7)
    x = torch.randn(70, k, generator=g)
    x[::9, k // 3] = 250.0
    y = ql.matmul(x, path="amx", act="bf16")
    xb = x.bfloat16().double()
    want = xb @ ref.double().T
    assert ql.scale is not None
    s_el = ql.scale.permute(0, 2, 1).reshape(-1, k // ql.bs)[:d].repeat_interleave(ql.bs, dim=1).double()
    mag = xb.abs() @ (ref.double().abs() + 128 * s_el.abs()).T
    assert ((y.double() - want).abs() <= 4e-7 * mag + 1e-6).all()
    assert not torch.equal(y, ql.matmul(x, path="amx", act="i16"))  # really another precision
    for n in (1, 3, 16, 17):
        for i0 in (0, 70 - n):
            assert torch.equal(ql.matmul(x[i0 : i0 + n], path="amx", act="bf16"), y[i0 : i0 + n])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ql.matmul(x, path="amx", act="bf16"), y)
    finally:
        torch.set_num_threads(threads)


def test_bf16_resolves_to_int16_where_the_tiles_cannot_run(packed, monkeypatch):
    """'bf16' is a weight's choice that only the amx path with the bf16 tiles runs: elsewhere, and
    for Q8_0's signed values on any path, the matmul runs int16 (the same values as 'i16');
    activations are never pre-quantized as bf16."""
    monkeypatch.delenv("LORAPLANE_KERNEL_ACT", raising=False)
    q5, _ = packed[_name(T.Q5_0, 64, 640)]
    q8, _ = packed[_name(T.Q8_0, 16, 640)]
    q6, _ = packed[_name(T.Q6_K, 40, 256)]
    w5, w8 = dataclasses.replace(q5, act="bf16"), dataclasses.replace(q8, act="bf16")
    assert q5.takes_bf16 and q6.takes_bf16 and not q8.takes_bf16
    for path in ("avx2", "avx512"):
        if supported(path):
            assert w5.resolved_act(path=path) == "i16" and w8.resolved_act(path=path) == "i16"
            x = torch.randn(5, 640)
            assert torch.equal(w5.matmul(x, path=path), q5.matmul(x, path=path, act="i16"))
    if supported("amx"):
        assert w8.resolved_act(path="amx") == "i16"
        assert w5.resolved_act(path="amx") == ("bf16" if bf16_tiles_supported() else "i16")
    monkeypatch.setenv("LORAPLANE_KERNEL_ACT", "i16")  # the measurement override wins
    assert w5.resolved_act(path="amx" if supported("amx") else None) == "i16"
    with pytest.raises(KernelError, match="bf16 activations have no quantized form"):
        quantize_activations(torch.randn(2, 640), act="bf16")
    assert resolve_act("bf16") == "bf16"
    with pytest.raises(KernelError, match="expected i16, i8, bf16"):
        resolve_act("fp8")


@pytest.mark.parametrize(
    "t,d,k",
    [c for c in CASES if c[0] in (T.F16, T.F32, T.BF16)],
    ids=[_name(*c) for c in CASES if c[0] in (T.F16, T.F32, T.BF16)],
)
def test_float_weights(packed, t, d, k):
    ql, ref = packed[_name(t, d, k)]
    for n in NS:
        x = torch.randn(n, k)
        torch.testing.assert_close(ql.matmul(x), x @ ref.T, rtol=1e-5, atol=1e-5)


def test_torch_path_and_bf16_input(packed):
    ql, ref = packed[_name(T.Q4_K, 17, 1024)]
    x = torch.randn(3, 1024)
    torch.testing.assert_close(ql.matmul(x, path="torch"), x @ ref.T, rtol=1e-5, atol=1e-5)
    xb = x.to(torch.bfloat16)
    y = ql.matmul(xb)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ql.matmul(xb.float()), rtol=0, atol=0)


@pytest.mark.parametrize("act", ["i16", "i8"])
@pytest.mark.parametrize("path", C_PATHS)
def test_outlier_row_does_not_touch_other_rows(packed, path, act):
    """A row's output alone and inside a batch with a 100x outlier row: identical (each row
    has its own activation scales), so log-probs differ by 0 <= 1e-3."""
    ql, _ = packed[_name(T.Q8_0, 40, 96)]
    x = torch.randn(8, 96)
    x[3] *= 100.0
    x[5, 7] = 3000.0  # a single outlier activation inside a row
    y_batch = ql.matmul(x, path=path, act=act)
    for i in (0, 4, 7):
        y_alone = ql.matmul(x[i : i + 1], path=path, act=act)
        assert torch.equal(y_alone[0], y_batch[i])
        lp = torch.log_softmax(y_batch[i].double(), -1) - torch.log_softmax(y_alone[0].double(), -1)
        assert lp.abs().max() <= 1e-3


@pytest.mark.parametrize("act", ["i16", "i8"])
@pytest.mark.parametrize("path", C_PATHS)
def test_shared_quantized_activations(packed, path, act):
    a, _ = packed[_name(T.Q5_0, 64, 640)]
    b, _ = packed[_name(T.Q6_K, 9, 768)]
    c, _ = packed[_name(T.Q8_0, 16, 640)]
    x = torch.randn(5, 640)
    qa = quantize_activations(x, path, act)
    assert qa.q.dtype == (torch.int16 if act == "i16" else torch.int8)
    assert torch.equal(a.matmul(qa, act=act), a.matmul(x, path=path, act=act))
    assert torch.equal(c.matmul(qa, act=act), c.matmul(x, path=path, act=act))
    with pytest.raises(KernelError, match="width"):
        b.matmul(qa)
    f, _ = packed[_name(T.F32, 31, 72)]
    with pytest.raises(KernelError, match="float activations"):
        f.matmul(qa)


@pytest.mark.parametrize("path", C_PATHS)
def test_per_weight_act_is_honored(packed, path, monkeypatch):
    """``QuantLinear.act`` picks the kernel of each weight; ``$LORAPLANE_KERNEL_ACT`` overrides
    it for every weight; an explicit ``act=`` overrides both; pre-quantized activations of the
    other precision are refused."""
    monkeypatch.delenv("LORAPLANE_KERNEL_ACT", raising=False)
    base, _ = packed[_name(T.Q5_0, 64, 640)]
    w8 = dataclasses.replace(base, act="i8")
    w16 = dataclasses.replace(base, act="i16")
    x = torch.randn(4, 640)
    y8 = base.matmul(x, path=path, act="i8")
    y16 = base.matmul(x, path=path, act="i16")
    assert not torch.equal(y8, y16)  # the two precisions are distinguishable here
    assert torch.equal(w8.matmul(x, path=path), y8)
    assert torch.equal(w16.matmul(x, path=path), y16)
    assert torch.equal(w8.matmul(x, path=path, act="i16"), y16)
    assert torch.equal(w8.matmul(quantize_activations(x, path, "i8")), y8)
    with pytest.raises(KernelError, match="quantized as i16, this weight runs i8"):
        w8.matmul(quantize_activations(x, path, "i16"))
    monkeypatch.setenv("LORAPLANE_KERNEL_ACT", "i16")  # forced override, for measurement
    assert w8.resolved_act() == "i16"
    assert torch.equal(w8.matmul(x, path=path), y16)
    monkeypatch.setenv("LORAPLANE_KERNEL_ACT", "i8")
    assert torch.equal(w16.matmul(x, path=path), y8)


@pytest.mark.parametrize("path", C_PATHS)
def test_group_with_mixed_acts_batched_equals_alone(packed, path, monkeypatch):
    """``build_lora_mm_group`` over weights of both precisions: each output equals that weight's
    own matmul (its act honored), ``x`` is quantized once per precision used by more than one
    weight, and every row is bit-identical alone or in the batch."""
    monkeypatch.delenv("LORAPLANE_KERNEL_ACT", raising=False)
    monkeypatch.setenv("LORAPLANE_KERNELS", path)
    a, _ = packed[_name(T.Q5_0, 64, 640)]
    c, _ = packed[_name(T.Q8_0, 16, 640)]
    ws = {
        "a16": dataclasses.replace(a, act="i16"),
        "c8": dataclasses.replace(c, act="i8"),
        "a8": dataclasses.replace(a, act="i8"),
        "c16": dataclasses.replace(c, act="i16"),
    }
    names = tuple(ws)
    g = GraphContext(ws, inputs=None, plan=SimpleNamespace(empty=True), kv=None, dtype=torch.float32)  # type: ignore[arg-type]
    made: list[str] = []
    real = graph_mod.quantize_activations

    def counting(x, path=None, act=None):
        made.append(act)
        return real(x, path, act)

    monkeypatch.setattr(graph_mod, "quantize_activations", counting)
    x = torch.randn(6, 640)
    x[2] *= 100.0
    out = g.build_lora_mm_group(names, x)
    assert sorted(made) == ["i16", "i8"]
    for name, y in zip(names, out, strict=True):
        assert torch.equal(y, ws[name].matmul(x)), name
    assert not torch.equal(out[0], out[2])  # a at i16 vs a at i8
    for i in range(x.shape[0]):
        alone = g.build_lora_mm_group(names, x[i : i + 1])
        for name, y_b, y_a in zip(names, out, alone, strict=True):
            assert torch.equal(y_b[i], y_a[0]), (name, i)


@pytest.mark.parametrize("path", C_PATHS)
@pytest.mark.parametrize(
    "form",
    [(T.Q5_0, 37, 160), (T.Q8_0, 40, 96), (T.Q4_K, 17, 1024), (T.Q6_K, 9, 768)],
    ids=["q5_0-implicit-bias", "q8_0-signed", "q4_k-stored-bias", "q6_k-bs16"],
)
def test_rescore_top_outputs_with_i16(packed, path, form, monkeypatch):
    """``rescore=K`` on an int8 weight (each weight form the C re-score dispatches on; d not a
    multiple of 16: the last group padded): each row's K largest int8 outputs (ties: the lower
    column) carry the i16 kernel's values bit for bit, every other output the int8 value; rows
    are independent (alone = batched, a 100x outlier row beside them)."""
    monkeypatch.delenv("LORAPLANE_KERNEL_ACT", raising=False)
    t, d, k = form
    base, _ = packed[_name(t, d, k)]
    w = dataclasses.replace(base, act="i8", rescore=5)
    x = torch.randn(7, k)
    x[4] *= 100.0
    y8 = base.matmul(x, path=path, act="i8")
    y16 = base.matmul(x, path=path, act="i16")
    y = w.matmul(x, path=path)
    top = torch.sort(y8, dim=-1, descending=True, stable=True).indices[:, :5]
    mask = torch.zeros_like(y, dtype=torch.bool).scatter_(1, top, True)
    assert torch.equal(y[mask], y16[mask])
    assert torch.equal(y[~mask], y8[~mask])
    assert not torch.equal(y, y8)
    for i in range(x.shape[0]):
        assert torch.equal(w.matmul(x[i : i + 1], path=path)[0], y[i])
    assert torch.equal(w.matmul(x, path=path, act="i16"), y16)  # no re-score when run at i16


@pytest.mark.parametrize("path", C_PATHS)
def test_rescore_candidates_of_a_wide_head(path, monkeypatch):
    """On a head wide enough for the re-score's span search (``csrc/qmm16.cpp`` top_columns:
    maxima of 256-column spans, then only the spans that can hold a top entry), each row's
    re-scored columns are exactly a full scan's top K of the int8 outputs: equal outputs in
    different spans (duplicated weight rows) keep the lower column, the columns past the last
    whole span take part, and rows stay independent."""
    monkeypatch.delenv("LORAPLANE_KERNEL_ACT", raising=False)
    rng = np.random.default_rng(11)
    d, k = 70 * 256 + 37, 64
    u = rng.standard_normal(k).astype(np.float32)
    w = rng.standard_normal((d, k)).astype(np.float32) * 0.05
    dup = [7, 300, 5000, 9001, d - 5]  # the last one past the last whole span
    w[dup] = u * 0.2
    w[[40, 41, 9002]] = u * 0.19  # just below the duplicates: candidates beside them
    aff = decode(quants.quantize(w, T.Q8_0).reshape(-1), T.Q8_0, d, k)
    qw, sc, _ = interleave(aff)
    base = QuantLinear(
        "wide",
        T.Q8_0,
        k,
        d,
        torch.device("cpu"),
        qw=torch.from_numpy(qw),
        scale=torch.from_numpy(sc),
        bs=32,
        signed=True,
    )
    head = dataclasses.replace(base, act="i8", rescore=LM_HEAD_RESCORE)
    x = torch.from_numpy(rng.standard_normal((5, k)).astype(np.float32)) + torch.from_numpy(u) * 2
    y8 = base.matmul(x, path=path, act="i8")
    y16 = base.matmul(x, path=path, act="i16")
    y = head.matmul(x, path=path)
    top = torch.sort(y8, dim=-1, descending=True, stable=True).indices[:, :LM_HEAD_RESCORE]
    assert set(dup) <= set(top[0].tolist())
    mask = torch.zeros_like(y, dtype=torch.bool).scatter_(1, top, True)
    assert torch.equal(y[mask], y16[mask])
    assert torch.equal(y[~mask], y8[~mask])
    for i in range(x.shape[0]):
        assert torch.equal(head.matmul(x[i : i + 1], path=path)[0], y[i])
    # outputs laid out by hand (the re-score reads its candidates from the outputs it is
    # given): one top entry per span, so the K-th largest entry is itself a span's maximum (the
    # bound the search must include), two equal entries in different spans at the cut (the
    # lower column wins), an entry past the last whole span just below the cut
    yy = torch.full((2, d), -1000.0)
    for s_ in range(70):
        yy[:, s_ * 256 + (s_ * 37) % 256] = float(s_)
    yy[:, 3 * 256 + 200] = float(70 - LM_HEAD_RESCORE)  # ties with span 70-K's entry, lower column
    yy[:, d - 3] = 70 - LM_HEAD_RESCORE - 0.5
    want = torch.sort(yy, dim=-1, descending=True, stable=True).indices[:, :LM_HEAD_RESCORE]
    got = head._rescore_top(x[:2], yy.clone(), path)
    changed = torch.zeros_like(yy, dtype=torch.bool).scatter_(1, want, True)
    assert torch.equal(got[changed], y16[:2][changed])
    assert torch.equal(got[~changed], yy[~changed])


def test_assign_acts_policy(packed, monkeypatch):
    """The load-time policy: 'none' gives int16 to every weight; 'lm_head' gives int8
    activations (with the int16 re-score of the top candidates) to the LM head only
    (``output.weight`` when the model has one, else the tied ``token_embd``); float weights
    untouched; an unknown policy is refused."""
    q8, _ = packed[_name(T.Q8_0, 16, 640)]
    q5, _ = packed[_name(T.Q5_0, 64, 640)]
    f, _ = packed[_name(T.F32, 31, 72)]
    monkeypatch.delenv("LORAPLANE_INT8_WEIGHTS", raising=False)
    tied = {"token_embd.weight": dataclasses.replace(q8), "blk.0.attn_q.weight": dataclasses.replace(q5)}
    assert assign_acts(tied) == {}
    assert [w.act for w in tied.values()] == ["i16", "i16"]
    assert assign_acts(tied, "lm_head") == {"token_embd.weight": "i8"}
    assert [w.act for w in tied.values()] == ["i8", "i16"]
    assert tied["token_embd.weight"].rescore == LM_HEAD_RESCORE
    untied = {
        "token_embd.weight": dataclasses.replace(q8),
        "output.weight": dataclasses.replace(q8),
        "blk.0.ffn_down.weight": dataclasses.replace(q5),
    }
    monkeypatch.setenv("LORAPLANE_INT8_WEIGHTS", "lm_head")
    assert assign_acts(untied) == {"output.weight": "i8"}
    assert [w.act for w in untied.values()] == ["i16", "i8", "i16"]
    float_head = {"output.weight": dataclasses.replace(f)}
    assert assign_acts(float_head) == {}
    # layer kinds, alone or with the head: every layer's weights of those kinds, nothing else
    layers = {
        "token_embd.weight": dataclasses.replace(q8),
        "blk.0.ffn_down.weight": dataclasses.replace(q5),
        "blk.1.ffn_down.weight": dataclasses.replace(q5),
        "blk.1.ffn_up.weight": dataclasses.replace(q5),
        "blk.1.attn_q.weight": dataclasses.replace(q5),
        "blk.1.attn_q_norm.weight": dataclasses.replace(f),
    }
    assert assign_acts(layers, "ffn_down,lm_head") == {
        "token_embd.weight": "i8",
        "blk.0.ffn_down.weight": "i8",
        "blk.1.ffn_down.weight": "i8",
    }
    assert [w.act for w in layers.values()][3:5] == ["i16", "i16"]
    assert assign_acts(layers, "ffn_in,attn_qkv") == {"blk.1.ffn_up.weight": "i8", "blk.1.attn_q.weight": "i8"}
    with pytest.raises(ModelError, match="unknown int8 policy 'ffn_in,mlp'"):
        assign_acts(layers, "ffn_in,mlp")
    # the architecture's measured default when the environment says nothing (Qwen 2: the head and
    # every layer kind; Gemma 3: the head; the rest: int16), and the environment over it
    kinds = {"token_embd.weight": "i8", "blk.1.ffn_up.weight": "i8", "blk.1.attn_q.weight": "i8",
             "blk.0.ffn_down.weight": "i8", "blk.1.ffn_down.weight": "i8"}  # fmt: skip
    monkeypatch.delenv("LORAPLANE_INT8_WEIGHTS")
    fresh = lambda: {n: dataclasses.replace(w, act="i16", rescore=0) for n, w in layers.items()}  # noqa: E731
    assert assign_acts(fresh(), arch="qwen2") == kinds
    gemma = fresh()
    assert assign_acts(gemma, arch="gemma3") == {"token_embd.weight": "i8"}
    assert gemma["token_embd.weight"].rescore == LM_HEAD_RESCORE
    assert assign_acts(fresh(), arch="llama") == {}
    monkeypatch.setenv("LORAPLANE_INT8_WEIGHTS", "none")
    assert assign_acts(fresh(), arch="qwen2") == {}
    monkeypatch.setenv("LORAPLANE_INT8_WEIGHTS", "everything")
    with pytest.raises(ModelError, match="LORAPLANE_INT8_WEIGHTS='everything'"):
        assign_acts(float_head)
    # bf16: the weights left at int16 that the bf16 tiles take (not Q8_0, not float weights)
    monkeypatch.setenv("LORAPLANE_INT8_WEIGHTS", "lm_head")
    both = fresh()
    assert assign_acts(both, bf16=True) == {
        "token_embd.weight": "i8",
        "blk.0.ffn_down.weight": "bf16",
        "blk.1.ffn_down.weight": "bf16",
        "blk.1.ffn_up.weight": "bf16",
        "blk.1.attn_q.weight": "bf16",
    }
    assert both["blk.1.attn_q_norm.weight"].act == "i16"
    monkeypatch.delenv("LORAPLANE_BF16_TILES", raising=False)
    assert bf16_tiles_wanted()
    monkeypatch.setenv("LORAPLANE_BF16_TILES", "0")
    assert not bf16_tiles_wanted()
    monkeypatch.setenv("LORAPLANE_BF16_TILES", "yes")
    with pytest.raises(ModelError, match="LORAPLANE_BF16_TILES='yes': expected 0 or 1"):
        bf16_tiles_wanted()


def test_expert_weights(gguf_file):
    gf = read_gguf(gguf_file)
    rec = gf.tensors["experts.Q5_0"]
    ref = torch.from_numpy(np.array(dequantize(gguf_file, rec), dtype=np.float32))  # (E, d, k)
    experts = pack_experts(rec)
    assert len(experts) == 3
    x = torch.randn(4, 64)
    for e, ql in enumerate(experts):
        assert torch.equal(ql.dequantize(), ref[e])
        xq, _ = _act_quant_emul(x)
        torch.testing.assert_close(ql.matmul(x, act="i16"), xq @ ref[e].T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", ["i16", "i8"])
@pytest.mark.parametrize("path", C_PATHS)
def test_thread_count_does_not_change_results(packed, path, act):
    ql, _ = packed[_name(T.Q6_K, 9, 768)]
    x = torch.randn(16, 768)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = ql.matmul(x, path=path, act=act)
        torch.set_num_threads(2)
        y2 = ql.matmul(x, path=path, act=act)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(y1, y2)


def test_path_resolution(monkeypatch):
    assert resolve_path("torch") == "torch"
    with pytest.raises(KernelPathError, match="unknown"):
        resolve_path("neon")
    monkeypatch.setenv("LORAPLANE_KERNELS", "torch")
    assert resolve_path() == "torch"
    monkeypatch.setenv("LORAPLANE_KERNELS", "auto")
    assert resolve_path() in ("amx", "avx512", "avx2", "torch")
    monkeypatch.delenv("LORAPLANE_KERNEL_ACT", raising=False)
    assert resolve_act() == "i16"
    monkeypatch.setenv("LORAPLANE_KERNEL_ACT", "i8")
    assert resolve_act() == "i8"
    with pytest.raises(KernelError, match="precision"):
        resolve_act("i4")


def test_errors(packed):
    ql, _ = packed[_name(T.Q8_0, 40, 96)]
    with pytest.raises(KernelError, match="width"):
        ql.matmul(torch.randn(2, 64))
    with pytest.raises(KernelError, match="out of range"):
        ql.get_rows(torch.tensor([40]))


def test_avx2_library_has_no_avx512_instructions():
    """The AVX2 build must run on an AVX2-only CPU: no zmm registers, no opmask registers."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump not installed")
    asm = subprocess.run(
        [objdump, "-d", str(library.library_path("avx2"))], capture_output=True, text=True, check=True
    ).stdout
    assert "zmm" not in asm and "%k1" not in asm and "{k" not in asm
    asm5 = subprocess.run(
        [objdump, "-d", str(library.library_path("avx512"))], capture_output=True, text=True, check=True
    ).stdout
    assert "vpdpbusd" in asm5
