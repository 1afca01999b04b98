# tests/train_test_lib.sh - what the trainer's shell tests share. Set TEST_NAME, then source it:
# the repository becomes the working directory; BUILD (default build), BIN (the CPU trainer; set
# it again after sourcing for another build), PY and PYS (PY -S, for standard-library helpers) are
# set; the machine's GPUs are hidden (the CPU trainer stays on the CPU); every rank runs one passive
# OpenMP thread (tiny models gain nothing from more, and spinning threads on a busy machine cost far
# more than they give); $work is a scratch directory removed at exit; ok/bad/skip count cases,
# finish prints the totals line and exits non-zero on a failure; need_built BIN builds BIN or
# fails the program.
# Every run trains on CORPUS (tests/data/corpus.txt, pass `--data "$CORPUS"`), text the repository
# fixes, never on the default corpus (the C headers under /usr/include, which differ from machine
# to machine): the program fails if the file is not the frozen one, and finish fails a case when
# any output under $work says a run read the default corpus.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD=${BUILD:-build}
BIN=$BUILD/examples/train_moe
# The interpreter itself, not a version manager's shim in front of it: pyenv's costs 60 ms a
# call, and the trainer tests make hundreds.
PY=$(python3 -c 'import sys; print(sys.executable)' 2>/dev/null)
[ -x "$PY" ] || PY=python3
# For helpers that import only the standard library: without the site module (no scan of the
# site-packages' path files), Python starts in half the time.
PYS="$PY -S"
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
# The machine's GPUs hidden: these scripts test the CPU trainer on the CPU whatever the machine has
# (--device auto would take a GPU); the emulated GPU (tests/cuda_emu) keeps its devices.
export CUDA_VISIBLE_DEVICES= CUDA_EMU_DEVICES=${CUDA_EMU_DEVICES:-4}
passed=0 failed=0 skipped=0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
CORPUS=tests/data/corpus.txt
CORPUS_SHA256=a8c75b5380b33d3cc5270667cb75b52fda82e7c4bd6ee35a1840bdcda54fb735

ok() { echo "ok   $1"; passed=$((passed + 1)); }
bad() { echo "FAIL $1"; shift; for l in "$@"; do echo "     $l"; done; failed=$((failed + 1)); }
skip() { echo "skip $1"; skipped=$((skipped + 1)); }
# hermetic: one case when any run printed its banner under $work (its "data:" line, "[rank 0] "
# before it under the launcher); fails when one names the default corpus
hermetic() {
    local default ours
    default=$(grep -rIlE '^(\[rank [0-9]+\] )?data: default corpus' "$work" 2>/dev/null | head -3)
    ours=$(grep -rIlE "^(\[rank [0-9]+\] )?data: $CORPUS " "$work" 2>/dev/null | wc -l)
    [ -z "$default" ] && [ "$ours" -eq 0 ] && return
    if [ -z "$default" ]; then
        ok "hermetic: no run read the default corpus (/usr/include); $ours runs read $CORPUS"
    else
        bad "hermetic: every run reads the repository's corpus" "runs that read the default corpus: ${default:-none}" \
            "runs that read $CORPUS: $ours"
    fi
}
finish() {
    hermetic
    echo "[$TEST_NAME] totals: $passed passed / $failed failed / $skipped skipped"
    [ "$failed" -eq 0 ]
    exit $?
}
if [ "$(sha256sum "$CORPUS" 2>/dev/null | cut -d' ' -f1)" != "$CORPUS_SHA256" ]; then
    bad "$CORPUS is the frozen corpus" "sha256 $(sha256sum "$CORPUS" 2>&1 | cut -d' ' -f1), want $CORPUS_SHA256" \
        "the tests' expectations hold for that text only; restore it from git instead of regenerating it"
    finish
fi
need_built() {
    if ! make --no-print-directory -s BUILD="$BUILD" "$1" >"$work/build.log" 2>&1; then
        cat "$work/build.log"
        bad "build $1" "make failed"
        finish
    fi
}
