#!/usr/bin/env bash
# Runs every test program and script, then prints the totals line `N passed, M failed, K skipped`
# last; exits non-zero when anything failed. `run_tests.sh gpu` runs only the GPU tests.
# Each program prints `[name] totals: P passed / F failed / S skipped`; one that dies or
# exits non-zero without failing a case counts as one failed case.
set -u
BUILD=${BUILD:-build}
cd "$(dirname "$0")/.."
passed=0 failed=0 skipped=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT

run_one() { # name, command...
  local name=$1; shift
  local start=$SECONDS
  "$@" >"$log" 2>&1
  local rc=$?
  cat "$log"
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
  echo "# $name: $((SECONDS - start)) s"
}

if [ "${1:-}" = gpu ]; then
  progs=$(ls "$BUILD"/tests/gpu/test_* 2>/dev/null)
  scripts=""
else
  progs=$(ls "$BUILD"/tests/test_* "$BUILD"/tests/gpu/test_* 2>/dev/null)
  scripts=$(ls tests/test_*.sh tests/interop/test_*.sh 2>/dev/null)
fi
for p in $progs; do [ -x "$p" ] && run_one "$(basename "$p")" "$p"; done
for s in $scripts; do run_one "$(basename "$s")" env BUILD="$BUILD" bash "$s"; done

echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
