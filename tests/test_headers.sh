#!/usr/bin/env bash
# Every dsk header compiles on its own, with its IMPLEMENTATION macro, as C11 and as C++17
# under -Wall -Wextra -Werror, with and without DSK_CUDA (and with DSK_STATIC on the CPU).
# Also: the compile-out switches, and dsk_moe.h without dsk_amp.h refusing FP8 dispatch and experts.
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
# Every implementation in one translation unit: no two modules may define the same name. Parsed
# only: the warnings that only optimisation finds (maybe-uninitialized, format-truncation) come
# from compiling each module for real, which `make tests` does at -O2 (libdsk.a) and .ci/run's CPU
# build at -O3, the level an embedder may pick. Those come from gcc's middle end, which C and C++
# share, so g++ and clang only parse here too: what they add is their front ends' warnings (CI's
# clang build compiles every module too).
all_src=$(printf '#define %s_IMPLEMENTATION\n' DSK_TENSOR DSK_COMM DSK_MOE DSK_AMP DSK_SAFETENSORS DSK_CKPT DSK_PAR DSK_ZERO
          printf '#include "%s"\n' dsk_*.h)
compile() { # label, compiler..., reads the source from stdin
  local label=$1; shift
  cat >"$work/src"
  job "$label" "$@" -c -o /dev/null -fopenmp
}
check "all modules in one file, gcc -std=c11" gcc -std=c11 -x c <<<"$all_src"
check "all modules in one file, DSK_CUDA, gcc -std=c11" gcc -std=c11 -DDSK_CUDA -I"$cuda_inc" -x c <<<"$all_src"
check "all modules in one file, g++ -std=c++17" g++ -std=c++17 -x c++ <<<"$all_src"
if command -v clang >/dev/null; then
  check "all modules in one file, clang -std=c11" clang -std=c11 -x c <<<"$all_src"
  check "all modules in one file, DSK_CUDA, clang -std=c11" clang -std=c11 -DDSK_CUDA -I"$cuda_inc" -x c <<<"$all_src"
fi
# The compile-out switches: the implementations compile without the parts they drop (for real,
# at -O0: a function left unused by the drop is a warning, which needs code generation but no
# optimisation), the dropped API is gone, and the query functions report what the implementation
# was built with.
sw_src=$(printf '#define DSK_CKPT_IMPLEMENTATION\n#include "dsk_ckpt.h"\n')
compile "dsk_ckpt.h, DSK_CKPT_NO_HF, gcc -std=c11 -O0" gcc -std=c11 -O0 -DDSK_CKPT_NO_HF -x c <<<"$sw_src"
compile "dsk_ckpt.h, DSK_CKPT_NO_HF, g++ -std=c++17 -O0" g++ -std=c++17 -O0 -DDSK_CKPT_NO_HF -x c++ <<<"$sw_src"
compile "dsk_ckpt.h, DSK_CKPT_NO_HF and DSK_SAFETENSORS_NO_SSE42, DSK_STATIC" gcc -std=c11 -O0 -DDSK_CKPT_NO_HF \
  -DDSK_SAFETENSORS_NO_SSE42 -DDSK_STATIC -Wno-unused-function -x c <<<"$sw_src"
n_jobs=$((n_jobs + 1)) n_done=$((n_done + 1))
( label="DSK_CKPT_NO_HF: dsk_ckpt_hf_deepseek_name is gone"
  printf '#include "dsk_ckpt.h"\nint f(char *b) { return (int)dsk_ckpt_hf_deepseek_name(b, 8, 0, "w1"); }\n' >"$work/gone.c"
  if out=$(gcc -std=c11 -fsyntax-only -Wall -Wextra -Werror -I. -DDSK_CKPT_NO_HF "$work/gone.c" 2>&1); then
    echo "FAIL $label: it still compiles"
  elif echo "$out" | grep -q "dsk_ckpt_hf_deepseek_name"; then echo "ok   $label"
  else echo "FAIL $label"; echo "$out" | head -5; fi >"$work/res.$(printf '%03d' "$n_done")" ) &
for sw in "" "-DDSK_CKPT_NO_HF" "-DDSK_SAFETENSORS_NO_SSE42" "-DDSK_CKPT_NO_HF -DDSK_SAFETENSORS_NO_SSE42"; do
  [ "$n_jobs" -gt "$max_jobs" ] && wait -n
  n_jobs=$((n_jobs + 1)) n_done=$((n_done + 1))
  ( id=$(printf '%03d' "$n_done") want="${sw//-D/}" want="${want# }"
    label="the options query reports \"$want\" (built with ${sw:-no switch})"
    printf '#define DSK_TENSOR_IMPLEMENTATION\n#define DSK_CKPT_IMPLEMENTATION\n#include "dsk_ckpt.h"\n#include <stdio.h>
int main(void) { printf("%%s|%%s\\n", dsk_ckpt_options(), dsk_safetensors_options()); return 0; }\n' >"$work/opt.$id.c"
    want_st=""; case $sw in *NO_SSE42*) want_st=DSK_SAFETENSORS_NO_SSE42 ;; esac
    if ! out=$(gcc -std=c11 -O0 -Wall -Wextra -Werror -I. $sw "$work/opt.$id.c" -o "$work/opt.$id" -lm -lpthread 2>&1); then
      echo "FAIL $label: does not build"; echo "$out" | head -10
    elif [ "$("$work/opt.$id")" = "$want|$want_st" ]; then echo "ok   $label"
    else echo "FAIL $label: it says \"$("$work/opt.$id")\""; fi >"$work/res.$id" ) &
