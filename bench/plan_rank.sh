#!/usr/bin/env bash
# The planner's step-time model against measured steps on this machine's CPU ranks (issue 30).
#   1. Calibration: 4 data-parallel ranks train the model below; the machine's cores (online CPUs) become
#      the cluster's cores_per_node, and the median step's FLOP rate per core (the trainer's FLOPs
#      per token, dsk_plan's count, over min(4, cores) cores: 4 ranks on fewer cores share them, which
#      the time model knows; the model's own gradient reduction and optimizer step for that run taken
#      out first) its bf16_tflops at efficiency 1, written with the assumed links and memory_gbps to
#      CALIBRATED [bench/plan_cpu_calibrated.json] (the command and figures go to bench/RESULTS.md by hand).
#   2. Ranking: 8 layouts at 4 ranks, each trained for STEPS steps in ROUNDS alternating rounds in
#      the same run, the median of the rounds' median steps against the plan's predicted step
#      (dsk_plan --check-rank) with the calibrated cluster and with it as one device per rank;
#      prints the orders and Kendall's tau of both (want >= 0.6).
# About 2 minutes on an idle 2-core machine, and a loaded one moves the order on shared memory;
# tests/test_plan_rank.sh runs it in `make test` on the emulated link (LINK_GBPS below), one round.
# FIELD=cpu_ms measures rank 0's CPU time per step instead of its wall time (the JSON log's cpu_ms):
# other processes' load then stops counting, but so does any wait that sleeps (a pipeline bubble, a
# blocked collective), which the plan's step time includes; neither is right on a shared machine.
# CAL_FIELD=cpu_ms [FIELD]: the calibration alone from the ranks' CPU time (4 x rank 0's a step, the cores' time
# they used), which a load of other programs does not stretch as it does the wall time; tests/test_plan_rank.sh
# calibrates so on a machine that also builds and tests.
# LINK_GBPS=G [LINK_US=U]: the ranking's runs on dsk_comm's emulated link (DSK_LINK_GBPS, DSK_LINK_LATENCY_US [100]),
# predicted with the calibrated cluster's intra-node link set to it and "link_wait": 1 (its time a wait, no core's);
# the calibration runs without it.
# PLAN_LAYOUTS='FLAGS|FLAGS|...': ranks those layouts (4 ranks each) instead of the 8 (e.g. the pipeline schedules
# of one layout, bench/RESULTS.md).
# Usage: [FIELD=ms|cpu_ms] [CAL_FIELD=ms|cpu_ms] [STEPS=12] [ROUNDS=3] [LINK_GBPS=G [LINK_US=U]]
#        [CALIBRATED=FILE] [PLAN_LAYOUTS=...] bash bench/plan_rank.sh [BUILD]
set -u
cd "$(dirname "$0")/.."
BUILD=${1:-build}
BIN=$BUILD/examples/train_moe
PLAN=$BUILD/examples/dsk_plan
STEPS=${STEPS:-12}
ROUNDS=${ROUNDS:-3}
FIELD=${FIELD:-ms}
CALIBRATED=${CALIBRATED:-bench/plan_cpu_calibrated.json}
CAL_FIELD=${CAL_FIELD:-$FIELD}
for f in "$FIELD" "$CAL_FIELD"; do
    case $f in ms | cpu_ms) ;; *) echo "FIELD=$FIELD, CAL_FIELD=$CAL_FIELD: ms or cpu_ms" >&2; exit 2 ;; esac
done
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
unset DSK_LINK_GBPS DSK_LINK_LATENCY_US
make --no-print-directory -s BUILD="$BUILD" "$BIN" "$PLAN" || exit 1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
MODEL=(--seq 64 --d-model 64 --heads 4 --layers 4 --dense-layers 1 --ffn-hidden 128 --experts 8 --top-k 2
       --expert-hidden 64 --shared 1 --batch 16 --data tests/data/corpus.txt --corpus-mb 0.5 --val-every 10
       --val-interval 1000 --val-batches 1 --sample-len 0 --peak-tflops 0.1)
