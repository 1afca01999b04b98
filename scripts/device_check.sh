#!/usr/bin/env bash
# scripts/device_check.sh - everything that needs a GPU, in one run of at most 8 minutes on one H200:
# build for sm_90 (no make clean), every GPU test, the GPU benchmarks, then the CPU tests with the
# time left; a summary table comes LAST. Each step runs under `timeout`; a failing step never stops
# the others. Logs go to $OUT when it is set (device machine), else to build-gpu/device_check/:
# device_check.log (everything) and summary.txt (the table).
# Usage: bash scripts/device_check.sh     (DEVICE_CHECK_BUDGET=seconds overrides the 470 s budget,
#        DEVICE_CHECK_JOBS the 16 parallel build jobs; to rerun what failed: DEVICE_CHECK_BENCHES="name ..."
#        runs only those benchmarks, "" none; DEVICE_CHECK_TESTS="test_train.sh trainer/test_hf ..."
#        runs those of tests/ instead of the whole suite)
set -u
cd "$(dirname "$0")/.."
BUILD=build-gpu
BUDGET=${DEVICE_CHECK_BUDGET:-470}
JOBS=${DEVICE_CHECK_JOBS:-16}
START=$SECONDS
LOGDIR=${OUT:-$BUILD/device_check}
mkdir -p "$LOGDIR"
LOG=$LOGDIR/device_check.log
: >"$LOG"
STEP_OUT=$(mktemp)
trap 'rm -f "$STEP_OUT"' EXIT

# ---- GPU benchmarks: one line each, "name|timeout seconds|command". Modules append theirs here.
GPU_BENCHES=(
  "bench_gpu_ops|90|$BUILD/bench/bench_gpu_ops"
  "comm_bench|60|env RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 $BUILD/bench/comm_bench --nccl -b 8 -e 268435456"
  "bench_moe|100|$BUILD/bench/bench_moe --cuda --tokens 8192 --repeats 5 --python python3"
  "train_graph|60|bash bench/train_graph_step.sh $BUILD/examples/train_moe"
  "bench_attention|60|$BUILD/bench/bench_attention --gpu --repeats 5"
  "bench_zero|60|$BUILD/bench/bench_zero --cuda --units 8 --dim 2048 --batch 512 --dtype bf16 --steps 20 --warmup 3"
  "bench_fp8|60|$BUILD/bench/bench_fp8 --cuda --repeats 10"
  "plan_gpu|60|bash bench/plan_gpu.sh $BUILD/examples/train_moe"
)
# ---- end of the GPU benchmark list

rows=()            # "name|status|seconds|result" per step
failed_steps=0
gpu_p=0 gpu_f=0 gpu_s=0

say() { echo "$*" | tee -a "$LOG"; }

# step NAME LIMIT RESULT_KIND COMMAND...: runs COMMAND under timeout (capped by the time left),
# logs it, shows its last lines, and records a row. RESULT_KIND: gpu-test (a test's totals line,
# added to the GPU totals), totals (the same, not added), summary (a benchmark's "summary:" lines),
# last (the last output line).
step() {
  local name=$1 limit=$2 kind=$3
  shift 3
  local left=$((BUDGET - (SECONDS - START) - 15))
  if [ "$left" -lt 10 ]; then
    rows+=("$name|not run|0|time budget spent"); failed_steps=$((failed_steps + 1)); return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS rc result status
  say "=== $name (limit ${limit} s): $*"
  timeout --kill-after=5 "$limit" "$@" >"$STEP_OUT" 2>&1
  rc=$?
  cat "$STEP_OUT" >>"$LOG"
  tail -n 25 "$STEP_OUT"
  case $kind in
    gpu-test | totals) result=$(grep -E '^\[.*\] totals: |^[0-9]+ passed, [0-9]+ failed' "$STEP_OUT" | tail -n 1) ;;
    summary) result=$(grep -E '^summary: ' "$STEP_OUT" | sed 's/^summary: //' | paste -sd ';' -)
      [ -n "$result" ] || result=$(tail -n 1 "$STEP_OUT") ;;
    *) result=$(tail -n 1 "$STEP_OUT") ;;
  esac
  if [ "$rc" -eq 0 ]; then status=ok
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status=TIMEOUT; failed_steps=$((failed_steps + 1))
  else status="FAIL($rc)"; failed_steps=$((failed_steps + 1)); fi
  rows+=("$name|$status|$((SECONDS - t0))|${result:-no result line}")
  if [ "$kind" = gpu-test ] && [[ $result =~ totals:\ ([0-9]+)\ passed\ /\ ([0-9]+)\ failed\ /\ ([0-9]+)\ skipped ]]; then
    gpu_p=$((gpu_p + BASH_REMATCH[1])); gpu_f=$((gpu_f + BASH_REMATCH[2])); gpu_s=$((gpu_s + BASH_REMATCH[3]))
  fi
}

say "device_check: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if command -v nvidia-smi >/dev/null 2>&1; then
  gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -n 1)
else
  gpu="nvidia-smi not found"
fi
say "GPU: $gpu"

