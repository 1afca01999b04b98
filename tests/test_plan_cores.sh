#!/usr/bin/env bash
# The planner's time model for CPU ranks that share cores (dsk_plan.h: cluster.cores_per_node,
# dsk__plan_shared_cores; issue 30) and its optimizer step (cluster.memory_gbps). `dsk_plan
# --check-rank 0 --cluster FILE` prints the predicted step and its parts for layouts of a small model
# at 4 ranks; this checks them against the derivation, computed here from the printed parts:
#   1. Without the field, with 0, or with at least as many cores as the node's ranks, the step is
#      the one-device-per-rank step (compute + bubble + exposed comm + optimizer), shared cores 0.
#   2. 4 ranks on 2 cores, data parallel (no bubble): work-bound, the step is
#      4 (compute + every collective's time, hidden under backward or not, + optimizer) / 2.
#   3. 4 ranks on 3 cores: pp2 1F1B with 8 micro-batches (a bubble of at most 1/8 of the compute) is work-bound as well;
#      with 2 micro-batches (at most 1/2) the critical path is the longer: the step is the
#      one-device-per-rank step, shared cores 0.
#   4. Bad input: "cores_per_node" -1, 2.5 or "two", "link_wait" 2 or -1 fail naming the field.
#   4b. "link_wait": 1 (a link whose time is a wait, a network card or dsk_comm's emulated link): the busy work is
#      compute and the optimizer alone, 4 (compute + optimizer) / 2, never below the one-device-per-rank step.
#   5. The optimizer step's bytes per element it updates: f32 weights 32 (the gradient read twice,
#      both moments and the weight read and written: 4x the optimizer state, 8/3 of it at ZeRO-3, whose
#      state counts the weights' shard), bf16 weights 34 (an f32 master read and written, the weight
#      written) and 26 with bf16 moments; a bf16 model keeps some objects in f32, so their elements and
#      the bf16 ones are solved from the optimizer state with f32 and with bf16 moments (ZeRO 1-2).
#      The optimizer's time is those bytes at memory_gbps; without the field it is 0.
#   6. The bubble: the schedule's lists timed with each stage's forward and backward (dsk_plan_stage_times: the
#      stage's compute over its micro-batch chunks, a third of it forward) less the pace stage's busy time, which
#      those times give; under 1F1B and GPipe between the bounds a pipeline of unequal stages has (the stages
#      before the pace one's fill and drain, and the formula's (p - 1) / m at the pace stage's times), with
#      fewer micro-batches than stages too.
#   7. A pipeline's compute is its busiest stage's: the stages' FLOPs per token (the last adds the LM
#      head, 6 D V, and the MTP modules) sum to the model's, the busiest sets the compute (pp4's is
#      4 x busiest / model times dp4's: the same FLOPs over 4 ranks either way), and the trainer's split
#      (train_par.h's tp_split_layers) is the contiguous one whose busiest stage is lightest: 3 layers
#      on 2 stages go 2 + 1 (dense and MoE, then MoE and the head), where L / P would give 1 + 2.
#   8. The stage that keeps a pipeline's pace (dsk_plan_stages) is the one of the most compute and expert
#      exchanges: the busiest by FLOPs on a fast link, the one with the MoE layers on a slow one.
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
# parts NAME FLAGS...: "step compute bubble tp ep pp gradients exposed optimizer cores mean" of rank 0's plan,
# mean: the stages' mean compute (compute is the busiest stage's: x the model's FLOPs / (pp x the busiest's))
parts() {
    local name=$1
    shift
    "$PLAN" --device cpu --cluster "$work/$name.json" --check-rank 0 --nproc 4 "${SMALL[@]}" "$@" 2>&1 |
        "$PY" -c 'import re, sys
r = r"^plan time: step (\S+) s: compute (\S+), bubble (\S+), tp (\S+), ep (\S+), pp (\S+), gradients (\S+) " \
    r"\(exposed (\S+)\), optimizer (\S+), shared cores (\S+), ep hidden (\S+)$"
stages = []
for line in sys.stdin:
    line = line.rstrip("\n")
    if line.startswith("plan flops per token: model "):
        model = float(line.split()[5].rstrip(","))
        stages = [float(x) for x in re.findall(r", stage [0-9]+ ([0-9.e+-]+)", line)]
    m = re.match(r, line)
    if m and stages:
        print(" ".join(m.groups()), float(m.group(2)) * model / (len(stages) * max(stages)))'
}
# bytes NAME FLAGS...: "optimizer-state optimizer-step" bytes of rank 0's plan
bytes() {
    local name=$1
    shift
    "$PLAN" --device cpu --cluster "$work/$name.json" --check-rank 0 --nproc 4 "${SMALL[@]}" "$@" 2>&1 |
        sed -nE 's/^plan bytes, rank 0: .*optimizer state ([0-9]+),.*optimizer step ([0-9]+)$/\1 \2/p'
}
# expect NAME CORES LABEL FLAGS...: the step equals max(path, 4 busy / CORES) (CORES 0: path), within
# the 6 printed decimals of up to 7 parts (4 / CORES times their 5e-7 each, and the step's own); busy is
# compute, communication and optimizer, or with WAIT=1 (the cluster's link_wait) compute and optimizer
expect() {
    local name=$1 cores=$2 label=$3 p verdict
    shift 3
    p=$(parts "$name" "$@")
    verdict=$(
        "$PY" - "$cores" "${WAIT:-0}" $p <<'EOF'
import sys
c, wait = int(sys.argv[1]), int(sys.argv[2])
if len(sys.argv) != 15:
    print("no plan time line"); sys.exit()
step, comp, bub, tp, ep, pp, grad, exp, opt, cores, hid, mean = map(float, sys.argv[3:])
path = comp + bub + tp + ep - hid + pp + exp + opt
comm = 0 if wait else tp + ep + pp + grad
want = max(path, 4 * (mean + comm + opt) / c) if c and c < 4 else path
ok = abs(step - want) <= 8e-6 and abs(cores - (want - path)) <= 8e-6
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
# a link whose time is a wait: a slow one makes the step path-bound, a fast one leaves it work-bound
cluster wait_slow '"cores_per_node": 2, "link_wait": 1' && sed -i -E 's/"intra_node_gbps": [0-9.]+/"intra_node_gbps": 0.05/' \
    "$work/wait_slow.json"
cluster wait_fast '"cores_per_node": 2, "link_wait": 1'
for l in "--zero 0" "--tp 4" "--ep 2 --zero 1" "--pp 2 --micro-batches 4"; do
    # shellcheck disable=SC2086
    WAIT=1 expect wait_slow 2 "4 ranks on 2 cores, link_wait 1 at 0.05 GB/s, $l: the links' time is no core's" $l
    # shellcheck disable=SC2086
    WAIT=1 expect wait_fast 2 "4 ranks on 2 cores, link_wait 1 at the file's link, $l: the links' time is no core's" $l
done
s0=$(parts wait_slow --tp 4 | cut -d' ' -f10)
s1=$(parts wait_fast --tp 4 | cut -d' ' -f10)
if "$PY" -c "import sys; sys.exit(not (float('$s0') == 0 and float('$s1') > 0))" 2>/dev/null; then
    ok "link_wait 1, tp4: path-bound on the slow link (shared cores 0), work-bound on the fast one ($s1 s)"
else
    bad "link_wait 1, tp4: both bounds" "shared cores on the slow link '$s0' (want 0), the fast '$s1' (want > 0)"
fi
expect three 3 "4 ranks on 3 cores, pp2 1F1B m8: work-bound (a bubble of at most 1/8 given away)" --pp 2 --micro-batches 8
expect three 3 "4 ranks on 3 cores, pp2 1F1B m2: path-bound (a bubble of at most 1/2), the one-device-per-rank step" --pp 2 \
    --micro-batches 2
p3=$(parts three --pp 2 --micro-batches 8 | cut -d' ' -f10)
p2=$(parts three --pp 2 --micro-batches 2 | cut -d' ' -f10)
if "$PY" -c "import sys; sys.exit(not (float('$p3') > 0 and float('$p2') == 0))" 2>/dev/null; then
    ok "both bounds are reached: shared cores $p3 s at m8, 0 at m2"
else
    bad "both bounds reached" "shared cores at m8 '$p3' (want > 0), at m2 '$p2' (want 0)"
fi

# 6. the bubble: the schedule's lists timed with each stage's own times (dsk_par_schedule_time; tests/test_par.c
# checks that timing), less the pace stage's busy time
# (with tensor parallelism each stage's collectives are in its passes, half of them forward, like its compute)
for l in "2 4 1f1b 1 1" "4 4 1f1b 1 1" "4 1 1f1b 1 1" "4 2 gpipe 1 1" "2 4 interleaved 2 1" "2 2 1f1b 1 2"; do
    read -r pp m sched v tp <<<"$l"
    "$PLAN" --device cpu --cluster "$work/none.json" --check-rank 0 --nproc 4 "${SMALL[@]}" --pp "$pp" \
        --micro-batches "$m" --pp-schedule "$sched" --virtual-stages "$v" --tp "$tp" >"$work/pipe.out" 2>&1
    if why=$("$PY" - "$work/pipe.out" "$pp" "$m" "$sched" "$v" <<'PYX'
import re, sys
out, p, m, sched, v = open(sys.argv[1]).read(), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
t = re.search(r"^plan time: step \S+ s: compute (\S+), bubble (\S+), tp (\S+), ep (\S+),", out, re.M)
q = re.search(r"^plan pipeline: (\S+) s; forward, backward of a micro-batch chunk by stage: (.*)$", out, re.M)
if not t or not q:
    sys.exit("no plan time or pipeline line: " + out[-300:])
comp, bub, tp, ep = (float(x) for x in t.groups())
pipe, x = float(q.group(1)), [float(y) for y in q.group(2).split()]
f, b = x[0::2], x[1::2]
rank = [v * m * (f[s] + b[s]) for s in range(p)]  # a rank's chunks alike: its busy time
pace = max(range(p), key=lambda s: rank[s])
bad = []
if len(f) != p * v:
    bad.append("%d stages' times for %d stages" % (len(f), p * v))
if abs(rank[pace] - (comp + ep + tp)) > 2e-6:
    bad.append("the pace stage's busy %.6f != compute + ep + tp %.6f" % (rank[pace], comp + ep + tp))
tc = tp / (v * m)  # a chunk's collectives, every stage's the busiest's (tp printed to 6 decimals: 5e-7)
if any(abs(f[s] - ((f[s] + b[s] - tc) / 3 + tc / 2)) > 1e-6 for s in range(p * v)):
    bad.append("forwards %s, want a third of the compute and half the collectives (no recomputation, no exchanges)"
               % f)
if abs(bub - (pipe - comp - ep - tp)) > 3e-6:
    bad.append("bubble %.6f != pipeline %.6f - compute %.6f - ep %.6f - tp %.6f" % (bub, pipe, comp, ep, tp))
# The pace stage's first forward waits for the stages before it to run it, and after its last backward they run
# that one: pipe >= their forward and backward + the pace stage's busy time. Under 1F1B and GPipe every stage at
# the pace stage's times gives the formula, and a faster stage makes no wait longer: pipe <= (1 + (p - 1) / m) x
# the pace stage's busy time.
lo = sum(f[s] + b[s] for s in range(pace)) + rank[pace] if v == 1 else rank[pace]
hi = (1 + (p - 1) / m) * rank[pace] if sched != "interleaved" else float("inf")
if not lo - 2e-6 <= pipe <= hi + 2e-6:
    bad.append("pipeline %.6f outside [%.6f, %.6f]" % (pipe, lo, hi))
print("; ".join(bad) if bad else "pipeline %.6f in [%.6f, %.6f], bubble %.6f = it - compute - ep - tp %.6f" %
      (pipe, lo, hi, bub, tp))
sys.exit(1 if bad else 0)
PYX
    ); then
        ok "bubble: pp$pp m$m $sched v$v tp$tp: $why"
    else
        bad "bubble: pp$pp m$m $sched v$v tp$tp" "$why"
    fi
done

# 7. the stages' FLOPs
flops_line() { # FLAGS...: "model stage0 stage1 ..." of the plan's FLOPs per token
    "$PLAN" --device cpu --cluster "$work/none.json" --check-rank 0 --nproc 4 "${SMALL[@]}" "$@" 2>&1 |
        sed -nE 's/^plan flops per token: model ([0-9.e+]+)(.*)$/\1\2/p' | sed -E 's/, stage [0-9]+ / /g'
}
read -r model s0 s1 s2 s3 <<<"$(flops_line --pp 4 --micro-batches 4)"
head=$((6 * 64 * 256)) # 6 D V: SMALL's d_model, the byte vocabulary
if [ -n "${s3:-}" ] && "$PY" -c "import sys
m, a, b, c, d = map(float, '$model $s0 $s1 $s2 $s3'.split())
sys.exit(not (b == c and d - c == $head and abs(a + b + c + d - m) <= 1e-9 * m and a < b))"; then
    ok "stage FLOPs, pp4: dense layer $s0, MoE layers $s1 $s2, MoE layer + head $s3 (+ 6 D V = $head); sum = model $model"
else
    bad "stage FLOPs, pp4" "got '$model $s0 ${s1:-} ${s2:-} ${s3:-}' (want stage 1 = stage 2, stage 3 - stage 2 = $head, sum = model)"
fi
# 3 layers on 2 stages: every contiguous split of the layers (dense, MoE, MoE; the head last), from pp4's figures
read -r model3 a b <<<"$(flops_line --pp 2 --micro-batches 4 --layers 3)"
if [ -n "${b:-}" ] && "$PY" -c "import sys
d, m, h = $s0, $s1, $s3 - $s1
best = min(max(d, 2 * m + h), max(d + m, m + h))
sys.exit(not ($a == d + m and $b == m + h and max($a, $b) == best and abs($a + $b - $model3) <= 1e-9 * $model3))"; then
    ok "split, 3 layers on 2 stages: $a (dense + MoE) and $b (MoE + head), the lightest busiest stage of the 2 splits"
else
    bad "split, 3 layers on 2 stages" "stages '${a:-}' '${b:-}' of '${model3:-}' (want dense + MoE, MoE + head from $s0 $s1 $s3)"
fi
for l in "--pp 2 --micro-batches 4 --mtp 1" "--pp 2 --micro-batches 4 --pp-schedule interleaved --virtual-stages 2"; do
    # shellcheck disable=SC2086
    read -r -a f <<<"$(flops_line $l)"
    if [ ${#f[@]} -eq 3 ] && "$PY" -c "import sys; sys.exit(abs(${f[1]} + ${f[2]} - ${f[0]}) > 1e-9 * ${f[0]})"; then
        ok "stage FLOPs, $l: ${f[1]} + ${f[2]} = model ${f[0]}"
    else
        bad "stage FLOPs, $l" "got '${f[*]}' (want 2 stages summing to the model)"
    fi
done
read -r _ cdp _ <<<"$(parts none --zero 1)"
read -r _ cpp _ <<<"$(parts none --pp 4 --micro-batches 4)"
if [ -n "${cpp:-}" ] && "$PY" -c "import sys
want = $cdp * 4 * max($s0, $s1, $s2, $s3) / $model
sys.exit(abs($cpp - want) > 4e-6)"; then
    ok "pp4's compute $cpp s = dp4's $cdp x 4 x busiest stage / model"
else
    bad "pp4's compute: the busiest stage's" "pp4 '${cpp:-}' s, dp4 '${cdp:-}' s, stages $s0 $s1 $s2 $s3 of $model"
fi
# 8. the stage that keeps the pace: 2 dense layers of a wide FFN, then 2 MoE layers, on pp2 x ep2 (stage 0: the
# dense ones, the most FLOPs, no MoE layer; stage 1: both MoE layers and the head). On the usual link stage 0's
# compute sets the pace and it makes no expert exchange; on a link 10^4 times slower stage 1's compute and its
# two layers' exchanges do: 4 micro-batches x (4 x 2 layers x (ep - 1) / ep x 128 tokens x K 2 x D 64 x 4 bytes
# over the link + 8 messages' latency).
sed -E 's/"intra_node_gbps": [0-9.]+/"intra_node_gbps": 0.0002/' "$work/none.json" >"$work/slow.json"
PACE=(--layers 4 --dense-layers 2 --ffn-hidden 512 --pp 2 --ep 2 --micro-batches 4)
read -r model a b <<<"$(flops_line "${PACE[@]}")"
read -r _ cdp _ <<<"$(parts none --zero 1 --layers 4 --dense-layers 2 --ffn-hidden 512)"
for link in none slow; do
    read -r _ comp _ _ ep _ <<<"$(parts "$link" "${PACE[@]}")"
    if [ "$link" = none ]; then stage=$a want_ep=0; else stage=$b want_ep="4 * (4 * 2 * 0.5 * 128 * 2 * 64 * 4 / 2e5 + 8 * 30e-6)"; fi
    if [ -n "${ep:-}" ] && "$PY" -c "import sys
sys.exit(not ($a > $b and abs($comp - $cdp * 2 * $stage / $model) <= 4e-6 and abs($ep - ($want_ep)) <= 1e-6 + 1e-6 * $ep))"; then
        ok "pace stage, pp2 x ep2, link $link: compute $comp s (the stage of $stage FLOPs per token), ep $ep s"
    else
        bad "pace stage, pp2 x ep2, link $link" \
            "compute '${comp:-}' s, ep '${ep:-}' s; want the stage of $stage FLOPs per token (of $a, $b; dp4 ${cdp:-}) and ep $want_ep"
    fi
done

# 5. the optimizer step
for l in "--zero 0" "--zero 1" "--zero 2" "--zero 3" "--tp 2"; do
    # shellcheck disable=SC2086
    read -r state step <<<"$(bytes none $l)"
    per=8 # bytes of optimizer state per element: both moments (ZeRO-3: and the weights' f32 shard)
    [ "$l" = "--zero 3" ] && per=12
    if [ -n "${state:-}" ] && [ "$step" -gt 0 ] && [ $((step * per)) -eq $((32 * state)) ]; then
        ok "optimizer step, f32, $l: $step bytes = 32 per element of the optimizer state $state ($per each)"
    else
        bad "optimizer step, f32, $l" "state '${state:-}', step '${step:-}' (want 32 / $per x the state)"
    fi
done
for l in "--zero 1" "--zero 2"; do
    # shellcheck disable=SC2086
    read -r s32 t32 <<<"$(bytes none $l --dtype bf16)"
    # shellcheck disable=SC2086
    read -r s16 t16 <<<"$(bytes none $l --dtype bf16 --optim-dtype bf16)"
    verdict=$(
        "$PY" - "${s32:-x}" "${t32:-x}" "${s16:-x}" "${t16:-x}" <<'EOF'
import sys
try:
    s32, t32, s16, t16 = map(int, sys.argv[1:])
except ValueError:
    print("no plan bytes line"); sys.exit()
# bf16 objects hold 12 bytes of state per element (f32 master, f32 moments) or 8 (bf16 moments); f32 ones 8 or 4:
# 12 x + 8 y = s32 and 8 x + 4 y = s16, so 4 x = 2 s16 - s32
x, r = divmod(2 * s16 - s32, 4)
y, r2 = divmod(s16 - 8 * x, 4)
want = (34 * x + 32 * y, 26 * x + 24 * y)
ok = r == 0 and r2 == 0 and x > 0 and y >= 0 and (t32, t16) == want
print("ok %d %d" % (x, y) if ok else f"states {s32} {s16}, steps {t32} {t16}: want {want} (bf16 {x}, f32 {y})")
EOF
    )
    if [[ $verdict == ok* ]]; then
        read -r _ x y <<<"$verdict"
        ok "optimizer step, bf16, $l: $x bf16 and $y f32 elements: $t32 bytes (34, 32 each), $t16 with bf16 moments (26, 24)"
    else
        bad "optimizer step, bf16, $l" "$verdict"
    fi
done
sed '/"memory_gbps"/d' "$work/none.json" >"$work/nomem.json"
read -r _ step <<<"$(bytes none --zero 1)"
o10=$(parts none --zero 1 | cut -d' ' -f9)
o0=$(parts nomem --zero 1 | cut -d' ' -f9)
gbps=$(sed -nE 's/.*"memory_gbps": ([0-9.]+).*/\1/p' "$work/none.json")
if "$PY" -c "import sys; sys.exit(not (abs(float('$o10') - $step / ($gbps * 1e9)) <= 1e-6 and float('$o0') == 0))" \
    2>/dev/null; then
    ok "optimizer time: $step bytes at $gbps GB/s = $o10 s; without memory_gbps 0"
else
    bad "optimizer time" "'$o10' s for $step bytes at '$gbps' GB/s; without the field '$o0' (want 0)"
fi

# refused FIELD VALUE: a cluster with "FIELD": VALUE fails naming the field
refused() {
    local out
    cluster "bad" "\"$1\": $2"
    out=$("$PLAN" --device cpu --cluster "$work/bad.json" --check-rank 0 --nproc 4 "${SMALL[@]}" 2>&1)
    if [ $? -ne 0 ] && echo "$out" | grep -q "\"$1\""; then
        ok "bad input: \"$1\": $2 fails naming the field ($(echo "$out" | grep -m1 "$1" | cut -c1-90))"
    else
        bad "bad input: \"$1\": $2" "want a failure naming the field: $(echo "$out" | head -2)"
    fi
}
for v in -1 2.5 '"two"'; do refused cores_per_node "$v"; done
for v in 2 -1; do refused link_wait "$v"; done
finish