median_ms() { # the median of field $2 (default FIELD) of a run's steps after the first 2
    python3 -c 'import json,sys
v=sorted(json.loads(l)[sys.argv[2]] for l in open(sys.argv[1]) if "\"type\":\"step\"" in l)
v=v[2:] if len(v)>4 else v
print(v[len(v)//2] if v else "nan")' "$1" "${2:-$FIELD}"
}
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
# 1. calibration
"$BIN" "${MODEL[@]}" --nproc 4 --steps "$STEPS" --log "$work/cal.jsonl" >"$work/cal.out" 2>&1 ||
    { tail -3 "$work/cal.out"; exit 1; }
ms=$(median_ms "$work/cal.jsonl" "$CAL_FIELD")
fpt=$("$PLAN" --device cpu --cluster examples/clusters/cpu_8.json --sequences 16 "${MODEL[@]}" --top 1 2>/dev/null |
    sed -nE 's/.*, ([0-9.e+]+) training FLOPs per token.*/\1/p')
cores=$(getconf _NPROCESSORS_ONLN) # the machine's, as dsk_comm counts them (nproc follows OMP_NUM_THREADS)
# a rank's busy time besides compute in that run, as the model prices it: the reduction and the optimizer step
other=$("$PLAN" --device cpu --cluster examples/clusters/cpu_8.json --check-rank 0 --nproc 4 "${MODEL[@]}" |
    sed -nE 's/^plan time: .*, gradients ([0-9.]+) \(exposed [0-9.]+\), optimizer ([0-9.]+),.*/\1 + \2/p')
# the cores the 4 ranks' step kept busy: the shared cores over its wall time, or the 4 ranks over their CPU time
busy=$([ "$CAL_FIELD" = cpu_ms ] && echo 4 || echo "min(4,$cores)")
tflops=$(python3 -c "print(f'{16*64*$fpt/($busy*$ms*1e-3 - 4*(${other:-0}))/1e12:.6g}')")
sed -E "s/\"bf16_tflops\": [0-9.e+-]+/\"bf16_tflops\": $tflops/; s/\"fp8_tflops\": [0-9.e+-]+/\"fp8_tflops\": $tflops/;
        s/\"cores_per_node\": [0-9]+/\"cores_per_node\": $cores/" examples/clusters/cpu_8.json >"$CALIBRATED"
echo "calibration: 4 ranks (dp) on $cores cores, median step $ms ms ($CAL_FIELD), $fpt FLOPs/token x 1024 tokens:" \
    "$tflops TFLOP/s per core" \
    "-> $CALIBRATED"
# 2. ranking at 4 ranks: ROUNDS rounds, each running every layout in turn (a change of the machine's
#    load then falls on every layout alike), the median of a layout's rounds against its predicted
#    step with the calibrated cluster and with the same one as one device per rank (cores_per_node
#    0, the rate per rank the calibration run measured)
LAYOUTS=("--zero 0" "--zero 1" "--zero 3" "--ep 2 --zero 1" "--tp 2" "--tp 4" "--pp 2 --micro-batches 4"
         "--tp 2 --pp 2 --micro-batches 2")
if [ -n "${PLAN_LAYOUTS:-}" ]; then IFS='|' read -r -a LAYOUTS <<<"$PLAN_LAYOUTS"; fi
cp "$CALIBRATED" "$work/shared.json"
if [ -n "${LINK_GBPS:-}" ]; then
    export DSK_LINK_GBPS=$LINK_GBPS DSK_LINK_LATENCY_US=${LINK_US:-100}
    python3 - "$work/shared.json" "$DSK_LINK_GBPS" "$DSK_LINK_LATENCY_US" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
c.update(intra_node_gbps=float(sys.argv[2]), intra_node_latency_us=float(sys.argv[3]), link_wait=1)
json.dump(c, open(sys.argv[1], "w"), indent=4)
EOF
    echo "ranking on an emulated link of $DSK_LINK_GBPS GB/s and $DSK_LINK_LATENCY_US us a call (link_wait 1)"
fi
sed -E "s/\"cores_per_node\": [0-9]+/\"cores_per_node\": 0/;
        s/_tflops\": [0-9.e+-]+/_tflops\": $(python3 -c "print(f'{$tflops*min(4,$cores)/4:.6g}')")/" \
    "$work/shared.json" >"$work/device.json"
for ((r = 0; r < ROUNDS; r++)); do
    for i in "${!LAYOUTS[@]}"; do
        # shellcheck disable=SC2086
        "$BIN" "${MODEL[@]}" --nproc 4 --steps "$STEPS" ${LAYOUTS[$i]} --log "$work/run.jsonl" >"$work/run.out" 2>&1 ||
            { echo "run failed: ${LAYOUTS[$i]}"; tail -3 "$work/run.out"; exit 1; }
        median_ms "$work/run.jsonl" >>"$work/$i.ms"
    done
done
predict() { # cluster, layout flags: the predicted step in ms
    # shellcheck disable=SC2086
    "$PLAN" --device cpu --cluster "$1" --check-rank 0 --nproc 4 "${MODEL[@]}" $2 |
        sed -nE 's/^plan time: step ([0-9.]+) s.*/\1/p'
}
printf '%-36s %14s %14s %14s\n' layout "measured $FIELD" "shared cores" "device/rank"
: >"$work/pairs"
for i in "${!LAYOUTS[@]}"; do
    m=$(sort -g "$work/$i.ms" | sed -n "$(((ROUNDS + 1) / 2))p")
    p=$(predict "$work/shared.json" "${LAYOUTS[$i]}")
    q=$(predict "$work/device.json" "${LAYOUTS[$i]}")
    printf '%-36s %14s %14.3f %14.3f   rounds: %s\n' "${LAYOUTS[$i]}" "$m" "$(python3 -c "print($p*1e3)")" \
        "$(python3 -c "print($q*1e3)")" "$(tr '\n' ' ' <"$work/$i.ms")"
    echo "$m $p $q" >>"$work/pairs"
done
python3 - "$work/pairs" <<'EOF'
import sys
xs = [tuple(map(float, l.split())) for l in open(sys.argv[1]) if l.strip()]
for k, name in ((1, "shared cores (cores_per_node)"), (2, "one device per rank")):
    c = d = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            s = (xs[i][0] - xs[j][0]) * (xs[i][k] - xs[j][k])
            c += s > 0
            d += s < 0
    n = len(xs) * (len(xs) - 1) / 2
    print(f"Kendall tau over {len(xs)} layouts, {name}: {(c - d) / n:.3f} ({c} concordant, {d} discordant pairs)")
EOF
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