# 1. Build (keep going past a broken target so the rest still builds). The emulated GPU tests
#    (tests/cuda_emu) run in every `make test`; here the same programs run on the hardware.
#    NCCL is not part of the CUDA toolkit: where CUDA_HOME lacks it, take the one the machine has
#    elsewhere (the device image's pip wheel nvidia-nccl), linked through $BUILD/nccl since the
#    wheel ships libnccl.so.2 but no libnccl.so for -lnccl. Likewise cuBLAS, which the library
#    dlopens. Warnings are not errors here: CI's compilers check them, and a warning new to this
#    machine's gcc must not cost the one GPU run (they are counted in the summary instead).
#    The settings go in the environment, so that the test scripts' own `make` calls (step 4) see them.
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} CUDA=1 EMULATE=0 WARN="-Wall -Wextra"
command -v nvcc >/dev/null 2>&1 || export PATH=$PATH:$CUDA_HOME/bin
export GENCODE=-gencode=arch=compute_90,code=sm_90
export NVFLAGS="-O2 -std=c++17 $GENCODE -I. -Xcompiler -Wall,-Wextra,-fPIC"
find_lib() { find /usr/lib /usr/local /opt -name "$1" 2>/dev/null | sort | head -n 1; }
if [ ! -e "$CUDA_HOME/include/nccl.h" ]; then
  nccl_h=$(find /usr/include /usr/local /opt -name nccl.h 2>/dev/null | sort | head -n 1)
  nccl_so=$(find_lib 'libnccl.so.2*')
  if [ -n "$nccl_h" ] && [ -n "$nccl_so" ]; then
    mkdir -p "$BUILD/nccl/include" "$BUILD/nccl/lib"
    ln -sf "$nccl_h" "$BUILD/nccl/include/nccl.h"
    ln -sf "$nccl_so" "$BUILD/nccl/lib/libnccl.so"
    ln -sf "$nccl_so" "$BUILD/nccl/lib/libnccl.so.2"
    export NCCL_HOME=$PWD/$BUILD/nccl
  fi
  say "NCCL: not in $CUDA_HOME; using ${nccl_h:-no nccl.h found} and ${nccl_so:-no libnccl.so.2 found}"
fi
if ! ls "$CUDA_HOME"/lib64/libcublas.so.* >/dev/null 2>&1; then
  cublas_so=$(find_lib 'libcublas.so.[0-9]*')
  [ -n "$cublas_so" ] && export LD_LIBRARY_PATH=$(dirname "$cublas_so")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  say "cuBLAS: not in $CUDA_HOME/lib64; using ${cublas_so:-none found}"
fi
say "nvcc: $(nvcc --version 2>&1 | tail -n 1); cc: $(${CC:-gcc} --version 2>&1 | head -n 1)"
step build 300 last make -k BUILD=$BUILD -j$JOBS tests bench examples

# 2. Every GPU test program.
n_gpu_tests=0
for t in "$BUILD"/tests/gpu/test_*; do
  [ -x "$t" ] || continue
  step "$(basename "$t")" 90 gpu-test "$t"
  n_gpu_tests=$((n_gpu_tests + 1))
done
if [ "$n_gpu_tests" -eq 0 ]; then rows+=("GPU tests|not built|0|no $BUILD/tests/gpu/test_* program"); failed_steps=$((failed_steps + 1)); fi

# 3. GPU benchmarks.
for b in "${GPU_BENCHES[@]}"; do
  IFS='|' read -r name limit cmd <<<"$b"
  [ -z "${DEVICE_CHECK_BENCHES+set}" ] || [[ " $DEVICE_CHECK_BENCHES " == *" $name "* ]] || continue
  prog=$(printf '%s\n' $cmd | grep -m 1 "^$BUILD/")   # the program, after any `env VAR=...`
  if [ -x "$prog" ]; then
    step "$name" "$limit" summary $cmd
  else
    rows+=("$name|not built|0|${prog:-no $BUILD/ program in: $cmd} missing"); failed_steps=$((failed_steps + 1))
  fi
done

# 4. The whole test suite (CPU tests too, on a machine that has a GPU) with the time left, or the
#    tests DEVICE_CHECK_TESTS names.
if [ -n "${DEVICE_CHECK_TESTS:-}" ]; then
  for t in $DEVICE_CHECK_TESTS; do
    case $t in
      *.sh) step "$t" 150 totals env BUILD=$BUILD bash "tests/$t" ;;
      *) step "$t" 150 totals "$BUILD/tests/$t" ;;
    esac
  done
else
  step "all tests (run_tests.sh)" 240 totals env BUILD=$BUILD bash scripts/run_tests.sh
fi

# Summary, last.
{
  echo
  echo "==== device_check summary: $gpu; $((SECONDS - START)) s of a $BUDGET s budget ===="
  printf '%-26s %-10s %5s  %s\n' step status secs result
  for r in "${rows[@]}"; do
    IFS='|' read -r name status secs result <<<"$r"
    printf '%-26s %-10s %5s  %s\n' "$name" "$status" "$secs" "$result"
  done
  echo "GPU test programs: $gpu_p passed, $gpu_f failed, $gpu_s skipped; steps not ok: $failed_steps"
  echo "compiler warnings in the build: $(grep -c 'warning:' "$LOG")"
  # issue 13's figures: V3-like tokens/s, grouped GEMM vs dense cuBLAS, step time with and without a CUDA graph
  echo "MoE figures (issue 13):"
  grep -E '^summary: (moe v3 |train_moe step)' "$LOG" | sed 's/^summary: /  /'
} | tee "$LOGDIR/summary.txt" | tee -a "$LOG"
[ "$failed_steps" -eq 0 ]
