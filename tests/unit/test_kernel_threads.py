"""The C kernels' threading backends (``lp::parallel_for``: our pool in
``worker/runtime/kernels/csrc/threadpool.cpp``, or OpenMP) and their contract.

- Results are bit-identical (``torch.equal``) with 1 thread, with the pool at 2 and 3 threads,
  with OpenMP, and with a spin budget of 0: each row / 16-row group is computed by the same code
  whichever thread runs it (static chunks, ``csrc/parallel.h``).
- Two Python threads calling kernels at once (ctypes releases the GIL, so the calls really
  overlap, on one library and on both ISA libraries) get the same bit-exact results and finish
  (a busy pool makes the second caller run inline; a generous join timeout catches a deadlock).
- After ``os.fork()`` the child's first kernel call builds a fresh pool and gives the same result.

No timing is asserted; speed is measured by ``python -m bench.kernels --contention``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter, quants
from gguf import GGMLQuantizationType as T

from loraplane.formats.gguf.reader import read_gguf
from worker.runtime.kernels import library, pack_tensor, supported

PATHS = [p for p in ("avx2", "avx512") if supported(p)]
K = 2048  # 33 rows x 2048 >= 2**16 elements: activation quantization goes parallel too
N_ROWS = 33


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict:
    """Q8_0 (80 x 2048) and Q4_K (100 x 2048, random valid blocks) packed weights."""
    path: Path = tmp_path_factory.mktemp("threads") / "w.gguf"
    rng = np.random.default_rng(7)
    wr = GGUFWriter(str(path), "llama")
    wr.add_tensor(
        "q8", quants.quantize(rng.standard_normal((80, K)).astype(np.float32) * 0.05, T.Q8_0), raw_dtype=T.Q8_0
    )
    blk, tsz = GGML_QUANT_SIZES[T.Q4_K]
    b = rng.integers(0, 256, size=(100 * K // blk, tsz), dtype=np.uint8)
    b[:, 0:2] = rng.uniform(0.001, 0.02, size=(len(b), 1)).astype(np.float16).view(np.uint8)
    b[:, 2:4] = rng.uniform(0.0, 0.02, size=(len(b), 1)).astype(np.float16).view(np.uint8)
    wr.add_tensor("q4k", b.reshape(100, K // blk * tsz), raw_dtype=T.Q4_K)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    gf = read_gguf(path)
    return {name: pack_tensor(rec) for name, rec in gf.tensors.items()}


@pytest.fixture
def threads():
    """Restore torch's thread count and the kernels' backend / spin budget after a test."""
    n = torch.get_num_threads()
    saved = library.threads_config()
    yield
    torch.set_num_threads(n)
    library.set_threads(*saved)


def _mm(ql, x, path, act, nthreads):
    torch.set_num_threads(nthreads)
    return ql.matmul(x, path=path, act=act)


@pytest.mark.parametrize("act", ["i16", "i8"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", ["q8", "q4k"])
def test_backends_bit_identical(weights, threads, name, path, act):
    ql = weights[name]
    x = torch.randn(N_ROWS, K) * 3
    x[5] *= 100  # an outlier row: other rows' results must not depend on it
    ref = _mm(ql, x, path, act, 1)
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    library.set_threads("pool", 50)
    for nt in (2, 3):
        assert torch.equal(_mm(ql, x, path, act, nt), ref), f"pool, {nt} threads"
    assert getattr(library.load(path), f"lp_{path}_pool_size")() >= 3  # grew lazily to the largest request
    library.set_threads("pool", 0)
    assert torch.equal(_mm(ql, x, path, act, 2), ref), "pool, spin 0"
    library.set_threads("omp")
    assert torch.equal(_mm(ql, x, path, act, 2), ref), "omp"
    # a row alone equals the same row in the batch
    library.set_threads("pool", 50)
    assert torch.equal(_mm(ql, x[7:8], path, act, 2), ref[7:8])


def test_threads_config_env(monkeypatch):
    monkeypatch.setattr(library, "_threads", None)
    monkeypatch.delenv("LORAPLANE_KERNEL_THREADS", raising=False)
    monkeypatch.delenv("LORAPLANE_KERNEL_SPIN_US", raising=False)
    monkeypatch.delenv("LORAPLANE_KERNEL_SPIN_BACKOFF_MS", raising=False)
    monkeypatch.delenv("LORAPLANE_KERNEL_BURST_US", raising=False)
    assert library.threads_config() == (
        library.DEFAULT_THREADS,
        library.DEFAULT_SPIN_US,
        library.DEFAULT_SPIN_BACKOFF_MS,
        library.DEFAULT_BURST_US,
    )
    monkeypatch.setenv("LORAPLANE_KERNEL_THREADS", "omp")
    monkeypatch.setenv("LORAPLANE_KERNEL_SPIN_US", "0")
    monkeypatch.setenv("LORAPLANE_KERNEL_SPIN_BACKOFF_MS", "7")
    monkeypatch.setenv("LORAPLANE_KERNEL_BURST_US", "0")
    assert library.threads_config() == ("omp", 0, 7, 0)
    monkeypatch.setenv("LORAPLANE_KERNEL_BURST_US", "-1")
    with pytest.raises(library.KernelBuildError, match="LORAPLANE_KERNEL_BURST_US"):
        library.threads_config()
    monkeypatch.setenv("LORAPLANE_KERNEL_BURST_US", "1000")
    monkeypatch.setenv("LORAPLANE_KERNEL_THREADS", "tbb")
    with pytest.raises(library.KernelBuildError, match="LORAPLANE_KERNEL_THREADS"):
        library.threads_config()
    monkeypatch.setenv("LORAPLANE_KERNEL_THREADS", "pool")
    monkeypatch.setenv("LORAPLANE_KERNEL_SPIN_US", "-5")
    with pytest.raises(library.KernelBuildError, match="LORAPLANE_KERNEL_SPIN_US"):
        library.threads_config()
    monkeypatch.setenv("LORAPLANE_KERNEL_SPIN_US", "20")
    monkeypatch.setenv("LORAPLANE_KERNEL_SPIN_BACKOFF_MS", "x")
    with pytest.raises(library.KernelBuildError, match="LORAPLANE_KERNEL_SPIN_BACKOFF_MS"):
        library.threads_config()


@pytest.mark.parametrize("spin_us", [0, 50])
@pytest.mark.parametrize("two_libraries", [False, True])
def test_concurrent_callers(weights, threads, spin_us, two_libraries):
    """Two Python threads, 150 back-to-back calls each, on one pool (same library) or on the two
    ISA libraries' pools at once: every result bit-equal to its single-thread reference."""
    if two_libraries and len(PATHS) < 2:
        pytest.skip("needs both the avx2 and avx512 libraries (CPU lacks AVX-512 VNNI)")
    paths = PATHS[-2:] if two_libraries else [PATHS[-1], PATHS[-1]]
    g = torch.Generator().manual_seed(3)
    jobs = []  # per thread: (weight, x, path, act, reference)
    for i, path in enumerate(paths):
        mine = []
        for j in range(4):
            ql = weights["q8" if (i + j) % 2 else "q4k"]
            x = torch.randn(1 + 15 * (j % 2) + i, K, generator=g)
            act = "i16" if j < 2 else "i8"
            mine.append((ql, x, path, act, _mm(ql, x, path, act, 1)))
        jobs.append(mine)
    library.set_threads("pool", spin_us)
    torch.set_num_threads(2)  # torch's count is process-wide: set once, before the threads start
    errors: list[str] = []
    done = [0, 0]

    def caller(i: int) -> None:
        try:
            for it in range(150):
                ql, x, path, act, ref = jobs[i][it % 4]
                if not torch.equal(ql.matmul(x, path=path, act=act), ref):
                    errors.append(f"thread {i} call {it}: result differs")
                done[i] += 1
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"thread {i}: {exc!r}")

    ts = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in ts), f"deadlock: calls done {done}"
    assert errors == []
    assert done == [150, 150]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_pool_after_fork(weights, threads):
    path = PATHS[-1]
    ql = weights["q4k"]
    x = torch.randn(N_ROWS, K)
    ref = _mm(ql, x, path, "i16", 1)
    library.set_threads("pool", 50)
    assert torch.equal(_mm(ql, x, path, "i16", 2), ref)
    size = getattr(library.load(path), f"lp_{path}_pool_size")
    assert size() >= 2  # the parent's pool has workers the child will not have
    pid = os.fork()
    if pid == 0:  # child: exit status 0 = equal result, pool rebuilt; no pytest machinery here
        code = 3
        try:
            fresh = size() == 1
            y = ql.matmul(x, path=path, act="i16")
            code = 0 if torch.equal(y, ref) and fresh and size() >= 2 else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in its kernel call")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
    # the parent's pool still works after the fork
    assert torch.equal(_mm(ql, x, path, "i16", 2), ref)


