#!/usr/bin/env bash
# Build llama-server (the benchmark peer) from the llama-cpp-python sdist, for THIS machine's
# CPU: AVX-512 (and its VNNI/BF16/VBMI extensions) only where /proc/cpuinfo lists them,
# AVX2/FMA/F16C/AVX-VNNI only where present; never -march=native; AMX off by default (some VMs
# fault on AMX instructions).
#   bench/build_llama_server.sh [OUT_DIR]   (default /tmp/llama-build) → prints the binary path
#   LLAMA_AMX=1 bench/build_llama_server.sh [OUT_DIR]
#     opt-in: AMX on (GGML_AMX_TILE/INT8/BF16, each only where /proc/cpuinfo lists amx_tile,
#     amx_int8, amx_bf16), built into a separate folder (build-amx) beside the default build,
#     which it leaves as it is.
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
# AMX: only with LLAMA_AMX=1 (and on top of AVX-512, which ggml's AMX code requires)
BUILD=build
AMX_TILE=OFF AMX_INT8=OFF AMX_BF16=OFF
if [[ ${LLAMA_AMX:-0} == 1 ]]; then
  BUILD=build-amx
  AMX_TILE=$(ext amx_tile) AMX_INT8=$(ext amx_int8) AMX_BF16=$(ext amx_bf16)
  if [[ $AMX_TILE == OFF || $AMX_INT8 == OFF ]]; then
    echo "LLAMA_AMX=1: this CPU lists no amx_tile/amx_int8 with AVX-512; not building" >&2
    exit 1
  fi
fi
echo "CPU: avx2=$(has avx2) fma=$(has fma) f16c=$(has f16c) avx512=$AVX512 vnni=$(ext avx512_vnni)" \
     "bf16=$(ext avx512_bf16) vbmi=$(ext avx512vbmi) avx_vnni=$(has avx_vnni)" \
     "amx_tile=$AMX_TILE amx_int8=$AMX_INT8 amx_bf16=$AMX_BF16 → $BUILD" >&2
src="$OUT/llama_cpp_python-$VERSION"
if [ ! -d "$src" ]; then
  "$PY" -m pip download "llama-cpp-python==$VERSION" --no-binary :all: --no-deps -d "$OUT" >&2
  tar -xzf "$OUT/llama_cpp_python-$VERSION.tar.gz" -C "$OUT"
fi
cd "$src/vendor/llama.cpp"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
  -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c) \
  -DGGML_AVX512=$AVX512 -DGGML_AVX512_VNNI=$(ext avx512_vnni) -DGGML_AVX512_BF16=$(ext avx512_bf16) \
  -DGGML_AVX512_VBMI=$(ext avx512vbmi) -DGGML_AVX_VNNI=$(has avx_vnni) \
  -DGGML_AMX_TILE=$AMX_TILE -DGGML_AMX_INT8=$AMX_INT8 -DGGML_AMX_BF16=$AMX_BF16 \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF >&2
cmake --build "$BUILD" --target llama-server -j"${JOBS:-$(nproc)}" >&2
echo "$PWD/$BUILD/bin/llama-server"
