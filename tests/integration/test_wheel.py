"""The installed product, not the checkout: build the sdist and from it the wheel (no network,
no build isolation), install the wheel with ``--no-deps`` into a fresh target folder, and run
``loraplane demo`` and ``loraplane bench`` from there, in a working directory outside the
repository, so nothing of the checkout can stand in for a file the wheel lacks.

The wheel holds the repository's five packages, ``loraplane``, ``control_plane``, ``worker``,
``clients`` and ``bench`` (each file under its path; docs/architecture.md "One path per file"),
plus the package data the product reads at run time: the demo adapters, the C kernels prebuilt
for each ISA (``setup.py``) with the header the loader binds them from, and the C source of the
bench's peak-rate probe. The installed product runs with no compiler on its PATH.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.helpers.serve import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The weather today is"
# what the wheel's source tree needs: no tests, no node client, nothing git ignores
SKIP = ("tests/", "clients/node/", ".git")


def _source_copy(dest: Path) -> Path:
    """The files git would commit, tests and the node client left out."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for rel in out.splitlines():
        src = ROOT / rel
        if rel.startswith(SKIP) or not src.is_file():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    return dest


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 600):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (cmd, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """``{"wheel", "sdist", "target", "env", "cwd"}``: the built files and the install."""
    base = tmp_path_factory.mktemp("wheel")
    src = _source_copy(base / "src")
    dist = base / "dist"
    _run(
        [sys.executable, "-c", f"from setuptools import build_meta as b; b.build_sdist({str(dist)!r})"],
        cwd=src,
    )
    (sdist,) = dist.glob("loraplane-*.tar.gz")
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist)]
        + [str(sdist)],
        cwd=base,
    )
    (wheel,) = dist.glob("loraplane-*.whl")
    target = base / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)], base)
    cwd = base / "elsewhere"
    cwd.mkdir()
    # No compiler can run: PATH holds only a folder with `python` in it, CXX names nothing, and
    # the variable that once pointed the kernels at a build cache points at an empty folder.
    bin_dir = base / "bin-python-only"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    (base / "empty-kernel-cache").mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("CXX", "CC")},
        "PATH": str(bin_dir),
        "PYTHONPATH": str(target),
        "PYTHONNOUSERSITE": "1",
        "LORAPLANE_KERNEL_BUILD_DIR": str(base / "empty-kernel-cache"),
    }
    return {"wheel": wheel, "sdist": sdist, "target": target, "env": env, "cwd": cwd}


def test_wheel_and_sdist_hold_the_five_packages(installed):
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"loraplane", "control_plane", "worker", "clients", "bench", "loraplane-0.1.0.dist-info"}, sorted(top)
    for want in (
        "control_plane/server.py",
        "worker/rpc/server.py",
        "clients/cli/main.py",
        "clients/cli/__main__.py",
        "control_plane/options.py",
        "worker/options.py",
        "bench/__main__.py",
        "loraplane/v1/control_plane_pb2.py",
        "loraplane/demo/adapters/shout.gguf",
        "loraplane/demo/adapters/sea.gguf",
        "worker/runtime/kernels/csrc/qmm.cpp",
        "worker/runtime/kernels/csrc/qmm_common.h",
        "bench/csrc/peak_int8.cpp",
    ):
        assert want in names, want
    assert not [n for n in names if "/tests/" in n or n.startswith("tests/")]
    libs = [n.rpartition("/")[2] for n in names if n.startswith("worker/runtime/kernels/_build/")]
    assert all(re.fullmatch(r"liblp_(avx2|avx512|amx)-[0-9a-f]{12}\.so", n) for n in libs), libs
    assert {n.split("-")[0].removeprefix("liblp_") for n in libs} >= {"avx2", "avx512"}, libs  # amx: g++ >= 11
    assert "worker/runtime/kernels/csrc/api.h" in names  # the loader binds the exports from it
    assert "linux_x86_64" in installed["wheel"].name  # a platform wheel: it carries machine code
    entry_points = zipfile.ZipFile(installed["wheel"]).read("loraplane-0.1.0.dist-info/entry_points.txt").decode()
    assert "loraplane = clients.cli.main:main" in entry_points
    with tarfile.open(installed["sdist"]) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}
    assert members["clients/cli/demo.py"].isfile()
    assert members["loraplane/demo/adapters/shout.gguf"].isfile()


