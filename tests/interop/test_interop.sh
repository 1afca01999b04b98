#!/usr/bin/env bash
# dsk <-> Python safetensors, both directions: files dsk writes load in the `safetensors`
# package (safetensors.numpy.load_file, and its own parser for bf16/fp8), and files the
# package writes load in dsk (tests/test_safetensors.c, dsk_safetensors.h alone, reading the
# files Python writes here; make test runs it on the copies kept in tests/interop/py and edge).
# Builds tests/interop/st_tool.c itself (CPU only); test_safetensors is the build's (make builds it).
# Needs python3 with safetensors and numpy (.ci/run installs them).
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
PY=${PYTHON:-python3}
CC=${CC:-cc}
out=$BUILD/tests/interop
mkdir -p "$out"
log=$(mktemp)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp" "$log"' EXIT

finish() { # counts the ok/FAIL/skip lines and prints the harness totals line
  local p f s
  p=$(grep -c '^ok ' "$log"); f=$(grep -c '^FAIL ' "$log"); s=$(grep -c '^skip ' "$log")
  echo "[test_interop] totals: $p passed / $f failed / $s skipped"
  [ "$f" -eq 0 ]
  exit $?
}
step() { # label, command...: runs it, keeps its case lines, fails the label if it dies without any
  local label=$1; shift
  local before; before=$(grep -c '' "$log")
  "$@" >>"$log" 2>&1
  local rc=$?
  if [ "$rc" -ne 0 ] && [ "$(grep -c '^FAIL ' <(tail -n +"$((before + 1))" "$log"))" -eq 0 ]; then
    echo "FAIL $label: exited with status $rc" >>"$log"
  fi
}

if ! "$PY" -c 'import safetensors, numpy' 2>/dev/null; then
  echo "skip python interop: $PY lacks safetensors or numpy (.ci/run installs them)" >>"$log"
  cat "$log"; finish
fi
if ! $CC -std=c11 -O2 -Wall -Wextra -Werror -D_GNU_SOURCE -I. tests/interop/st_tool.c -o "$out/st_tool" -lm -lpthread >>"$log" 2>&1; then
  echo "FAIL build st_tool" >>"$log"
  cat "$log"; finish
fi
if ! make --no-print-directory -s BUILD="$BUILD" "$BUILD/tests/test_safetensors" >>"$log" 2>&1; then
  echo "FAIL build $BUILD/tests/test_safetensors" >>"$log"
  cat "$log"; finish
fi
step "dsk writes" "$out/st_tool" write "$tmp/dsk"
step "python reads dsk files" "$PY" tests/interop/check_safetensors.py read-dsk "$tmp/dsk"
step "python writes" "$PY" tests/interop/check_safetensors.py write-py "$tmp/py"
step "python writes header edge cases" "$PY" tests/interop/check_safetensors.py edge-cases "$tmp/edge"
step "dsk reads python files and answers the edge cases as the reference does" \
  "$BUILD/tests/test_safetensors" "$tmp/py" "$tmp/edge"
step "python writes a DeepSeek-layout sharded model" "$PY" tests/interop/check_safetensors.py hf-write-py "$tmp/hfpy"
step "dsk reads it, experts stacked" "$out/st_tool" hf-read "$tmp/hfpy"
step "dsk exports stacked experts in that layout" "$out/st_tool" hf-write "$tmp/hfdsk"
step "python reads dsk's sharded export" "$PY" tests/interop/check_safetensors.py hf-read-dsk "$tmp/hfdsk"
cat "$log"
finish
