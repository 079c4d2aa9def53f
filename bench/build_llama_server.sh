#!/usr/bin/env bash
# Build llama-server (the benchmark peer) from the llama-cpp-python sdist, for THIS machine's
# CPU: AVX-512 (and its VNNI/BF16/VBMI extensions) only where /proc/cpuinfo lists them,
# AVX2/FMA/F16C/AVX-VNNI only where present; never -march=native and never AMX (some VMs fault on AMX instructions).
#   bench/build_llama_server.sh [OUT_DIR]   (default /tmp/llama-build) → prints the binary path
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
OUT=${1:-/tmp/llama-build}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
AVX512=OFF
if [[ $(has avx512f) == ON && $(has avx512bw) == ON && $(has avx512vl) == ON ]]; then AVX512=ON; fi
# the AVX-512 extensions llama.cpp can use, each only where present (and only on top of AVX-512)
ext() { [[ $AVX512 == ON ]] && has "$1" || echo OFF; }
echo "CPU: avx2=$(has avx2) fma=$(has fma) f16c=$(has f16c) avx512=$AVX512 vnni=$(ext avx512_vnni)" \
     "bf16=$(ext avx512_bf16) vbmi=$(ext avx512vbmi) avx_vnni=$(has avx_vnni) (AMX always off)" >&2
src="$OUT/llama_cpp_python-$VERSION"
if [ ! -d "$src" ]; then
  "$PY" -m pip download "llama-cpp-python==$VERSION" --no-binary :all: --no-deps -d "$OUT" >&2
  tar -xzf "$OUT/llama_cpp_python-$VERSION.tar.gz" -C "$OUT"
fi
cd "$src/vendor/llama.cpp"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
  -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c) \
  -DGGML_AVX512=$AVX512 -DGGML_AVX512_VNNI=$(ext avx512_vnni) -DGGML_AVX512_BF16=$(ext avx512_bf16) \
  -DGGML_AVX512_VBMI=$(ext avx512vbmi) -DGGML_AVX_VNNI=$(has avx_vnni) \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF >&2
cmake --build build --target llama-server -j"${JOBS:-$(nproc)}" >&2
echo "$PWD/build/bin/llama-server"
