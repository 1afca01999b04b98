#!/usr/bin/env bash
# Runs every test program and script, then prints the totals line `N passed, M failed, K skipped`
# last; exits non-zero when anything failed. `run_tests.sh gpu` runs only the GPU tests.
# Each program prints `[name] totals: P passed / F failed / S skipped`; one that dies or
# exits non-zero without failing a case counts as one failed case.
# GPU tests run against the CPU emulation of CUDA (build/emu) and, on a machine with a GPU
# (or when there is no emulated build), as built by nvcc (build/tests/gpu). The emulated runs record
# every kernel launch; the coverage line names the kernels of kernels/*.cu none of them
# launched, and a non-empty list counts as a failure.
# CPU instruction sets: the CPU GEMM has one micro-kernel per ISA (portable, avx2, avx512), which
# DSK_CPU_ISA selects. Everything runs under the best ISA here; each other ISA this machine
# has runs ISA_PROGS again (the op tests that compare layouts, ranks and devices bit for bit),
# and avx2, where it is not the best, also ISA_SCRIPTS (the trainer's numeric-equality scripts, with
# ISA_RERUN=1: the cases that compare numbers, not those that test orchestration or bad input:
# AVX2 is what CI machines without AVX-512 run; the portable kernel, which no x86-64 machine
# picks, is covered by test_tensor's every-ISA loop and test_moe_golden). Their cases count with
# "@<isa>" in the name. DSK_CPU_ISA set by the caller: only that ISA, everything under it.
# A second lane: the tests named in LANE run one after another in the background while the others
# run; their output prints, in order, before the totals. In it: those that mostly wait, on
# timeouts and killed ranks (test_comm spends a fifth of its time on a CPU), and trainer
# comparisons that time nothing (the layouts of test_par_train, the FP8 runs, the planner's figures,
# test_hf's Python), about half of the suite's time, so that a 2-core machine keeps both cores busy
# (a clean clone's .ci/run on a 2-core Zen 4, 2026-12-07: 317 s against the other lane's 295).
# Tests that time signals against a running trainer (test_prod) stay out of it.
set -u
BUILD=${BUILD:-build}
cd "$(dirname "$0")/.."
passed=0 failed=0 skipped=0
log=$(mktemp)
cov=$(mktemp -d)

ISA_PROGS=${ISA_PROGS-test_amp test_moe test_par test_zero}
ISA_SCRIPTS=${ISA_SCRIPTS-test_par_train.sh test_zero_train.sh}
ISA_SCRIPT_ISAS=${ISA_SCRIPT_ISAS-avx2}

LANE=${LANE-test_par_train.sh test_comm test_fp8_train.sh test_fp8_comm.sh test_plan.sh test_plan_rank.sh test_hf.sh}
lane=$(mktemp -d)
lane_n=0 lane_pid=
trap 'rm -rf "$log" "$cov" "$lane"' EXIT

in_lane() { case " $LANE " in *" $1 "*) return 0 ;; esac; return 1; }

# timed LOG COMMAND...: runs COMMAND with its output in LOG; prints "status wall-seconds cpu-seconds" (cpu: user and
# system time of COMMAND and its children, what a 2-core CI machine's budget is spent in)
timed() {
  local log=$1 t rc TIMEFORMAT='%R %U %S'
  shift
  t=$({ time "$@" >"$log" 2>&1; } 2>&1)
  rc=$?
  echo "$rc $(echo "$t" | tail -n 1 | awk '{ printf "%.0f %.0f", $1, $2 + $3 }')"
}

run_one() { # name, command... (a name "prog@isa" marks each output line with @isa)
  local name=$1 rc secs cpu; shift
  read -r rc secs cpu < <(timed "$log" "$@")
  account "$name" "$log" "$rc" "$secs" "$cpu"
}

# Runs the LANE tests among names/commands "name|command words" in the background.
start_lane() {
  ( i=0
    for job in "$@"; do
      i=$((i + 1))
      echo "$(timed "$lane/$i.log" bash -c "${job#*|}") ${job%%|*}" >"$lane/$i.rc"
    done ) &
  lane_pid=$! lane_n=$#
}

finish_lane() {
  [ -n "$lane_pid" ] || return 0
  wait "$lane_pid"
  local i rc secs cpu name
  for ((i = 1; i <= lane_n; i++)); do
    read -r rc secs cpu name <"$lane/$i.rc"
    account "$name" "$lane/$i.log" "$rc" "$secs" "$cpu"
  done
}

account() { # name, log, exit status, seconds, CPU seconds
  local name=$1 log=$2 rc=$3 secs=$4 cpu=$5
  case $name in *@*) sed "s/^/@${name##*@} /" "$log" ;; *) cat "$log" ;; esac
  local line
  line=$(grep -E '^\[.*\] totals: [0-9]+ passed / [0-9]+ failed / [0-9]+ skipped$' "$log" | tail -n 1)
  if [ -n "$line" ]; then
    local p f s
    read -r p f s < <(echo "$line" | sed -E 's/.*totals: ([0-9]+) passed \/ ([0-9]+) failed \/ ([0-9]+) skipped/\1 \2 \3/')
    passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
      echo "FAIL $name exited with status $rc after its totals"; failed=$((failed + 1))
    fi
  else
    echo "FAIL $name exited with status $rc without a totals line"; failed=$((failed + 1))
  fi
  echo "# $name: $secs s (cpu $cpu s)"
}

