#!/usr/bin/env bash
# The harness itself can fail: a program whose only failed check is outside any case must
# exit non-zero and count that check as a failed case in its totals line; a program whose
# checks all pass exits 0.
cd "$(dirname "$0")/.."
passed=0 failed=0
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
expect() { # label, condition (0 = held)
  if [ "$2" -eq 0 ]; then echo "ok   $1"; passed=$((passed + 1)); else echo "FAIL $1"; failed=$((failed + 1)); fi
}
build() { # name, body of main between init and finish
  printf '#include "tests/dsk_test.h"\nint main(void) {\n    dsk_test_init("%s");\n%s\n    return dsk_test_finish();\n}\n' \
    "$1" "$2" | gcc -std=c11 -Wall -Wextra -Werror -I. -x c - -o "$dir/$1" -lm
}
build outside '    DSK_TEST_EXPECT(1 + 1 == 3, "setup check");
    dsk_test_begin("a passing case"); DSK_TEST_EXPECT(1 == 1, "fine"); dsk_test_end();'
out=$("$dir/outside"); rc=$?
expect "a failed check outside any case exits non-zero (status $rc)" $([ $rc -ne 0 ]; echo $?)
expect "and its totals line counts it as failed" $(grep -q '^\[outside\] totals: 1 passed / 1 failed / 0 skipped$' <<<"$out"; echo $?)
build inside '    dsk_test_begin("a failing case"); DSK_TEST_EXPECT(2 < 1, "wrong"); dsk_test_end();'
out=$("$dir/inside"); rc=$?
expect "a failed check inside a case exits non-zero (status $rc)" $([ $rc -ne 0 ]; echo $?)
expect "and fails exactly that case" $(grep -q '^\[inside\] totals: 0 passed / 1 failed / 0 skipped$' <<<"$out"; echo $?)
build clean '    dsk_test_begin("a passing case"); DSK_TEST_EXPECT(1 == 1, "fine"); dsk_test_end();'
out=$("$dir/clean"); rc=$?
expect "all checks passing exits 0 (status $rc)" $rc
echo "[test_harness] totals: $passed passed / $failed failed / 0 skipped"
[ "$failed" -eq 0 ]
