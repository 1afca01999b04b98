#!/usr/bin/env bash
# The planner's GPU calibration (issue 30): the share of the bf16 peak a training step reaches on one
# GPU, the `efficiency` of examples/clusters/h200_*.json (dsk_plan.h assumes 0.4 where a file gives
# none). train_moe trains a mid-sized model below in bf16 on the GPU; the step's FLOPs are the
# planner's own count (dsk_plan's "training FLOPs per token" x the step's tokens), over the median
# step after the first 3, over the cluster file's bf16_tflops. scripts/device_check.sh runs it; the
# figure goes into bench/plan_gpu_calibrated.json and bench/RESULTS.md by hand.
# Usage: bash bench/plan_gpu.sh TRAIN_MOE [CLUSTER]   (dsk_plan beside TRAIN_MOE; CLUSTER default
#        examples/clusters/h200_1x8.json)
set -u
cd "$(dirname "$0")/.."
BIN=${1:?usage: bash bench/plan_gpu.sh TRAIN_MOE [CLUSTER]}
CLUSTER=${2:-examples/clusters/h200_1x8.json}
BATCH=8 SEQ=1024
MODEL=(--seq $SEQ --d-model 2048 --heads 16 --layers 4 --dense-layers 1 --ffn-hidden 5632 --experts 16 --top-k 4
       --expert-hidden 1408 --shared 1 --batch $BATCH)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fpt=$("$(dirname "$BIN")/dsk_plan" --device cuda --cluster "$CLUSTER" --sequences $BATCH "${MODEL[@]}" --top 1 2>&1 |
    sed -nE 's/.*, ([0-9.e+]+) training FLOPs per token.*/\1/p')
[ -n "$fpt" ] || { echo "dsk_plan printed no FLOPs per token"; exit 1; }
if ! "$BIN" "${MODEL[@]}" --device cuda --dtype bf16 --steps 15 --warmup 2 --corpus-mb 2 \
    --val-interval 1000000 --sample-len 0 --log "$work/run.jsonl" >"$work/run.out" 2>&1; then
    echo "train_moe failed:"; tail -5 "$work/run.out"; exit 1
fi
peak=$(sed -nE 's/.*"bf16_tflops": *([0-9.e+]+).*/\1/p' "$CLUSTER")
python3 - "$work/run.jsonl" "$fpt" "$peak" "$BATCH" "$SEQ" "${MODEL[*]}" <<'PYEOF'
import json, statistics, sys
log, fpt, peak, batch, seq, model = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
ms = [json.loads(l)["ms"] for l in open(log) if '"type":"step"' in l]
med = statistics.median(ms[3:] or ms)
tflops = fpt * batch * seq / (med * 1e-3) / 1e12
print("train_moe %s --dtype bf16 on one GPU: %d steps, median step %.2f ms (steps 4..), %.4g FLOPs/token" % (model, len(ms), med, fpt))
print("summary: plan gpu calibration: %.1f TFLOP/s = efficiency %.3f of %g bf16 TFLOP/s (step %.2f ms, %d tokens)"
      % (tflops, tflops / peak, peak, med, batch * seq))
PYEOF