def test_installed_package_is_the_one_imported(installed):
    """The wheel's files are what runs (not the checkout's, nor an editable install's)."""
    proc = _run(
        [
            sys.executable,
            "-c",
            "import loraplane, clients.cli.demo as d; "
            "print(loraplane.__file__); print(d.DEMO_DIR); print(all(p.is_file() for _, p in d.DEMO_ADAPTERS))",
        ],
        cwd=installed["cwd"],
        env=installed["env"],
    )
    init, demo_dir, found = proc.stdout.split()
    target = installed["target"].resolve()
    assert Path(init).resolve().is_relative_to(target)
    assert Path(demo_dir).is_relative_to(target) and found == "True"


def test_installed_kernels_are_the_prebuilt_ones(installed):
    """With no compiler reachable, the installed worker loads the library its wheel carries for
    this CPU, named by the hash of the installed sources (so nothing was compiled for it)."""
    code = (
        "from worker.runtime.kernels import cpu, library; p = cpu.best_path(); "
        "print(p, library.load(p)._name if p != 'torch' else '-')"
    )
    proc = _run([sys.executable, "-c", code], cwd=installed["cwd"], env=installed["env"])
    path, lib = proc.stdout.split()
    assert path in ("amx", "avx512", "avx2"), proc.stdout  # every x86-64 test machine has AVX2
    kernels = (installed["target"] / "worker" / "runtime" / "kernels" / "_build").resolve()
    assert Path(lib).resolve().parent == kernels and Path(lib).name.startswith(f"liblp_{path}-"), lib
    assert sorted(p.name for p in kernels.iterdir() if p.suffix == ".so") == sorted(
        n.rpartition("/")[2]
        for n in zipfile.ZipFile(installed["wheel"]).namelist()
        if n.startswith("worker/runtime/kernels/_build/")
    )


def test_demo_from_the_installed_wheel(installed, tmp_path):
    """README command 1 from the installed wheel (its console script, a working directory outside
    the checkout, no compiler on PATH): ``loraplane demo`` finds its packaged adapters and its
    prebuilt kernels, its worker child imports the installed package too, and the three
    continuations differ as the adapters say (shout: upper case; sea: 🌊 after sentences; base:
    neither)."""
    script = installed["target"] / "bin" / "loraplane"
    proc = subprocess.run(
        [sys.executable, str(script), "demo", "--once", "--json", "--max-tokens", "24", "--device", "cpu"]
        + ["--addr", f"127.0.0.1:{free_port()}", "--data-dir", str(tmp_path / "demo-data"), "--prompt", PROMPT],
        cwd=installed["cwd"],
        env=installed["env"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    texts = {r["name"].split(" ")[0]: r["text"] for r in out["results"]}
    assert set(texts) == {"base", "shout", "sea"}
    assert all(len(r["token_ids"]) == 24 for r in out["results"]), out
    letters = lambda t: [c for c in t if c.isalpha()]  # noqa: E731
    shout, base, sea = letters(texts["shout"]), letters(texts["base"]), texts["sea"]
    assert sum(c.isupper() for c in shout) >= 0.9 * len(shout) > 10, texts["shout"]
    assert sum(c.islower() for c in base) >= 0.7 * len(base) > 10, texts["base"]
    assert "\N{WATER WAVE}" in sea and "\N{WATER WAVE}" not in texts["base"], texts
    assert len({texts["base"], texts["shout"], sea}) == 3
    assert (tmp_path / "demo-data").is_dir()  # a given data dir is kept


def test_bench_from_the_installed_wheel(installed):
    """``loraplane bench`` reaches the installed bench (its own argument parser answers); a real
    run is the bench's own tests' job (minutes)."""
    script = installed["target"] / "bin" / "loraplane"
    proc = _run([sys.executable, str(script), "bench", "--", "--help"], cwd=installed["cwd"], env=installed["env"])
    assert proc.stdout.startswith("usage: loraplane bench") and "--smoke" in proc.stdout, proc.stdout
    proc = subprocess.run(
        [sys.executable, str(script), "bench", "--only", "nosuch"],
        cwd=installed["cwd"],
        env=installed["env"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "unknown scenario 'nosuch'" in proc.stderr, proc.stderr
    assert "not installed" not in proc.stderr
