#!/usr/bin/env bash
# bench/moe_before_after.sh - the MoE layer on the CPU before and after issue 13's redesign, and
# its PyTorch peer, in one run (issue 13: "the redesign must not make the CPU slower").
# Before: dsk_moe.h of commit 7a9d942 (REV=...) built against this tree's dsk_tensor.h by
# bench/moe_old/bench_moe_old.c (the way tests/golden/gen_moe_golden.c builds it); after:
# bench/bench_moe --no-peer. Both time forward + backward of the same shapes (V2-Lite-like and
# V3-like, bench_moe's), seeds, inputs and expert bias, f32, the context's threads; the two
# programs alternate for ROUNDS rounds (the order flips every round), each run giving the median
# of REPEATS steps after a warm-up, and the table holds the median over the rounds of those
# medians, wall and CPU time, with the load average before each run. Each round checks that the
# old and the new layer computed the same y (sum of its elements, printed to 17 digits). Then
# one bench_moe with its PyTorch peer (bench/moe_torch.py; python3 with torch, not in CI).
# Usage: [TOKENS=512] [REPEATS=3] [ROUNDS=3] [BUILD=build-moe] bash bench/moe_before_after.sh
set -eu
cd "$(dirname "$0")/.."
TOKENS=${TOKENS:-512}
REPEATS=${REPEATS:-3}
ROUNDS=${ROUNDS:-3}
REV=${REV:-7a9d942}
BUILD=${BUILD:-build-moe}
OLD=$BUILD/moe_old
mkdir -p "$OLD"
git show "$REV:dsk_moe.h" >"$OLD/dsk_moe.h"
make --no-print-directory -s BUILD="$BUILD" CUDA=0 "$BUILD/bench/bench_moe"
gcc -std=c11 -O2 -march=native -g -fopenmp -Wall -Wextra -Werror -I"$OLD" -I. bench/moe_old/bench_moe_old.c \
    -o "$OLD/bench_moe_old" -lm -lpthread
log=$OLD/runs.txt
: >"$log"
load() { cut -d' ' -f1 /proc/loadavg; }
run_old() { echo "load $(load)" >>"$log"; "$OLD/bench_moe_old" --tokens "$TOKENS" --repeats "$REPEATS" >>"$log"; }
run_new() { # bench_moe's lines, as "new <shape> wall_ms=.. cpu_ms=.. ysum=.."
    echo "load $(load)" >>"$log"
    "$BUILD/bench/bench_moe" --tokens "$TOKENS" --repeats "$REPEATS" --no-peer | awk '
        $2 ~ /^ysum=/ { y[$1] = $2 }
        / dsk .* ms\/step/ {
            for (i = 1; i <= NF; i++) { if ($i == "dsk") w[$1] = $(i + 1); if ($i == "time") c[$1] = $(i + 1) }
            order[++n] = $1
        }
        END {
            for (i = 1; i <= n; i++) { s = order[i]; printf "new %s wall_ms=%s cpu_ms=%s %s\n", s, w[s], c[s], y[s] }
        }' >>"$log"
}
for r in $(seq 1 "$ROUNDS"); do
    echo "round $r" >>"$log"
    if [ $((r % 2)) -eq 1 ]; then run_old; run_new; else run_new; run_old; fi
done
cat "$log"
python3 - "$log" <<'PYEOF'
import re, statistics, sys
runs, loads, ys = {}, [], {}
for line in open(sys.argv[1]):
    f = line.split()
    if f[0] == "load": loads.append(float(f[1]))
    if f[0] in ("old", "new"):
        kv = dict(x.split("=", 1) for x in f[2:] if "=" in x)
        runs.setdefault((f[0], f[1]), []).append((float(kv["wall_ms"]), float(kv["cpu_ms"])))
        ys.setdefault(f[1], set()).add(kv["ysum"])
print("%-7s %12s %12s %12s %12s %9s %9s" % ("shape", "old wall ms", "new wall ms", "old CPU ms", "new CPU ms",
                                            "wall o/n", "CPU o/n"))
for shape in ("v2lite", "v3"):
    o, n = runs.get(("old", shape), []), runs.get(("new", shape), [])
    if not o or not n: continue
    ow, nw = statistics.median(w for w, _ in o), statistics.median(w for w, _ in n)
    oc, nc = statistics.median(c for _, c in o), statistics.median(c for _, c in n)
    print("%-7s %12.1f %12.1f %12.1f %12.1f %8.2fx %8.2fx" % (shape, ow, nw, oc, nc, ow / nw, oc / nc))
for shape, s in ys.items():
    same = "identical (sum %s)" % next(iter(s)) if len(s) == 1 else "DIFFER: %s" % sorted(s)
    print("%s: old and new y %s" % (shape, same))
print("load average (1 min) before the runs: min %.2f, median %.2f, max %.2f"
      % (min(loads), statistics.median(loads), max(loads)))
PYEOF
echo "load $(load) before the PyTorch run"
"$BUILD/bench/bench_moe" --tokens "$TOKENS" --repeats "$REPEATS"
