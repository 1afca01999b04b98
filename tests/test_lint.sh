#!/usr/bin/env bash
# `make lint` (scripts/lint.sh) in `make test`: every check passes on this tree, and fails, naming
# what it found, on a copy of the tree with one violation planted for each check.
set -u
cd "$(dirname "$0")/.."
passed=0 failed=0 skipped=0
ok() { echo "ok   $1"; passed=$((passed + 1)); }
bad() { echo "FAIL $1"; shift; printf '%s\n' "$@" | head -40 | sed 's/^/     /'; failed=$((failed + 1)); }
skip() { echo "skip $1"; skipped=$((skipped + 1)); }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The copy's commits: no hooks or signing from the caller's configuration.
lint_git() { git -C "$work/tree" -c user.name=lint -c user.email=lint@localhost -c core.hooksPath=/dev/null \
    -c commit.gpgsign=false "$@"; }

# This tree: each check on its own.
# A check that cannot run here (no base commit, no git clang-format) says "skipped (why)".
# Its planted violations below are skipped too, for the same reason (why_skipped).
declare -A why_skipped
for c in format columns state cuda includes commits places; do
    out=$(bash scripts/lint.sh "$c" 2>&1)
    rc=$?
    first=$(echo "$out" | head -1)
    if [ "$rc" -eq 0 ] && [[ $first == "ok   $c: skipped ("* ]]; then
        skip "lint $c: ${first#ok   }"; why_skipped[$c]=${first#ok   $c: }
    elif [ "$rc" -eq 0 ] && [[ $first == "ok   $c: "* ]]; then ok "lint $c passes on this tree: ${first#ok   }"
    else bad "lint $c passes on this tree" "$out"; fi
done

if ! git rev-parse -q --verify HEAD >/dev/null 2>&1; then
    skip "lint: the planted violations (not a git repository: the copy is made from git's file list)"
    echo "[test_lint] totals: $passed passed / $failed failed / $skipped skipped"
    exit 0
fi

# fails_naming label, pattern (grep -E), lint arguments...: the check, run in the copy, fails
# and its output matches the pattern. The run's output and status stay in $lint_out / $lint_rc
# for failed_naming, which checks more patterns against the same run.
fails_naming() {
    local label=$1 pattern=$2
    shift 2
    lint_out=$(cd "$work/tree" && env "${lint_env[@]}" bash scripts/lint.sh "$@" 2>&1)
    lint_rc=$?
    failed_naming "$label" "$pattern"
}
failed_naming() { # label, pattern: of the last fails_naming's run
    if [ "$lint_rc" -ne 0 ] && echo "$lint_out" | grep -qE "$2"; then ok "$1"
    else bad "$1" "exit status $lint_rc; want non-zero and output matching: $2" "$lint_out"; fi
}

# The copy: the files git sees (tracked, and new ones not ignored) as they are in the working tree, committed in a repository of their own.
mkdir -p "$work/tree"
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$work/tree"
lint_git init -q -b main && lint_git add -A && lint_git commit -q -m "the tree as it is" || {
    bad "a copy of the tree in a repository of its own"; echo "[test_lint] totals: $passed passed / $failed failed / $skipped skipped"; exit 1; }
base=$(lint_git rev-parse HEAD)
lint_env=(LINT_BASE="$base" LINT_COMMIT_BASE="$base")

# Untouched lines that clang-format would write otherwise do not fail the format check.
untouched=$(cd "$work/tree" && clang-format dsk_tensor.h 2>/dev/null | diff dsk_tensor.h - | grep -c '^<')
if out=$(cd "$work/tree" && env "${lint_env[@]}" bash scripts/lint.sh format 2>&1); then
    ok "format: no changed line, no failure (clang-format would rewrite $untouched untouched lines of dsk_tensor.h)"
else bad "format: no changed line, no failure" "$out"; fi

# The plants, one per check, each in a file of its own (and formatted but for the format plant).
t=$work/tree
echo 'int   dsk_lint_planted_format(void){return 1;}' >>"$t/tests/test_par.c"
printf '/* dsk_lint_planted_columns %s */\n' "$(printf 'x%.0s' $(seq 100))" >>"$t/tests/test_amp.c"
cols_line=$(wc -l <"$t/tests/test_amp.c")
cat >>"$t/dsk_par.h" <<'PLANT'
int dsk__lint_planted_state;
int dsk__lint_planted_calls(void) {
    static int planted_n;
    return ++planted_n;
}
const char *dsk__lint_planted_name(int i) {
    static const char *planted_names[] = {"a", "b"};
    return planted_names[i & 1];
}
PLANT
echo 'int dsk__lint_planted_kernel_state;' >>"$t/kernels/par.cu"
echo 'static inline int dsk__lint_planted_cuda(void) { return (int)cudaDeviceSynchronize(); }' >>"$t/dsk_amp.h"
if [ -n "${why_skipped[format]:-}" ]; then
    skip "format's planted line: ${why_skipped[format]}"
else
    fails_naming "format fails on a planted line, naming it and nothing else" \
        'dsk_lint_planted_format' format
    others=$(echo "$lint_out" | grep -oE '^     \| diff --git a/[^ ]+' | grep -v 'tests/test_par.c' | head -3)
    if [ -z "$others" ] && echo "$lint_out" | grep -q '^     | diff --git a/tests/test_par.c'; then
        ok "format's diff is of the planted file only"
    else bad "format's diff is of the planted file only" "also: $others"; fi
fi
fails_naming "columns fails on a planted line of 131 columns, naming file, line and width" \
    "tests/test_amp.c:$cols_line: $(tail -1 "$t/tests/test_amp.c" | awk "{ print length }") columns" columns
# One run of the state check (it compiles what it reads) for the three plants and the static below.
fails_naming "state fails on a planted static (dsk_par.h:dsk__lint_planted_state), naming it" \
    "above the baseline: dsk_par.h:dsk__lint_planted_state: 1, baseline 0" state dsk_par.h kernels/par.cu
for sym in dsk_par.h:planted_n kernels/par.cu:dsk__lint_planted_kernel_state; do
    failed_naming "state fails on a planted static ($sym), naming it" "above the baseline: $sym: 1, baseline 0"
done
# A static the code never writes is folded into read-only data: not state.
if echo "$lint_out" | grep -q 'planted_state' && ! echo "$lint_out" | grep -q 'planted_names'; then
    ok "state passes over a static array of pointers that nothing writes"
else bad "state passes over a static array of pointers that nothing writes" "$lint_out"; fi
fails_naming "cuda fails on a planted cudaDeviceSynchronize() in dsk_amp.h, naming the file" \
    'above the baseline: dsk_amp.h: 1, baseline 0' cuda

# The baseline only goes down: a count the code is below fails until the baseline says so.
git -C "$t" checkout -q -- dsk_amp.h
echo 'cuda dsk_zero.h 1' >>"$t/tests/lint_baseline.txt"
fails_naming "cuda fails below its baseline (dsk_zero.h allowed 1, has 0) until the baseline is lowered" \
    'below the baseline.*dsk_zero.h: 0, baseline 1: lower' cuda
git -C "$t" checkout -q -- tests/lint_baseline.txt

# Includes: upward, into kernels/, a kernel above its owner, one DESIGN.md does not list, a kernel
# without owner, and the cycles the first two make.
# cycle_fails file header why cycle: `#include "header"` planted at the end of file fails the check,
# naming the line and why (a pattern), and names the cycle it makes (a pattern of its files).
cycle_fails() {
    local f=$1 h=$2
    echo "#include \"$h\"" >>"$t/$f"
    fails_naming "includes fails on $f including $h, naming the line" "$f:$(wc -l <"$t/$f"): includes $h $3" includes
    failed_naming "includes names the cycle $f -> $h -> $f" "an include cycle through: .*$4"
    git -C "$t" checkout -q -- "$f"
}
cycle_fails dsk_comm.h dsk_zero.h "\\(floor 3, not below dsk_comm.h's floor 1\\)" 'dsk_(comm|zero).h'
cycle_fails dsk_tensor.h kernels/dsk_cuda.cuh "\\(a header includes no kernels/" '(dsk_tensor.h|kernels/dsk_cuda.cuh)'
echo '#include "dsk_zero.h"' >>"$t/kernels/moe.cu"
fails_naming "includes fails on kernels/moe.cu including dsk_zero.h, above its owner dsk_moe.h" \
    "kernels/moe.cu:[0-9]+: includes dsk_zero.h \\(floor 3, not below its owner dsk_moe.h's floor 2\\)" includes
git -C "$t" checkout -q -- kernels/moe.cu
echo '#include "dsk_amp.h"' >>"$t/dsk_par.h"
fails_naming "includes fails on dsk_par.h including dsk_amp.h, which DESIGN.md's diagram does not list" \
    "dsk_par.h:[0-9]+: includes dsk_amp.h, which DESIGN.md's diagram does not list" includes
git -C "$t" checkout -q -- dsk_par.h
echo '#include "dsk_cuda.cuh"' >"$t/kernels/planted.cu"
fails_naming "includes fails on a kernel no header declares the launchers of" \
    'kernels/planted.cu: no owner' includes
rm -f "$t/kernels/planted.cu"

# DESIGN.md section 6's places: one more in the code, or another number in DESIGN.md.
planted_places() {
    echo 'static inline float dsk__lint_planted_place(float x) { return dsk_ew_f(DSK_EW_AXPY, x, x, 1.0f); }' \
        >>"$t/dsk_tensor.h"
    fails_naming "places fails on a seventh place for an elementwise op of its own form, naming it" \
        'own form \(as dsk_axpy\) is 7 places in 3 files' places
    fails_naming "places names the new place" 'dsk_tensor.h: .*dsk__lint_planted_place' places
    git -C "$t" checkout -q -- dsk_tensor.h
    echo 'static inline float dsk__lint_planted_mul(float x) { return dsk_ew_f(DSK_EW_MUL, x, x, 1.0f); }' >>"$t/dsk_tensor.h"
    fails_naming "places fails on a sixth place for a BINARY elementwise op" 'BINARY form \(as dsk_mul\) is 6 places in 3 files' places
    git -C "$t" checkout -q -- dsk_tensor.h
    echo 'static inline int dsk__lint_planted_score(int s) { return s == DSK_MOE_SIGMOID; }' >>"$t/dsk_moe.h"
    fails_naming "places fails on one more place for a router score" \
        'router score function \(as DSK_MOE_SIGMOID\) is [0-9]+ places in [0-9]+ files; DESIGN.md section 6 says' places
    fails_naming "places names the router score's new place" 'dsk_moe.h: .*dsk__lint_planted_score' places
    git -C "$t" checkout -q -- dsk_moe.h
    tr '\n' '\v' <"$t/DESIGN.md" | sed -E 's/(its body \(argument checks, then `dsk__ew_run`\): )six/\1seven/' |
        tr '\v' '\n' >"$t/design" && mv "$t/design" "$t/DESIGN.md"
    fails_naming "places fails when DESIGN.md says seven places for an op of its own form" \
        'own form \(as dsk_axpy\) is 6 places in 3 files; DESIGN.md section 6 says' places
    git -C "$t" checkout -q -- DESIGN.md
    echo '/* dsk_mul_planted_comment: dsk_status dsk_mul( DSK_EW_MUL */' >>"$t/dsk_tensor.h"
    if out=$(cd "$t" && env "${lint_env[@]}" bash scripts/lint.sh places 2>&1); then
        ok "places passes over a comment that names an op (comments are not places)"
    else bad "places passes over a comment that names an op (comments are not places)" "$out"; fi
    git -C "$t" checkout -q -- dsk_tensor.h
}
if [ -n "${why_skipped[places]:-}" ]; then skip "places' planted places: ${why_skipped[places]}"
else planted_places; fi

# Commit subjects: a long one, and one without its why, fail; a good commit passes.
long_subject="lint: a planted subject of eighty characters, longer than seventy-two xxxxxxxxxx"
lint_git commit -q -a -m "$long_subject" -m "The why."
lint_git commit -q --allow-empty -m "lint: a planted subject without a body"
fails_naming "commits fails on a subject of 80 characters, naming the commit" \
    "$(lint_git rev-parse --short=12 HEAD~1) subject of ${#long_subject} characters \\(at most 72\\)" commits
fails_naming "commits fails on a commit without a body" \
    "$(lint_git rev-parse --short=12 HEAD) no body" commits
lint_env=(LINT_BASE="$base" LINT_COMMIT_BASE="$(lint_git rev-parse HEAD)")
lint_git commit -q --allow-empty -m "lint: a good subject" -m "The why, after a blank line."
if out=$(cd "$t" && env "${lint_env[@]}" bash scripts/lint.sh commits 2>&1); then ok "commits passes on a good commit"
else bad "commits passes on a good commit" "$out"; fi

# The default base: on a branch, the merge-base with main; on main, HEAD~1.
lint_git checkout -q -b topic
lint_git commit -q --allow-empty -m "lint: on a topic branch" -m "Why: to see the base."
out=$(cd "$t" && env LINT_COMMIT_BASE="$base" bash scripts/lint.sh columns 2>&1)
mb=$(lint_git merge-base HEAD main)
if echo "$out" | grep -q "since ${mb:0:12}"; then ok "default base on a branch: the merge-base with main"
else bad "default base on a branch: the merge-base with main (${mb:0:12})" "$out"; fi
lint_git checkout -q main
out=$(cd "$t" && bash scripts/lint.sh columns 2>&1)
if echo "$out" | grep -q "since $(lint_git rev-parse --short=12 HEAD~1)"; then ok "default base on main: HEAD~1"
else bad "default base on main: HEAD~1" "$out"; fi

echo "[test_lint] totals: $passed passed / $failed failed / $skipped skipped"
[ "$failed" -eq 0 ]
