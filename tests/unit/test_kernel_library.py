"""The kernel libraries as the build system leaves them (worker/runtime/kernels/build.py,
library.py): the exports bound from ``csrc/api.h`` alone, a missing or stale library refused with
what to run, and a worker process that loads its library with no compiler reachable."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.runtime.kernels import build, cpu, library
from worker.runtime.kernels.build import KernelBuildError
from worker.runtime.kernels.library import parse_api

ROOT = Path(__file__).resolve().parents[2]


def test_api_header_declares_every_export_with_its_ctypes():
    ex = library.exports()
    assert set(ex) == {
        "quantize_act", "qmm", "qmm_f32", "quantize_act16", "qmm16", "qmm16_f32", "rms_norm", "lora_bgmv",
        "attn_decode", "logits_summary", "threads_config", "pool_size", "request_tile_perm", "layer_forward",
        "qmm16_rescore",
        "layer_abi", "qmmbf16_f32",
    }  # fmt: skip
    attn = ex["attn_decode"]
    assert len(attn.params) == 25 and attn.restype is ctypes.c_int and not attn.amx_only
    assert attn.params[:2] == (("q", ctypes.c_void_p), ("q_ld", ctypes.c_int64))
    assert dict(attn.params)["kq_scale"] is ctypes.c_float and dict(attn.params)["B"] is ctypes.c_int
    assert ex["quantize_act"].restype is None and ex["pool_size"].params == ()
    assert ex["request_tile_perm"].amx_only and ex["qmmbf16_f32"].amx_only


@pytest.mark.skipif(not cpu.supported("avx2"), reason="needs an AVX2 CPU")
def test_loaded_library_binds_the_header_argtypes():
    lib = library.load("avx2")
    for e in library.exports().values():
        if not e.amx_only:
            f = getattr(lib, f"lp_avx2_{e.name}")
            assert f.argtypes == [t for _, t in e.params] and f.restype == e.restype, e.name
    assert not hasattr(lib, "lp_avx2_request_tile_perm")  # the header's amx block: amx only
    assert not hasattr(lib, "lp_avx2_qmmbf16_f32")


def test_parse_api_refuses_what_it_cannot_bind():
    text = "LP_EXPORT int LP_FN(f)(const float* x, double y);"
    with pytest.raises(KernelBuildError, match=r"cannot read parameter 'double y' of f"):
        parse_api(text)
    with pytest.raises(KernelBuildError, match=r"return type 'float' of g"):
        parse_api("LP_EXPORT float LP_FN(g)(void);")
    with pytest.raises(KernelBuildError, match="no LP_EXPORT declarations"):
        parse_api("// nothing here\n")
    got = parse_api("// c\nLP_EXPORT void LP_FN(h)(int64_t n, int32_t* ids);\n#if defined(LP_AMX)\n"
                    "LP_EXPORT int LP_FN(t)(void);\n#endif\n")  # fmt: skip
    assert got["h"].params == (("n", ctypes.c_int64), ("ids", ctypes.c_void_p)) and not got["h"].amx_only
    assert got["t"].amx_only and got["t"].restype is ctypes.c_int


def test_missing_or_stale_library_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setattr(library, "LIB_DIR", tmp_path)
    with pytest.raises(KernelBuildError) as exc:
        library.library_path("avx2")
    msg = str(exc.value)
    assert build.library_name("avx2") in msg and "none" in msg
    assert "pip install -e ." in msg and "scripts/install.sh" in msg and "build_ext --inplace" in msg
    (tmp_path / "liblp_avx2-000000000000.so").write_bytes(b"")
    with pytest.raises(KernelBuildError, match=r"only liblp_avx2-000000000000\.so \(built from other sources\)"):
        library.library_path("avx2")
    with pytest.raises(KernelBuildError, match="unknown kernel ISA 'sse2'"):
        library.library_path("sse2")


def test_library_name_follows_the_sources(tmp_path, monkeypatch):
    """The name hashes sources, headers and flags: an edited source names another library."""
    before = {isa: build.library_name(isa) for isa in build.ISA_FLAGS}
    assert len(set(before.values())) == 3 and all(n.startswith(f"liblp_{i}-") for i, n in before.items())
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for f in build.CSRC_DIR.iterdir():
        (csrc / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(build, "CSRC_DIR", csrc)
    assert build.library_name("avx2") == before["avx2"]
    (csrc / "simd.h").write_text((csrc / "simd.h").read_text() + "\n// edited\n")
    assert build.library_name("avx2") != before["avx2"]


@pytest.mark.skipif(not cpu.supported("avx2"), reason="needs an AVX2 CPU")
def test_worker_loads_its_kernels_with_no_compiler_reachable(tmp_path):
    """PATH holds only python, CXX names nothing: loading (and a matmul) needs no compiler."""
    (tmp_path / "python").symlink_to(sys.executable)
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC")}
    env.update(PATH=str(tmp_path), PYTHONPATH=str(ROOT))
    code = (
        "import torch; from worker.runtime.kernels import library, norm; lib = library.load('avx2'); "
        "print(lib._name); x = torch.randn(3, 64); "
        "print(torch.equal(norm.rms_norm(x, None, 1e-6, path='avx2'), norm.rms_norm(x, None, 1e-6, path='avx2')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    name, same = proc.stdout.split()
    assert Path(name) == library.LIB_DIR / build.library_name("avx2") and same == "True"
