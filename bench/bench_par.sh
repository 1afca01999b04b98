#!/usr/bin/env bash
# Tensor and pipeline parallelism figures of examples/train_moe.c: step time and communication
# share of each layout of 8 ranks on this machine (CPU, host backend), against the
# data-parallel layout (dp8, the peer) measured in the same run, with the bubble fraction of
# each pipeline schedule (the formula dsk_par_bubble_fraction gives, printed by the trainer).
# comm share = seconds inside dsk_comm calls / step time on rank 0 (with a pipeline, a
# blocking receive waits for the previous stage: the bubble shows up there).
# Usage: bash bench/bench_par.sh [STEPS]   (default 12; the first 2 are warm-up).
# BENCH_ARGS="..." replaces the model flags. Not part of `make test`.
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
       --expert-hidden 128 --shared 1 --batch 64})
COMMON=(--steps "$STEPS" --sample-len 0 --val-interval 100000 --dtype f32 --device cpu --corpus-mb 1 --peak-tflops 0.1)
echo "machine: $(getconf _NPROCESSORS_ONLN) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), load average" \
     "$(cut -d' ' -f1-3 /proc/loadavg), $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "model: ${MODEL[*]}; 8 ranks, 1 thread each; $STEPS steps, median of steps 3..$STEPS"

LAYOUTS=(
    "dp8|"
    "dp8 (ep2)|--ep 2"
    "tp2 x dp4|--tp 2"
    "tp4 x dp2|--tp 4"
    "tp8|--tp 8"
    "pp2 x dp4, 1f1b, m 4|--pp 2 --micro-batches 4"
    "pp4 x dp2, gpipe, m 8|--pp 4 --micro-batches 8 --pp-schedule gpipe"
    "pp4 x dp2, 1f1b, m 8|--pp 4 --micro-batches 8"
    "pp4 x dp2, interleaved v2, m 8|--pp 4 --micro-batches 8 --pp-schedule interleaved --virtual-stages 2"
    "pp8, 1f1b, m 8|--pp 8 --micro-batches 8"
    "tp2 x pp2 x dp2, 1f1b, m 4|--tp 2 --pp 2 --micro-batches 4"
    "tp2 x pp2 x dp2 (ep2), 1f1b, m 4|--tp 2 --pp 2 --ep 2 --micro-batches 4"
)
echo
echo "| layout | step ms (median) | rank 0 CPU ms | comm share | bubble | step time / dp8 |"
echo "| --- | --- | --- | --- | --- | --- |"
base=""
i=0
for spec in "${LAYOUTS[@]}"; do
    IFS='|' read -r name flags <<<"$spec"
    i=$((i + 1))
    # shellcheck disable=SC2086
    timeout 900 "$BIN" "${MODEL[@]}" "${COMMON[@]}" --nproc 8 $flags --log "$work/$i.jsonl" >"$work/$i.out" 2>&1
    code=$?
    if [ $code -ne 0 ]; then echo "| $name | failed (exit $code: $(grep -m1 -E 'rank .*: ' "$work/$i.out" | cut -c1-100)) | | | | |"; continue; fi
    bubble=$(grep -oE 'bubble [0-9.]+' "$work/$i.out" | head -1 | cut -d' ' -f2)
    read -r ms cpu comm < <(python3 - "$work/$i.jsonl" <<'EOF'
import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if r["type"] == "step"][2:]
print("%.1f %.1f %.3f" % (statistics.median(r["ms"] for r in rows), statistics.median(r["cpu_ms"] for r in rows),
                          statistics.mean(r["comm_share"] for r in rows)))
EOF
)
    [ -z "$base" ] && base=$ms
    ratio=$(python3 -c "print('%.2f' % ($ms / $base))")
    echo "| $name | $ms | $cpu | $(python3 -c "print('%.0f%%' % (100 * $comm))") | ${bubble:--} | $ratio |"
done
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
