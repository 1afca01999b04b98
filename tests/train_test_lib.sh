# tests/train_test_lib.sh - what the trainer's shell tests share. Set TEST_NAME, then source it:
# the repository becomes the working directory; BUILD (default build), BIN (the CPU trainer; set
# it again after sourcing for another build) and PY are set; every rank runs one passive OpenMP
# thread (tiny models gain nothing from more, and spinning threads on a busy machine cost far
# more than they give); $work is a scratch directory removed at exit; ok/bad/skip count cases,
# finish prints the totals line and exits non-zero on a failure; need_built BIN builds BIN or
# fails the program.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD=${BUILD:-build}
BIN=$BUILD/examples/train_moe
PY=python3
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
passed=0 failed=0 skipped=0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

ok() { echo "ok   $1"; passed=$((passed + 1)); }
bad() { echo "FAIL $1"; shift; for l in "$@"; do echo "     $l"; done; failed=$((failed + 1)); }
skip() { echo "skip $1"; skipped=$((skipped + 1)); }
finish() { echo "[$TEST_NAME] totals: $passed passed / $failed failed / $skipped skipped"; [ "$failed" -eq 0 ]; exit $?; }
need_built() {
    if ! make --no-print-directory -s BUILD="$BUILD" "$1" >"$work/build.log" 2>&1; then
        cat "$work/build.log"
        bad "build $1" "make failed"
        finish
    fi
}
