#!/usr/bin/env bash
# The POSIX headers (dsk_comm.h, dsk_ckpt.h, dsk_safetensors.h) work in any order in one file with
# their implementations, as C11 and C++17; a system header before them without POSIX is a #error
# that says what to do, not a cascade of implicit declarations.
cd "$(dirname "$0")/.."
passed=0 failed=0
ok() { echo "ok   $1"; passed=$((passed + 1)); }
bad() { echo "FAIL $1"; echo "$2" | head -10; failed=$((failed + 1)); }
tu() { # first header, second header [, a line before them] (dsk_safetensors.h alone: its own implementation)
  local impl=DSK_CKPT_IMPLEMENTATION
  [ "$1 $2" = "dsk_safetensors.h dsk_tensor.h" ] && impl=DSK_SAFETENSORS_IMPLEMENTATION
  printf '%s\n#define DSK_TENSOR_IMPLEMENTATION\n#define DSK_COMM_IMPLEMENTATION\n#define %s\n' "$3" "$impl"
  printf '#include "%s"\n#include "%s"\nint main(void) { return 0; }\n' "$1" "$2"
}
for order in "dsk_ckpt.h dsk_comm.h" "dsk_comm.h dsk_ckpt.h" "dsk_tensor.h dsk_ckpt.h" "dsk_safetensors.h dsk_ckpt.h" \
             "dsk_ckpt.h dsk_safetensors.h" "dsk_safetensors.h dsk_comm.h" "dsk_safetensors.h dsk_tensor.h"; do
  set -- $order
  for lang in "gcc -std=c11 -x c" "g++ -std=c++17 -x c++"; do
    if out=$(tu "$1" "$2" | $lang -fsyntax-only -Wall -Wextra -Werror -I. - 2>&1); then ok "$1 then $2 (${lang% -x*})"
    else bad "$1 then $2 (${lang% -x*})" "$out"; fi
  done
done
# A system header first: strict C11 hides POSIX, and the message says how to order the file.
for h in dsk_ckpt.h dsk_comm.h dsk_safetensors.h; do
  out=$(tu "$h" dsk_tensor.h '#include <stdio.h>' | gcc -std=c11 -x c -fsyntax-only -Wall -Wextra -I. - 2>&1)
  first=$(echo "$out" | grep -m1 'error')
  if echo "$first" | grep -q "needs POSIX 2008: put the DSK_\*_IMPLEMENTATION defines and dsk includes before any"; then
    ok "<stdio.h> before $h: the first error says what to do"
  else bad "<stdio.h> before $h: the first error says what to do" "$first"; fi
  if out=$(tu "$h" dsk_tensor.h '#include <stdio.h>' | gcc -std=c11 -D_GNU_SOURCE -x c -fsyntax-only -Wall -Wextra \
           -Werror -I. - 2>&1); then ok "<stdio.h> before $h with -D_GNU_SOURCE"
  else bad "<stdio.h> before $h with -D_GNU_SOURCE" "$out"; fi
done
echo "[test_include_order] totals: $passed passed / $failed failed / 0 skipped"
[ "$failed" -eq 0 ]
