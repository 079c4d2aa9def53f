#!/usr/bin/env bash
# The GPU check (docs/gpu.md): on a machine with one NVIDIA GPU, offline, from a checkout (no
# install), runs the gpu test tier and the GPU bench on a random-weight model it writes itself,
# and prints every figure. Stages, each under its own timeout and all within 9 minutes (13 with
# --8b): install (the --wheels folder), env, cpu-kernels, jit, gpu-tier, bench-step,
# bench-serving, [bench-8b,] kernel-sweep. A stage that fails prints why and the next one runs;
# the exit status is 1 when any stage failed, 2 on a usage error.
#
#   bash scripts/gpu_check.sh [--wheels DIR] [--8b] [--out DIR] [--dtype bf16|f16|f32]
#                             [--only STAGE,...] [--dry-run]
#
# --wheels DIR  wheels from scripts/gpu_wheels.sh, installed with pip --target into the work
#               folder and put first on PYTHONPATH (without it: the interpreter's own packages)
# --8b          also the step table on the Llama-3-8B shape (a 16 GB model; +4 minutes)
# --out DIR     the log (gpu_check.log), stage times (stages.tsv) and bench JSONs
#               (default $OUT when set, else ./gpu-out)
# --dtype       compute dtype of the bench and the JIT warm-up (default bf16)
# --only        run only these stages (a rerun of a part within a short device lease;
#               bench-8b implies --8b)
# --dry-run     check this script where there is no GPU: CUDA hidden, the tiny shape in the bench,
#               the kernel sweep's fast cases only; every GPU stage fails, saying why
# PYTHON: the interpreter (default python3); GPU_CHECK_WORK: the work folder (default
# $TMPDIR/loraplane-gpu-check: the installed wheels, LORAPLANE_CACHE with the models it writes);
# GPU_CHECK_BUDGET_S: the run's budget in seconds (default 540, +240 with --8b).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHEELS="" EIGHT_B=0 OUT_DIR=${OUT:-./gpu-out} DTYPE=bf16 ONLY="" DRY=0
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
  case $1 in
    --wheels) WHEELS=${2:?--wheels needs a folder}; shift 2 ;;
    --out) OUT_DIR=${2:?--out needs a folder}; shift 2 ;;
    --dtype) DTYPE=${2:?--dtype needs bf16, f16 or f32}; shift 2 ;;
    --only) ONLY=${2:?--only needs stage names}; shift 2 ;;
    --8b) EIGHT_B=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h | --help) usage 0 ;;
    *) echo "gpu_check: unknown argument '$1'" >&2; usage ;;
  esac
done
case $DTYPE in bf16|f16|f32) ;; *) echo "gpu_check: --dtype must be bf16, f16 or f32" >&2; exit 2 ;; esac
STAGES="install env cpu-kernels jit gpu-tier bench-step bench-serving bench-8b kernel-sweep"
for s in ${ONLY//,/ }; do
  [[ " $STAGES " == *" $s "* ]] || { echo "gpu_check: --only: unknown stage '$s' (one of: $STAGES)" >&2; exit 2; }
done
[[ ",$ONLY," == *",bench-8b,"* ]] && EIGHT_B=1
if [ -n "$WHEELS" ]; then
  WHEELS=$(cd "$WHEELS" 2>/dev/null && pwd) || { echo "gpu_check: no wheels folder '$WHEELS'" >&2; exit 2; }
fi
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd) || exit 2
WORK=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/loraplane-gpu-check}
mkdir -p "$WORK" || exit 2

exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
TEE_PID=$!
trap 'exec >&- 2>&-; wait "$TEE_PID"' EXIT

