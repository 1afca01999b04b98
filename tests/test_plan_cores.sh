#!/usr/bin/env bash
# The planner's time model for CPU ranks that share cores (dsk_plan.h: cluster.cores_per_node,
# dsk__plan_shared_cores; issue 30). `dsk_plan --check-rank 0 --cluster FILE` prints the predicted
# step and its parts for layouts of a small model at 4 ranks; this checks them against the
# derivation, computed here from the printed parts:
#   1. Without the field, with 0, or with at least as many cores as the node's ranks, the step is
#      the one-device-per-rank step (compute + bubble + exposed comm), shared cores 0.
#   2. 4 ranks on 2 cores, data parallel (no bubble): work-bound, the step is
#      4 (compute + every collective's time, hidden under backward or not) / 2.
#   3. 4 ranks on 3 cores: pp2 1F1B with 8 micro-batches (bubble 1/9) is work-bound as well;
#      with 2 micro-batches (bubble 1/3) the critical path is the longer: the step is the
#      one-device-per-rank step, shared cores 0.
#   4. Bad input: "cores_per_node" -1, 2.5 or "two" fails naming the field.
# Runs no training (each case is one dsk_plan call): seconds. The measured ranking is
# bench/plan_rank.sh (not here: a loaded machine moves the measured order).
# Prints `[test_plan_cores] totals: P passed / F failed / S skipped`.
TEST_NAME=test_plan_cores
source "$(dirname "$0")/train_test_lib.sh"
PLAN=$BUILD/examples/dsk_plan
need_built "$PLAN"

SMALL=(--seq 64 --d-model 64 --heads 4 --layers 4 --dense-layers 1 --ffn-hidden 128 --experts 8 --top-k 2
       --expert-hidden 64 --shared 1 --batch 16 --data "$CORPUS" --corpus-mb 0.05)
# cluster NAME FIELD: examples/clusters/cpu_8.json (a fixed rate, so a recalibration moves no bound) without its
# cores_per_node, FIELD appended (may be empty)
cluster() {
    local add=${2:+  $2\\n}
    sed -E '/"cores_per_node"/d; s/"overlap": ([0-9.]+),?/"overlap": \1'"${2:+,}"'/' examples/clusters/cpu_8.json |
        sed -E "s/^\\}/$add}/" >"$work/$1.json"
}
# parts NAME FLAGS...: "step compute bubble tp ep pp gradients exposed cores" of rank 0's plan
parts() {
    local name=$1
    shift
    "$PLAN" --device cpu --cluster "$work/$name.json" --check-rank 0 --nproc 4 "${SMALL[@]}" "$@" 2>&1 |
        sed -nE 's/^plan time: step ([0-9.]+) s: compute ([0-9.]+), bubble ([0-9.]+), tp ([0-9.]+), ep ([0-9.]+), pp ([0-9.]+), gradients ([0-9.]+) \(exposed ([0-9.]+)\), shared cores ([0-9.]+)$/\1 \2 \3 \4 \5 \6 \7 \8 \9/p'
}
# expect NAME CORES LABEL FLAGS...: the step equals max(path, 4 busy / CORES) (CORES 0: path), within
# the 6 printed decimals
expect() {
    local name=$1 cores=$2 label=$3 p verdict
    shift 3
    p=$(parts "$name" "$@")
    verdict=$(
        python3 - "$cores" $p <<'EOF'
import sys
c = int(sys.argv[1])
if len(sys.argv) != 11:
    print("no plan time line"); sys.exit()
step, comp, bub, tp, ep, pp, grad, exp, cores = map(float, sys.argv[2:])
path = comp + bub + tp + ep + pp + exp
want = max(path, 4 * (comp + tp + ep + pp + grad) / c) if c and c < 4 else path
ok = abs(step - want) <= 2e-6 and abs(cores - (want - path)) <= 2e-6
print("ok" if ok else f"step {step} (shared cores {cores}), want {want:.6f} (path {path:.6f})")
EOF
    )
    if [ "$verdict" = ok ]; then ok "$label (step $(echo "$p" | cut -d' ' -f1) s)"; else bad "$label" "$verdict"; fi
}

cluster none ""
cluster zero '"cores_per_node": 0'
cluster four '"cores_per_node": 4'
cluster two '"cores_per_node": 2'
cluster three '"cores_per_node": 3'
for c in none zero four; do
    expect "$c" 0 "cores_per_node $c: dp4 is the one-device-per-rank step" --zero 1
    expect "$c" 0 "cores_per_node $c: pp2 1F1B m4 is the one-device-per-rank step (bubble charged)" --pp 2 \
        --micro-batches 4
done
for l in "--zero 0" "--zero 3" "--tp 4" "--ep 2 --zero 1"; do
    # shellcheck disable=SC2086
    expect two 2 "4 ranks on 2 cores, $l: work-bound, 4 (compute + all comm) / 2" $l
done
expect three 3 "4 ranks on 3 cores, pp2 1F1B m8: work-bound (bubble 1/9 given away)" --pp 2 --micro-batches 8
expect three 3 "4 ranks on 3 cores, pp2 1F1B m2: path-bound (bubble 1/3), the one-device-per-rank step" --pp 2 \
    --micro-batches 2
p3=$(parts three --pp 2 --micro-batches 8 | cut -d' ' -f9)
p2=$(parts three --pp 2 --micro-batches 2 | cut -d' ' -f9)
if python3 -c "import sys; sys.exit(not (float('$p3') > 0 and float('$p2') == 0))" 2>/dev/null; then
    ok "both bounds are reached: shared cores $p3 s at m8, 0 at m2"
else
    bad "both bounds reached" "shared cores at m8 '$p3' (want > 0), at m2 '$p2' (want 0)"
fi

for v in -1 2.5 '"two"'; do
    cluster "bad" "\"cores_per_node\": $v"
    out=$("$PLAN" --device cpu --cluster "$work/bad.json" --check-rank 0 --nproc 4 "${SMALL[@]}" 2>&1)
    if [ $? -ne 0 ] && echo "$out" | grep -q '"cores_per_node"'; then
        ok "bad input: \"cores_per_node\": $v fails naming the field ($(echo "$out" | grep -m1 cores_per_node | cut -c1-90))"
    else
        bad "bad input: \"cores_per_node\": $v" "want a failure naming the field: $(echo "$out" | head -2)"
    fi
done
finish
