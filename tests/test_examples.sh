#!/usr/bin/env bash
# The example at the top of every dsk header compiles. The block (DESIGN.md, Layout of a header)
# sits in the header's opening comment between a line
#      Example (given PARAMETERS):        or        Example:
# (PARAMETERS may run over several lines; the marker ends at the first line ending "):") and a line
#      End of example.
# (each indented three spaces, alone on its line). Its lines are the body of
# `int dsk_example_<module>(PARAMETERS)` (what the caller already has; `void` for `Example:`),
# compiled with -Wall -Wextra -Werror against the headers' declarations as C11 at -O2 and as
# C++17; #line directives point every message at the header's own lines. An example uses every
# status it gets: no call of a function returning dsk_status stands as a bare statement (its
# outputs are unset when it fails, as test_amp_gpu's stats were). The implementations are not
# compiled in: gcc -O2 would then flag every output read after a checked call, since it cannot
# see that dsk_set_error returns its (non-OK) first argument.
cd "$(dirname "$0")/.."
passed=0 failed=0 skipped=0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

ok() { echo "ok   $1"; passed=$((passed + 1)); }
bad() { echo "FAIL $1"; [ -n "${2:-}" ] && echo "$2" | head -30; failed=$((failed + 1)); }

# Prints the example of header $1 as a C function, or nothing when it has none. Only the opening
# comment (up to the first */) is searched.
extract() {
  local h=$1 mod
  mod=$(basename "$h" .h | sed 's/^dsk_//')
  awk -v h="$h" -v mod="$mod" '
    function open_fn(params) {
      printf "int dsk_example_%s(%s);\nint dsk_example_%s(%s) {\n#line %d \"%s\"\n", mod, params, mod, params, NR + 1, h
      in_ex = 1
    }
    in_ex && /^   End of example\.$/ { print "    return 0;\n}"; done = 1; exit }
    in_ex { print; next }
    in_given { given = given " " $0; if (given ~ /\):$/) { in_given = 0; sub(/\):$/, "", given); open_fn(given) } next }
    /^   Example:$/ { open_fn("void"); next }
    /^   Example \(given / {
      given = substr($0, 19)
      if (given ~ /\):$/) { sub(/\):$/, "", given); open_fn(given) } else in_given = 1
      next
    }
    /\*\// { exit }
    END { if ((in_ex || in_given) && !done) print "#error \"" h ": Example without End of example.\"" }
  ' "$h"
}

# Every function that returns a dsk_status, as an alternation for grep -E.
status_fns=$(grep -ohE 'DSK_API dsk_status [a-z0-9_]+\(' dsk_*.h | sed -E 's/DSK_API dsk_status ([a-z0-9_]+)\(/\1/' |
             sort -u | paste -sd'|')
prelude=$(printf '#include "%s"\n' dsk_*.h; printf '#include <stdio.h>\n#include <string.h>\n')
all="$work/all.c"
echo "$prelude" >"$all"
for h in dsk_*.h; do
  ex=$(extract "$h")
  if [ -z "$ex" ]; then
    bad "$h has an example block (\"   Example (given ...):\" .. \"   End of example.\" in its opening comment)"
    continue
  fi
  ok "$h has an example block ($(echo "$ex" | grep -c .) lines)"
  printf '%s\n%s\n' "$prelude" "$ex" >"$work/one.c"
  for lang in "gcc -std=c11 -O2 -x c" "g++ -std=c++17 -x c++"; do
    if out=$($lang -c -o /dev/null -Wall -Wextra -Werror -I. "$work/one.c" 2>&1); then
      ok "$h example compiles with the declarations (${lang% -x*})"
    else
      bad "$h example compiles with the declarations (${lang% -x*})" "$out"
    fi
  done
  bare=$(echo "$ex" | sed -E 's#//.*##' | grep -nE "(^|[;{]|else)[[:space:]]*($status_fns)\(")
  if [ -z "$bare" ]; then
    ok "$h example uses the status of every call that returns one"
  else
    bad "$h example uses the status of every call that returns one (a bare call leaves its outputs unset on failure)" "$bare"
  fi
  echo "$ex" >>"$all"
done
if out=$(gcc -std=c11 -O2 -Wall -Wextra -Werror -I. -c -o /dev/null "$all" 2>&1); then
  ok "every example in one file (gcc -O2)"
else
  bad "every example in one file (gcc -O2)" "$out"
fi
echo "[test_examples] totals: $passed passed / $failed failed / $skipped skipped"
[ "$failed" -eq 0 ]