export PY=${PYTHON:-python3} ROOT WORK WHEELS DTYPE OUT_DIR
export SITE=$WORK/site LORAPLANE_CACHE=$WORK/cache PYTHONUNBUFFERED=1
export PIP_NO_INDEX=1 # offline: a test that would fetch from the registry fails at once and skips
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
export PYTHONPATH="${WHEELS:+$SITE:}$ROOT${PYTHONPATH:+:$PYTHONPATH}"
SHAPE_ARGS="" SWEEP_MARK="not cuda"
if [ "$DRY" = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" # torch sees no GPU, as on a machine without one
  SHAPE_ARGS="--tiny" SWEEP_MARK="not cuda and not slow"
fi
export SHAPE_ARGS SWEEP_MARK
if ! command -v g++ >/dev/null; then
  export LORAPLANE_KERNELS=torch # no compiler: the CPU references of the tests use the torch path
fi
BUDGET_S=${GPU_CHECK_BUDGET_S:-$((540 + 240 * EIGHT_B))}
DEADLINE=$((SECONDS + BUDGET_S))
cd "$ROOT" || exit 2
: >"$OUT_DIR/stages.tsv"

stage_install() {
  mkdir -p "$SITE" "$LORAPLANE_CACHE" || return
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl || return
  local vocabs
  vocabs=$(ls "$WHEELS"/llama-cpp-vocabs-*.tar.xz 2>/dev/null | head -1)
  if [ -z "$vocabs" ]; then
    echo "no llama-cpp-vocabs-*.tar.xz in $WHEELS: the tiny-architecture parity tests will skip"
    return 0
  fi
  "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
    "$vocabs" "$LORAPLANE_CACHE" && echo "llama.cpp vocabularies: $(ls -d "$LORAPLANE_CACHE"/llama-cpp-vocabs-*)"
}
stage_env() {
  echo "checkout: $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  else
    echo "nvidia-smi: not found"
  fi
  echo "g++: $(command -v g++ || echo 'not found: LORAPLANE_KERNELS=torch')"
  "$PY" -m bench.gpu_check env
}
stage_cpu_kernels() { # the C kernels the tests' CPU references run on (the GPU path needs none)
  if [ -n "${LORAPLANE_KERNELS:-}" ]; then echo "no g++: not built"; return 0; fi
  "$PY" -m worker.runtime.kernels.build
}
stage_jit() {
  "$PY" -m bench.gpu_check warmup --device cuda --dtypes "$DTYPE"
}
stage_gpu_tier() {
  local cuda=1
  "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' || cuda=0
  "$PY" -m pytest -q -m cuda -p no:cacheprovider -s -rfEs --durations=15 tests/gpu tests/unit || return
  if [ "$cuda" = 0 ]; then echo "torch sees no CUDA device: every cuda test was skipped, which checks nothing"; return 1; fi
}
bench() { # SHAPE NAME ARGS...: one bench run, its figures in $OUT_DIR/bench-SHAPE-NAME.json
  local shape=$1 name=$2
  shift 2
  rm -rf "$WORK/bench-$shape-$name"
  # shellcheck disable=SC2086  # SHAPE_ARGS is empty or one flag
  "$PY" -m bench --device cuda --dtype "$DTYPE" --synthetic "$shape" $SHAPE_ARGS --plain \
    --synthetic-dir "$LORAPLANE_CACHE/synthetic" --work-dir "$WORK/bench-$shape-$name" \
    --json "$OUT_DIR/bench-$shape-$name.json" "$@" && return
  local rc=$? log # the work folder stays behind on the machine: show what its servers said
  for log in $(find "$WORK/bench-$shape-$name" -name '*.log' -size +0 2>/dev/null); do
    echo "--- last lines of $log"
    tail -n 25 "$log"
  done
  return $rc
}
stage_bench_step() { bench qwen2.5-1.5b step --only 1,5 --reps 3; }
stage_bench_serving() { bench qwen2.5-1.5b serving --only 2 --quick --ks 0,16; }
stage_bench_8b() { bench llama-3-8b step --only 1 --reps 3; }
stage_kernel_sweep() { "$PY" -m pytest -q -m "$SWEEP_MARK" -p no:cacheprovider -rfEs tests/gpu; }
export -f stage_install stage_env stage_cpu_kernels stage_jit stage_gpu_tier bench stage_bench_step \
  stage_bench_serving stage_bench_8b stage_kernel_sweep

FAILED=0
run_stage() { # NAME CAP_S FUNCTION: FUNCTION under min(CAP_S, what is left of the budget)
  local name=$1 cap=$2 fn=$3 left=$((DEADLINE - SECONDS)) status rc t0 dt
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then return; fi
  if [ "$left" -lt 10 ]; then
    echo "== $name: not run: the ${BUDGET_S} s budget is spent"
    printf '%s\tnot run\t-\t0\n' "$name" >>"$OUT_DIR/stages.tsv"
    FAILED=$((FAILED + 1))
    return
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  echo
  echo "== $name (timeout ${cap} s) $(date -u +%H:%M:%S)"
  t0=$(date +%s%N)
  timeout -k 10 "$cap" bash -c "$fn"
  rc=$?
  dt=$((($(date +%s%N) - t0) / 100000000)) # tenths of a second
  dt="$((dt / 10)).$((dt % 10))"
  case $rc in
    0) status=ok ;;
    124 | 137) status="TIMED OUT after ${cap} s" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  [ "$rc" = 0 ] || FAILED=$((FAILED + 1))
  echo "== $name: $status in $dt s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$dt" >>"$OUT_DIR/stages.tsv"
}

echo "gpu_check: $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(uname -n); budget ${BUDGET_S} s; out $OUT_DIR;" \
  "work $WORK; dtype $DTYPE${WHEELS:+; wheels $WHEELS}$([ "$DRY" = 1 ] && echo '; DRY RUN (CUDA hidden)')"
if [ -n "$WHEELS" ]; then run_stage install 60 stage_install; fi
run_stage env 60 stage_env
run_stage cpu-kernels 60 stage_cpu_kernels
run_stage jit 90 stage_jit
run_stage gpu-tier 210 stage_gpu_tier
run_stage bench-step 150 stage_bench_step
run_stage bench-serving 150 stage_bench_serving
if [ "$EIGHT_B" = 1 ]; then run_stage bench-8b 240 stage_bench_8b; fi
run_stage kernel-sweep 90 stage_kernel_sweep

echo
echo "== summary (stage, status, exit, seconds); $SECONDS s in all; files in $OUT_DIR"
column -t -s $'\t' "$OUT_DIR/stages.tsv" 2>/dev/null || cat "$OUT_DIR/stages.tsv"
[ "$FAILED" = 0 ] || { echo "gpu_check: $FAILED stage(s) failed"; exit 1; }
echo "gpu_check: every stage passed"
