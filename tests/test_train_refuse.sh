#!/usr/bin/env bash
# examples/train/refuse.h against README's table "Combinations the trainer refuses, and why": the
# table mirrors the file. Every refusal of a combination in refuse.h (a message naming two flags
# or more that is not a range: "must be at least", "must be >=", "must be in", "out of range")
# has a row of the table naming each of its flags; and every check of the trainer that refuses
# stands in refuse.h: no `fail(` of a flag combination elsewhere in examples/train_moe.c or
# examples/train/ but the two that only files can tell (ALLOWED below).
# Needs no build. Prints `[test_train_refuse] totals: P passed / F failed / S skipped`.
TEST_NAME=test_train_refuse
source "$(dirname "$0")/train_test_lib.sh"
REFUSE=${REFUSE:-examples/train/refuse.h}
README=${README:-README.md}

if [ ! -f "$REFUSE" ]; then
    bad "the trainer's refusals stand in $REFUSE" "no such file"
    finish
fi

# The table's rows: the lines starting with "| " between its heading and the next heading.
rows=$(awk '/^### Combinations the trainer refuses/ { on = 1; next } /^#/ { on = 0 } on && /^\| `/' "$README")
if [ -z "$rows" ]; then bad "README has the table \"Combinations the trainer refuses\"" "no rows found in $README"; finish; fi

# Each message of a fail() in refuse.h, its string pieces joined (one per line).
messages() {
    $PY - "$1" <<'PYEOF'
import re, sys
src = open(sys.argv[1]).read()
for m in re.finditer(r'\bfail\(t,\s*((?:"(?:[^"\\]|\\.)*"\s*)+)', src):
    print(''.join(re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(1))))
PYEOF
}
is_combination() { # message: names two flags or more and is not a range
    local flags
    flags=$(grep -oE -- '--[a-z][a-z0-9-]*' <<<"$1" | sort -u | wc -l)
    [ "$flags" -ge 2 ] && ! grep -qE 'must be at least|must be >=|must be in|out of range' <<<"$1"
}

n=0
while IFS= read -r msg; do
    is_combination "$msg" || continue
    n=$((n + 1))
    missing=""
    found=0
    while IFS= read -r row; do
        miss=""
        for f in $(grep -oE -- '--[a-z][a-z0-9-]*' <<<"$msg" | sort -u); do
            grep -qE -- "${f}([^a-z0-9-]|$)" <<<"$row" || miss="$miss $f"
        done
        if [ -z "$miss" ]; then found=1; break; fi
        [ -z "$missing" ] || [ ${#miss} -lt ${#missing} ] && missing=$miss
    done <<<"$rows"
    if [ "$found" -eq 1 ]; then ok "README's table has a row for: $(cut -c1-90 <<<"$msg")"
    else bad "README's table has a row for: $msg" "the nearest row lacks:$missing"; fi
done < <(messages "$REFUSE")
if [ "$n" -ge 10 ]; then ok "refuse.h holds $n refusals of combinations"
else bad "refuse.h holds the trainer's refusals of combinations" "found $n, want 10 or more"; fi

# No refusal of a combination outside refuse.h but those only files can tell (refuse.h says so).
ALLOWED=("--init-from-hf: the data's vocabulary" "--ckpt-dir %s already holds checkpoints")
allowed() { local a; for a in "${ALLOWED[@]}"; do [[ $1 == "$a"* ]] && return 0; done; return 1; }
strays=""
for f in examples/train_moe.c examples/train/*.h; do
    [ "$f" = "$REFUSE" ] && continue
    while IFS= read -r msg; do
        is_combination "$msg" && ! allowed "$msg" && strays="$strays
$f: $msg"
    done < <(messages "$f")
done
strays=${strays#$'\n'}
if [ -z "$strays" ]; then ok "no refusal of a combination outside $REFUSE"
else bad "no refusal of a combination outside $REFUSE" "$strays"; fi
finish
