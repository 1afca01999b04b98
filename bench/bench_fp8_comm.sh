#!/usr/bin/env bash
# Bytes per step and rank of the gradient reductions (--grad-compress none | bf16 | fp8) and of
# the MoE dispatch (--ep-dispatch act | fp8, with the combine), from the trainer's JSON lines
# (reduce_bytes, ep_dispatch_bytes, ep_combine_bytes; the last step's). 2 ranks on the CPU
# (gradients; dispatch rows f32 there) and on the emulated GPU in bf16 (dispatch rows bf16), so
# the bf16 and fp8 wire formats are both measured. Counts, not times: the machine does not matter.
# Usage: bench/bench_fp8_comm.sh [D_MODEL (256)] [BUILD (build)]
set -eu
cd "$(dirname "$0")/.."
D=${1:-256}
BUILD=${2:-build}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
M=(--seq 32 --d-model "$D" --heads 4 --layers 3 --dense-layers 1 --ffn-hidden 256 --experts 4 --top-k 2
   --expert-hidden 128 --shared 1 --batch 8 --data tests/data/corpus.txt --val-interval 100 --sample-len 0
   --peak-tflops 0.1 --steps 3 --nproc 2)
last() { # FILE KEY: the last step's KEY
    python3 -c 'import json,sys; print([r for r in map(json.loads, open(sys.argv[1])) if r["type"] == "step"][-1][sys.argv[2]])' "$@"
}
echo "d_model $D, 2 ranks; bytes per step and rank handed to the collectives"
for z in 0 2; do
    for c in none bf16 fp8; do
        "$BUILD/examples/train_moe" "${M[@]}" --zero $z --grad-compress $c --log "$work/g.jsonl" >/dev/null 2>&1
        printf 'gradients  --zero %d --grad-compress %-5s %10.0f (uncompressed %.0f)\n' $z $c \
            "$(last "$work/g.jsonl" reduce_bytes)" "$(last "$work/g.jsonl" reduce_bytes_uncompressed)"
    done
done
for dev in cpu cuda; do
    bin=$BUILD/examples/train_moe dt=f32
    [ $dev = cuda ] && bin=$BUILD/emu/examples/train_moe dt=bf16
    for e in act fp8; do
        "$bin" "${M[@]}" --ep 2 --device $dev --dtype $dt --ep-dispatch $e --log "$work/e.jsonl" >/dev/null 2>&1
        printf 'dispatch   %-4s %-4s --ep-dispatch %-3s %10.0f (combine %.0f)\n' $dev $dt $e \
            "$(last "$work/e.jsonl" ep_dispatch_bytes)" "$(last "$work/e.jsonl" ep_combine_bytes)"
    done
done
