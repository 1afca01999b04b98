#!/usr/bin/env bash
# The layout matrix of issue 25 through the one engine: step time, communication share (time the
# training thread is blocked on communication / step time, rank 0) and memory per rank by role
# (parameters, gradients, optimizer state, compression buffers: the allocator's bytes, printed
# by every rank at start; the largest rank), for each layout on this machine's CPU ranks (host
# backend), and the same layout by the binary BEFORE (env var, e.g. a build of the commit before
# the engine) where it ran then ("refused" where it did not). The ZeRO-1 rows also give the
# optimizer state of the largest rank against the stage's whole state (a --zero 0 run with every
# expert on every rank) divided by dp: the bound, plus unit padding. With expert parallelism a rank
# holds 1/ep of the experts and shards their state over the edp = dp/ep ranks holding the same.
# Usage: BEFORE=/path/to/old/train_moe bash bench/bench_layouts.sh [STEPS]   (default 12; the
# first 2 are warm-up). Not part of `make test`.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
BIN=$BUILD/examples/train_moe
STEPS=${1:-12}
make --no-print-directory -s BUILD="$BUILD" "$BIN" || exit 1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
MODEL=(${BENCH_ARGS:---seq 64 --d-model 128 --heads 8 --layers 8 --dense-layers 1 --ffn-hidden 384 --experts 8 --top-k 2
       --expert-hidden 128 --shared 1 --batch 32})
COMMON=(--steps "$STEPS" --sample-len 0 --val-interval 100000 --device cpu --data tests/data/corpus.txt --corpus-mb 0.5
        --peak-tflops 0.1)
echo "machine: $(getconf _NPROCESSORS_ONLN) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))," \
     "flags: $(grep -m1 -o -w -E 'avx512f|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')load average" \
     "$(cut -d' ' -f1-3 /proc/loadavg), $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "model: ${MODEL[*]}; 1 thread per rank; $STEPS steps, median of steps 3..$STEPS"
LAYOUTS=(
    "tp2 x pp2 x dp2, ZeRO-1, bf16|8|--tp 2 --pp 2 --micro-batches 4 --zero 1 --dtype bf16"
    "tp2 x pp2 x dp2, ZeRO-0, bf16|8|--tp 2 --pp 2 --micro-batches 4 --dtype bf16"
    "tp2 x pp2 x dp2, f32|8|--tp 2 --pp 2 --micro-batches 4 --dtype f32"
    "pp2 x ep2 x dp4, ZeRO-1, bf16|8|--pp 2 --ep 2 --micro-batches 4 --zero 1 --dtype bf16"
    "pp2 x ep2 x dp4, ZeRO-0, bf16|8|--pp 2 --ep 2 --micro-batches 4 --dtype bf16"
    "pp2 x dp4, ZeRO-0, bf16|8|--pp 2 --micro-batches 4 --dtype bf16"
    "tp2 x ep2 x dp2, ZeRO-2, fp16|4|--tp 2 --ep 2 --zero 2 --dtype fp16"
    "pp2 interleaved x dp2, ZeRO-3, f32|4|--pp 2 --pp-schedule interleaved --virtual-stages 2 --micro-batches 4 --zero 3 --dtype f32"
    "pp2 interleaved x dp2, f32|4|--pp 2 --pp-schedule interleaved --virtual-stages 2 --micro-batches 4 --dtype f32"
    "dp2 x ep2, ZeRO-3, PowerSGD|4|--ep 2 --zero 3 --grad-compress powersgd:2:0 --dtype f32"
    "dp4 x ep2, f32|4|--ep 2 --dtype f32"
)
run_layout() { # BIN NAME N FLAGS -> "ms comm p g o c" or "refused"
    local bin=$1 tag=$2 n=$3; shift 3
    # shellcheck disable=SC2068
    timeout 900 "$bin" "${MODEL[@]}" "${COMMON[@]}" --nproc "$n" $@ --log "$work/$tag.jsonl" >"$work/$tag.out" 2>&1 ||
        { echo "refused"; return; }
    python3 - "$work/$tag.jsonl" "$work/$tag.out" <<'PY'
import json, re, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if r["type"] == "step"][2:]
mem = [tuple(map(int, m)) for m in re.findall(r"memory bytes, rank \d+: parameters (\d+), gradients (\d+), "
                                              r"optimizer state (\d+), compression buffers (\d+)", open(sys.argv[2]).read())]
big = [max(m[i] for m in mem) for i in range(4)] if mem else [0, 0, 0, 0]
print("%.1f %.3f %d %d %d %d" % (statistics.median(r["ms"] for r in rows), statistics.mean(r["comm_share"] for r in rows), *big))
PY
}
echo
echo "| layout | ranks | step ms | comm share | params MiB | grads MiB | optimizer MiB | compression MiB | before: step ms, comm share |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
declare -A OPT
i=0
for spec in "${LAYOUTS[@]}"; do
    IFS='|' read -r name n flags <<<"$spec"
    i=$((i + 1))
    # shellcheck disable=SC2086
    read -r ms comm p g o c < <(run_layout "$BIN" "new$i" "$n" $flags)
    OPT[$name]=$o
    before="not measured (no BEFORE)"
    if [ -n "${BEFORE:-}" ]; then
        # shellcheck disable=SC2086
        read -r bms bcomm _ < <(run_layout "$BEFORE" "old$i" "$n" $flags)
        if [ "$bms" = refused ]; then before="refused"; else before="$bms ms, $bcomm"; fi
    fi
    if [ "$ms" = refused ]; then echo "| $name | $n | failed: $(grep -m1 'rank .*: ' "$work/new$i.out" | cut -c1-90) | | | | | | $before |"; continue; fi
    mib() { python3 -c "print('%.3f' % ($1 / 1048576))"; }
    echo "| $name | $n | $ms | $comm | $(mib "$p") | $(mib "$g") | $(mib "$o") | $(mib "$c") | $before |"
done
echo
echo "optimizer state of the largest rank at ZeRO-1 against the stage's whole state at ZeRO-0 without expert"
echo "parallelism (every expert on every rank) divided by dp (the bound, plus unit padding):"
for pair in "tp2 x pp2 x dp2, ZeRO-1, bf16|tp2 x pp2 x dp2, ZeRO-0, bf16|2" "pp2 x ep2 x dp4, ZeRO-1, bf16|pp2 x dp4, ZeRO-0, bf16|4"; do
    IFS='|' read -r z1 z0 dp <<<"$pair"
    echo "  $z1: ${OPT[$z1]:-?} B; $z0 ${OPT[$z0]:-?} B / $dp = $(( ${OPT[$z0]:-0} / dp )) B"
done