# a fresh interpreter importing torch each (~2.5 s): the spinning case, the harder exit, stays fast
@pytest.mark.parametrize("spin_us", [pytest.param("0", marks=pytest.mark.slow), "50"])
def test_process_exits_with_pool_alive(spin_us):
    """A process whose pool threads are alive (sleeping, or spinning at exit with a budget)
    exits normally: the threads are detached, nothing joins them at interpreter shutdown."""
    code = f"""
import torch
from worker.runtime.kernels import library
from worker.runtime.kernels.linear import _fns
torch.set_num_threads(3)
lib = library.load({PATHS[-1]!r})
n, k = 64, 2048
x = torch.randn(n, k)
q = torch.empty((n, k), dtype=torch.int16)
d, s16, s32 = torch.empty((n, k // 32)), torch.empty((n, k // 16)), torch.empty((n, k // 32))
quant = _fns({PATHS[-1]!r}, "i16")[0]
for _ in range(20):
    quant(x.data_ptr(), k, n, k, q.data_ptr(), d.data_ptr(), s16.data_ptr(), s32.data_ptr(), 3)
print(getattr(lib, "lp_{PATHS[-1]}_pool_size")())
"""
    env = dict(os.environ, LORAPLANE_KERNEL_THREADS="pool", LORAPLANE_KERNEL_SPIN_US=spin_us)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["3"]  # the pool grew to 3 threads and they were alive at exit