done
# dsk_moe.h built without dsk_amp.h has no block quantiser: FP8 dispatch and FP8 experts are refused at
# init, naming it
[ "$n_jobs" -gt "$max_jobs" ] && wait -n
n_jobs=$((n_jobs + 1)) n_done=$((n_done + 1))
( id=$(printf '%03d' "$n_done") label="dsk_moe.h without dsk_amp.h refuses FP8 dispatch and FP8 experts (DSK_ERR_UNSUPPORTED)"
  cat >"$work/noamp.$id.c" <<'EOF'
#define DSK_TENSOR_IMPLEMENTATION
#define DSK_COMM_IMPLEMENTATION
#define DSK_MOE_IMPLEMENTATION
#include "dsk_moe.h"
#include <stdio.h>
#include <string.h>
int main(void) {
    dsk_moe m;
    dsk_moe_opts o;
    memset(&o, 0, sizeof o);
    o.d_model = 16; o.n_routed = 4; o.top_k = 2; o.d_expert = 8; o.ep_dispatch = DSK_MOE_DISPATCH_FP8;
    if (dsk_moe_init(&m, NULL, &o) != DSK_ERR_UNSUPPORTED) return 1;
    puts(dsk_last_error());
    o.ep_dispatch = DSK_MOE_DISPATCH_ACT; o.expert_gemm = DSK_MOE_GEMM_FP8;
    if (dsk_moe_init(&m, NULL, &o) != DSK_ERR_UNSUPPORTED) return 1;
    puts(dsk_last_error());
    return 0;
}
EOF
  if ! out=$(gcc -std=c11 -O0 -Wall -Wextra -Werror -I. "$work/noamp.$id.c" -o "$work/noamp.$id" -lm -lpthread 2>&1); then
    echo "FAIL $label: does not build"; echo "$out" | head -10
  elif out=$("$work/noamp.$id") && echo "$out" | grep -q "FP8 dispatch needs dsk_amp.h" &&
       echo "$out" | grep -q "FP8 experts need dsk_amp.h"; then echo "ok   $label"
  else echo "FAIL $label: it says \"$out\""; fi >"$work/res.$id" ) &
# DSK_COMM_NO_LAUNCHER: dsk_comm.h without its fork/exec launcher.
sw_src=$(printf '#define DSK_COMM_IMPLEMENTATION\n#include "dsk_comm.h"\n')
compile "dsk_comm.h, DSK_COMM_NO_LAUNCHER, gcc -std=c11 -O0" gcc -std=c11 -O0 -DDSK_COMM_NO_LAUNCHER -x c <<<"$sw_src"
compile "dsk_comm.h, DSK_COMM_NO_LAUNCHER, g++ -std=c++17 -O0" g++ -std=c++17 -O0 -DDSK_COMM_NO_LAUNCHER -x c++ <<<"$sw_src"
[ "$n_jobs" -gt "$max_jobs" ] && wait -n
n_jobs=$((n_jobs + 1)) n_done=$((n_done + 1))
( label="DSK_COMM_NO_LAUNCHER: dsk_comm_spawn_local is gone"
  printf '#include "dsk_comm.h"\nint f(char **a) { int w; return (int)dsk_comm_spawn_local(2, a, NULL, &w); }\n' \
    >"$work/gone_launcher.c"
  if out=$(gcc -std=c11 -fsyntax-only -Wall -Wextra -Werror -I. -DDSK_COMM_NO_LAUNCHER "$work/gone_launcher.c" 2>&1); then
    echo "FAIL $label: it still compiles"
  elif echo "$out" | grep -q "dsk_comm_spawn_local"; then echo "ok   $label"
  else echo "FAIL $label"; echo "$out" | head -5; fi >"$work/res.$(printf '%03d' "$n_done")" ) &
for sw in "" "-DDSK_COMM_NO_LAUNCHER"; do
  [ "$n_jobs" -gt "$max_jobs" ] && wait -n
  n_jobs=$((n_jobs + 1)) n_done=$((n_done + 1))
  ( id=$(printf '%03d' "$n_done") want="${sw#-D}"
    label="dsk_comm_options reports \"$want\" (built with ${sw:-no switch})"
    printf '#define DSK_TENSOR_IMPLEMENTATION\n#define DSK_COMM_IMPLEMENTATION\n#include "dsk_comm.h"\n#include <stdio.h>
int main(void) { printf("%%s\\n", dsk_comm_options()); return 0; }\n' >"$work/opt.$id.c"
    if ! out=$(gcc -std=c11 -O0 -Wall -Wextra -Werror -I. $sw "$work/opt.$id.c" -o "$work/opt.$id" -lm -lpthread -lrt 2>&1); then
      echo "FAIL $label: does not build"; echo "$out" | head -10
    elif [ "$("$work/opt.$id")" = "$want" ]; then echo "ok   $label"
    else echo "FAIL $label: it says \"$("$work/opt.$id")\""; fi >"$work/res.$id" ) &
done
wait
for r in "$work"/res.*; do
  cat "$r"
  if head -n 1 "$r" | grep -q '^ok'; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
done
echo "[test_headers] totals: $passed passed / $failed failed / 0 skipped"
[ "$failed" -eq 0 ]
