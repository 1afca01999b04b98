#!/usr/bin/env bash
# Every dsk header compiles on its own, with its IMPLEMENTATION macro, as C11 and as C++17
# under -Wall -Wextra -Werror, with and without DSK_CUDA (and with DSK_STATIC on the CPU).
# The compilers run as parallel jobs (one per CPU); results print in order.
cd "$(dirname "$0")/.."
passed=0 failed=0
# DSK_CUDA compiles against the CUDA toolkit's headers where it is installed, else against the
# emulator's (tests/cuda_emu/include), so a machine without the toolkit checks the same code.
cuda_inc=${CUDA_HOME:-/usr/local/cuda}/include
[ -f "$cuda_inc/cuda_runtime.h" ] && [ -f "$cuda_inc/nccl.h" ] || cuda_inc=tests/cuda_emu/include
echo "# DSK_CUDA against the headers in $cuda_inc"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
n_jobs=0 max_jobs=$(nproc 2>/dev/null || echo 2)
job() { # label, compiler flags... (the source in $work/src.N): runs in the background
  local label=$1; shift
  n_jobs=$((n_jobs + 1))
  [ "$n_jobs" -gt "$max_jobs" ] && wait -n
  n_done=$((n_done + 1))
  local id
  id=$(printf '%03d' "$n_done")
  cp "$work/src" "$work/src.$id"
  ( if out=$("$@" -Wall -Wextra -Werror -I. - <"$work/src.$id" 2>&1); then echo "ok   $label"
    else echo "FAIL $label"; echo "$out" | head -20; fi >"$work/res.$id" ) &
}
n_done=0
check() { # label, compiler..., reads the source from stdin
  local label=$1; shift
  cat >"$work/src"
  job "$label" "$@" -fsyntax-only
}
for h in dsk_*.h; do
  impl=$(basename "$h" .h | tr 'a-z' 'A-Z')_IMPLEMENTATION
  for lang in "gcc -std=c11 -x c" "g++ -std=c++17 -x c++"; do
    std=${lang%% -x*}
    src=$(printf '#define %s\n#include "%s"\n' "$impl" "$h")
    check "$h alone ($std)" $lang <<<"$src"
    check "$h alone, DSK_STATIC ($std)" $lang -DDSK_STATIC -Wno-unused-function <<<"$src"
    check "$h alone, DSK_CUDA ($std)" $lang -DDSK_CUDA -I"$cuda_inc" <<<"$src"
  done
done
# Every implementation in one translation unit, compiled for real: warnings that only
# optimisation finds (maybe-uninitialized, format-truncation) must not break an embedder's -Werror,
# and no two modules may define the same name. gcc -O2 is left out: `make tests` compiles every
# module with it (libdsk.a), and CI builds both the CUDA and the CPU configuration.
all_src=$(printf '#define %s_IMPLEMENTATION\n' DSK_TENSOR DSK_COMM DSK_MOE DSK_AMP DSK_CKPT DSK_PAR DSK_ZERO
          printf '#include "%s"\n' dsk_*.h)
compile() { # label, compiler..., reads the source from stdin
  local label=$1; shift
  cat >"$work/src"
  job "$label" "$@" -c -o /dev/null -fopenmp
}
compile "all modules in one file, gcc -std=c11 -O3" gcc -std=c11 -O3 -x c <<<"$all_src"
compile "all modules in one file, DSK_CUDA, gcc -std=c11 -O3" gcc -std=c11 -O3 -DDSK_CUDA -I"$cuda_inc" -x c <<<"$all_src"
compile "all modules in one file, g++ -std=c++17 -O2" g++ -std=c++17 -O2 -x c++ <<<"$all_src"
if command -v clang >/dev/null; then
  compile "all modules in one file, clang -std=c11 -O2" clang -std=c11 -O2 -x c <<<"$all_src"
fi
wait
for r in "$work"/res.*; do
  cat "$r"
  if head -n 1 "$r" | grep -q '^ok'; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
done
echo "[test_headers] totals: $passed passed / $failed failed / 0 skipped"
[ "$failed" -eq 0 ]