# The CPU ISAs this machine and build have, best last: x86-64 builds always compile the AVX2 and
# AVX-512 micro-kernels (target attributes), so the CPU's flags decide.
cpu_isas() {
  echo portable
  case $(uname -m) in x86_64 | i?86) ;; *) return ;; esac
  local f
  f=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
  [[ $f == *" avx2 "* && $f == *" fma "* ]] && echo avx2
  [[ $f == *" avx512f "* ]] && echo avx512
}

# Kernels defined in kernels/*.cu that no emulated run launched.
coverage() {
  local all launched never
  all=$(grep -ohE '__global__[^(;]*(__launch_bounds__\([^)]*\)[^(;]*)?\(' kernels/*.cu | sed -E 's/__launch_bounds__\([^)]*\)//' |
        sed -E 's/.*[^A-Za-z0-9_]([A-Za-z_][A-Za-z0-9_]*)[[:space:]]*\($/\1/' | sort -u)
  launched=$(cat "$cov"/* 2>/dev/null | awk '{print $1}' | sort -u)
  never=$(comm -23 <(echo "$all") <(echo "$launched") | tr '\n' ' ')
  echo "cuda_emu coverage: $(comm -12 <(echo "$all") <(echo "$launched") | grep -c .) of $(echo "$all" | grep -c .) kernels in kernels/*.cu launched; never launched: ${never:-(none)}"
  if [ -n "$never" ]; then echo "FAIL kernels never launched by the emulated GPU tests: $never"; failed=$((failed + 1)); fi
}

if [ "${1:-}" = gpu ]; then
  progs=""
  scripts=""
else
  progs=$(ls "$BUILD"/tests/test_* "$BUILD"/tests/trainer/test_* 2>/dev/null)
  scripts=$(ls tests/test_*.sh tests/interop/test_*.sh 2>/dev/null)
fi
if { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; } ||
   ! ls "$BUILD"/emu/tests/gpu/test_* >/dev/null 2>&1; then
  progs="$progs $(ls "$BUILD"/tests/gpu/test_* 2>/dev/null)"
elif ls "$BUILD"/tests/gpu/test_* >/dev/null 2>&1; then
  echo "# no GPU here: the nvcc-built GPU tests ($BUILD/tests/gpu) do not run; their emulated builds ($BUILD/emu) do"
fi
emu_progs=$(ls "$BUILD"/emu/tests/test_* "$BUILD"/emu/tests/gpu/test_* 2>/dev/null)

lane_jobs=()
for p in $progs; do in_lane "$(basename "$p")" && [ -x "$p" ] && lane_jobs+=("$(basename "$p")|$p"); done
for s in $scripts; do in_lane "$(basename "$s")" && lane_jobs+=("$(basename "$s")|BUILD=$BUILD bash $s"); done
[ ${#lane_jobs[@]} -gt 0 ] && start_lane "${lane_jobs[@]}"
for p in $progs; do in_lane "$(basename "$p")" || { [ -x "$p" ] && run_one "$(basename "$p")" "$p"; }; done
for p in $emu_progs; do [ -x "$p" ] && run_one "emu/$(basename "$p")" env CUDA_EMU_COVERAGE_DIR="$cov" "$p"; done
ls "$BUILD"/emu/tests/gpu/test_* >/dev/null 2>&1 && coverage
for s in $scripts; do in_lane "$(basename "$s")" || run_one "$(basename "$s")" env BUILD="$BUILD" bash "$s"; done

if [ -z "${DSK_CPU_ISA:-}" ] && [ "${1:-}" != gpu ]; then
  isas=$(cpu_isas)
  best=$(echo "$isas" | tail -n 1)
  echo "# CPU ISAs here: $(echo $isas); everything ran under $best; the others run $ISA_PROGS," \
       "and $ISA_SCRIPT_ISAS also $ISA_SCRIPTS"
  for isa in $isas; do
    [ "$isa" = "$best" ] && continue
    for p in $ISA_PROGS; do
      [ -x "$BUILD/tests/$p" ] && run_one "$p@$isa" env DSK_CPU_ISA="$isa" "$BUILD/tests/$p"
    done
    case " $ISA_SCRIPT_ISAS " in *" $isa "*) ;; *) continue ;; esac
    for s in $ISA_SCRIPTS; do run_one "$s@$isa" env DSK_CPU_ISA="$isa" ISA_RERUN=1 BUILD="$BUILD" bash "tests/$s"; done
  done
else
  [ "${1:-}" != gpu ] && echo "# CPU ISA: DSK_CPU_ISA=$DSK_CPU_ISA for every run"
fi

finish_lane
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
