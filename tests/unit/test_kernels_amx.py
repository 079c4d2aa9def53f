"""The ``amx`` kernel path: int8-activation (``csrc/qmm8_amx.h``) and int16-activation
(``csrc/qmm16_amx.h``, byte split ``q = 256 hi + lo``) matmuls on AMX tiles.

Promise tested here: the amx path's int8 results are **bit-identical** to the avx512 int8
kernel (``csrc/qmm8.h``, ``vpdpbusd``) for every repacked GGUF type, at ragged batch sizes
(1 and 3 run the vpdpbusd code inside the amx library; 12 one zero-padded tile for bs 32,
vpdpbusd for bs 16; 14 a padded tile for both; 16 and 512 whole tiles; 17 a tile + one
vpdpbusd row; 29 a tile + a padded tail tile (bs 32) or 13 vpdpbusd rows (bs 16); 30 a tile +
a padded tail tile), ``d`` not a
multiple of 16 and ``k`` not a multiple of 256 where the block allows; so a row's result is
also the same alone or batched and with 1 or 2 threads. The int16 results likewise equal the
avx512 ``vpdpwssd`` kernel's bit for bit (bs 32 on tiles, bs 16 on ``vpdpwssd``; cases in
``test_amx_int16_bit_identical_to_avx512``). The accuracy of the avx512 int8 kernel itself against the
dequantized reference is tested in ``test_kernels.py``.

Weights: real GGUF block bytes written with ``gguf.GGUFWriter`` and read back with
``loraplane.formats.gguf.reader`` (``tests.helpers.gguf_blocks.weight_array``: gguf's quantizer where it has one,
random valid blocks for the K-quants).
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from loraplane.formats.gguf.reader import dequantize, read_gguf
from tests.helpers.gguf_blocks import weight_array
from worker.runtime.kernels import KernelPathError, QuantLinear, cpu, library, pack_tensor, quantize_activations

AMX = cpu.amx_unavailable_reason() is None
needs_amx = pytest.mark.skipif(not AMX, reason=f"amx path unavailable here: {cpu.amx_unavailable_reason()}")
needs_avx512 = pytest.mark.skipif(not cpu.supported("avx512"), reason="CPU lacks AVX-512 F/BW/VL/VNNI")

# (type, d, k): every repacked type; d not a multiple of 16; k a multiple of the block size,
# not of 256 where the type allows (odd and even block counts per row for the block pairs).
CASES = [
    (T.Q8_0, 40, 96),
    (T.Q8_0, 33, 640),
    (T.Q4_0, 37, 160),
    (T.Q4_1, 19, 224),
    (T.Q5_0, 24, 640),
    (T.Q5_1, 33, 128),
    (T.Q4_K, 40, 256),
    (T.Q4_K, 17, 768),
    (T.Q5_K, 20, 512),
    (T.Q6_K, 9, 256),
    (T.Q6_K, 40, 768),
]
NS = [1, 3, 12, 14, 16, 17, 29, 30, 512]
SOME = [CASES[1], CASES[7], CASES[10]]  # Q8_0 (signed), Q4_K (stored bias), Q6_K (bs 16)
SOME_IDS = [f"w.{t.name}.{d}x{k}" for t, d, k in SOME]


def _name(t: T, d: int, k: int) -> str:
    return f"w.{t.name}.{d}x{k}"


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> dict[str, tuple[QuantLinear, torch.Tensor]]:
    """name -> (packed weight, f32 reference (d, k)) from a tiny GGUF of CASES."""
    path: Path = tmp_path_factory.mktemp("amx") / "tiny.gguf"
    rng = np.random.default_rng(4321)
    wr = GGUFWriter(str(path), "llama")
    for t, d, k in CASES:
        wr.add_tensor(_name(t, d, k), weight_array(t, d, k, rng), raw_dtype=t)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    gf = read_gguf(path)
    return {
        n: (pack_tensor(r), torch.from_numpy(np.array(dequantize(path, r), dtype=np.float32)))
        for n, r in gf.tensors.items()
    }


def _x(n: int, k: int, seed: int) -> torch.Tensor:
    """Activations with Gemma-like outliers: one row 100x, one element 3000."""
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if n > 2:
        x[1] *= 100.0
        x[n - 1, k // 3] = 3000.0
    return x


@needs_amx
@needs_avx512
@pytest.mark.parametrize("t,d,k", CASES, ids=[_name(*c) for c in CASES])
def test_amx_int8_bit_identical_to_avx512(packed, t, d, k):
    ql, ref = packed[_name(t, d, k)]
    for n in NS:
        x = _x(n, k, seed=n * 7 + d)
        y_amx = ql.matmul(x, path="amx", act="i8")
        y_vnni = ql.matmul(x, path="avx512", act="i8")
        assert y_amx.shape == (n, d)
        assert torch.equal(y_amx, y_vnni), (n, (y_amx - y_vnni).abs().max().item())
        # not vacuous: the product is the real one (well inside the activation-rounding bound
        # of test_kernels.py; here a loose sanity bound against the f32 reference)
        y_ref = x.double() @ ref.double().T
        assert ((y_amx.double() - y_ref).abs() <= 0.02 * y_ref.abs().max() + 1e-3).all(), n


NS16 = [1, 3, 12, 15, 16, 17, 29, 31, 512]


@needs_amx
@needs_avx512
@pytest.mark.parametrize("t,d,k", CASES, ids=[_name(*c) for c in CASES])
def test_amx_int16_bit_identical_to_avx512(packed, t, d, k):
    """int16 activations on tiles (q = 256 hi + lo, csrc/qmm16_amx.h) equal the avx512
    vpdpwssd kernel bit for bit. bs 32: n < 15 and a rest of 1 (17) or 13 (29) run vpdpwssd,
    16 and 512 whole tiles, 15 and 31 a zero-padded tile; bs 16 (Q6_K, Q4_K, Q5_K) runs
    vpdpwssd inside the amx library (tiles do not pay there)."""
    ql, ref = packed[_name(t, d, k)]
    for n in NS16:
        x = _x(n, k, seed=n * 5 + d)
        y_amx = ql.matmul(x, path="amx", act="i16")
        y_vnni = ql.matmul(x, path="avx512", act="i16")
        assert y_amx.shape == (n, d)
        assert torch.equal(y_amx, y_vnni), (n, (y_amx - y_vnni).abs().max().item())
        y_ref = x.double() @ ref.double().T
        assert ((y_amx.double() - y_ref).abs() <= 1e-3 * y_ref.abs().max() + 1e-4).all(), n


@needs_amx
@needs_avx512
def test_amx_int16_extreme_activations(packed):
    """Every int16 value's byte split: a row holding -32767, 32767, -256, -255, 255, 256, 0,
    -1 per block (the hi/lo split at its edges); Q8_0 (signed weights), Q4_K (stored bias),
    Q5_0 (implicit bias), 16 rows: one whole tile."""
    for name in (_name(T.Q8_0, 33, 640), _name(T.Q4_K, 17, 768), _name(T.Q5_0, 24, 640)):
        ql, ref = packed[name]
        k = ref.shape[1]
        x = torch.zeros(16, k)
        edges = torch.tensor([-32767.0, 32767.0, -256.0, -255.0, 255.0, 256.0, 0.0, -1.0, 1.0, -128.0, 128.0, 127.0])
        for i in range(16):
            x[i] = edges[torch.arange(k) * (i + 1) % len(edges)]
            x[i, ::32] = 32767.0  # amax of each block: the values quantize to themselves
        assert torch.equal(ql.matmul(x, path="amx", act="i16"), ql.matmul(x, path="avx512", act="i16")), name


@needs_amx
@pytest.mark.parametrize("t,d,k", SOME, ids=SOME_IDS)
@pytest.mark.parametrize("act", ["i8", "i16"])
def test_amx_row_alone_equals_batched(packed, t, d, k, act):
    """Rows 0, 5, 16, 28 and 511 alone (n=1: the vpdpbusd code) equal their rows in batches
    of 17, 30 and 512 (tiles; 17's last row by vpdpbusd, 30's in the zero-padded tail tile),
    outlier rows included."""
    ql, _ = packed[_name(t, d, k)]
    x = _x(512, k, seed=3)
    x[5] *= 1000.0
    y512 = ql.matmul(x, path="amx", act=act)
    y17 = ql.matmul(x[:17], path="amx", act=act)
    y30 = ql.matmul(x[:30], path="amx", act=act)
    for i in (0, 5, 16, 28, 511):
        alone = ql.matmul(x[i : i + 1], path="amx", act=act)[0]
        assert torch.equal(alone, y512[i])
        if i < 17:
            assert torch.equal(alone, y17[i])
        if i < 30:
            assert torch.equal(alone, y30[i])


@needs_amx
@pytest.mark.parametrize("t,d,k", SOME, ids=SOME_IDS)
@pytest.mark.parametrize("act", ["i8", "i16"])
def test_amx_thread_count_does_not_change_results(packed, t, d, k, act):
    ql, _ = packed[_name(t, d, k)]
    before = torch.get_num_threads()
    try:
        for n in (16, 17, 30, 512):
            x = _x(n, k, seed=11)
            torch.set_num_threads(1)
            y1 = ql.matmul(x, path="amx", act=act)
            torch.set_num_threads(2)
            y2 = ql.matmul(x, path="amx", act=act)
            assert torch.equal(y1, y2), n
    finally:
        torch.set_num_threads(before)


@needs_amx
@needs_avx512
def test_amx_shared_quantized_activations(packed):
    """quantize_activations(path='amx') is the same int8 quantizer as avx512's, and its rows
    feed several weights (q/k/v style)."""
    a, _ = packed[_name(T.Q5_0, 24, 640)]
    b, _ = packed[_name(T.Q8_0, 33, 640)]
    x = _x(20, 640, seed=5)
    qa = quantize_activations(x, "amx", "i8")
    qv = quantize_activations(x, "avx512", "i8")
    assert qa.path == "amx" and torch.equal(qa.q, qv.q) and torch.equal(qa.d, qv.d)
    assert torch.equal(qa.s16, qv.s16) and torch.equal(qa.s32, qv.s32)
    for w in (a, b):
        assert torch.equal(w.matmul(qa, act="i8"), w.matmul(x, path="amx", act="i8"))
        assert torch.equal(w.matmul(qa, act="i8"), w.matmul(qv, act="i8"))


@needs_amx
@needs_avx512
def test_q8_0_int8_is_one_integer_and_one_fma_in_every_library(packed):
    """Q8_0 (signed weights) with int8 activations: the tiles' TDPBSSD, avx512's
    sum((v ^ 0x80) a) - 128 sum(a) and avx2's sign trick form the same exact integer per block
    and scale it by the same single fma, so all three libraries agree bit for bit (tile rows,
    the vpdpbusd rows after them, and a 100x outlier row)."""
    ql, _ = packed[_name(T.Q8_0, 33, 640)]
    for n in (1, 12, 16, 19):
        x = _x(n, 640, seed=n)
        x[0] *= 100.0
        y = ql.matmul(x, path="amx", act="i8")
        assert torch.equal(y, ql.matmul(x, path="avx512", act="i8")), n
        assert torch.equal(y, ql.matmul(x, path="avx2", act="i8")), n


@needs_amx
@needs_avx512
@pytest.mark.parametrize("t,d,k", SOME, ids=SOME_IDS)
def test_amx_rescore_equals_avx512(packed, t, d, k):
    """The int16 re-score of an int8 head (``QuantLinear.rescore``) on the amx path: the same
    values as on avx512 (int8 tiles, then the int16 tile per candidate group), for a tile of 16
    rows plus 3 vpdpbusd rows."""
    base, _ = packed[_name(t, d, k)]
    w = dataclasses.replace(base, act="i8", rescore=7)
    x = _x(19, k, seed=d)
    y = w.matmul(x, path="amx")
    assert torch.equal(y, w.matmul(x, path="avx512"))
    assert not torch.equal(y, base.matmul(x, path="amx", act="i8"))  # something was re-scored


def test_amx_path_resolution(monkeypatch):
    """LORAPLANE_KERNELS=amx gives amx where available, else KernelPathError naming why;
    auto takes amx where available, and avx512 (with the reason logged) where refused."""
    monkeypatch.setenv("LORAPLANE_KERNELS", "amx")
    cpu._resolve.cache_clear()
    try:
        if AMX:
            assert cpu.resolve_path() == "amx"
        else:
            with pytest.raises(KernelPathError, match="amx"):
                cpu.resolve_path()
        monkeypatch.setenv("LORAPLANE_KERNELS", "auto")
        cpu._resolve.cache_clear()
        if AMX:
            assert cpu.resolve_path() == "amx"
        # a refused tile state: forced amx raises with the reason, auto falls back to avx512
        refused = "Linux refused the AMX tile state (test)"
        monkeypatch.setattr(cpu, "amx_unavailable_reason", lambda: refused)
        monkeypatch.setattr(cpu, "_has_flags", lambda p: True)
        cpu._resolve.cache_clear()
        assert cpu.best_path() == "avx512"
        with pytest.raises(KernelPathError, match="refused the AMX tile state"):
            cpu.resolve_path("amx")
    finally:
        cpu._resolve.cache_clear()


def test_amx_library_uses_tiles():
    """The amx library holds the tile instructions; the avx512 and avx2 ones never do (read from
    the prebuilt libraries, so this runs on any CPU)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump not installed")

    def asm(isa: str) -> str:
        return subprocess.run(
            [objdump, "-d", str(library.library_path(isa))], capture_output=True, text=True, check=True
        ).stdout

    a = asm("amx")
    for ins in (
        "ldtilecfg",
        "tileloadd",
        "tdpbsud",
        "tdpbssd",
        "tdpbuud",
        "tdpbusd",
        "tilestored",
        "tilerelease",
        "vpdpbusd",
        "vpdpwssd",
    ):
        assert ins in a, ins
    for isa in ("avx512", "avx2"):
        assert "tmm" not in asm(isa) and "ldtilecfg" not in asm(isa)
