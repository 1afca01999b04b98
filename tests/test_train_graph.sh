#!/usr/bin/env bash
# examples/train_moe.c on the emulated GPU (tests/cuda_emu): --cuda-graph, which captures a whole
# step (every micro-batch's forward, loss and backward, unscale, the skip/clip decision, AdamW,
# the expert-bias and loss-scale updates) as a CUDA graph once and replays it each step, gives
# the eager run's logged losses, gradient norms, loss scales, skip flags and validation losses
# bit for bit: bf16 with gradient accumulation; fp16 with its dynamic loss scale; fp16 with
# --init-std 0.5, whose steps 1 and 3 overflow (skipped on the device, the scale backs off and
# the step is captured again) and steps 2 and 4 apply; fp8 (FP8 linears) with bf16 AdamW moments;
# two ranks with expert parallelism (--nproc 2 --ep 2, the bounded exchange: bf16 with --accum 2 over
# 10 steps, and fp16 --init-std 0.5, whose overflowing steps skip and capture again),
# whose graph holds the passes with their expert all-to-alls over the emulated NCCL and whose
# gradient all-reduce and AdamW run after each launch (the expert bytes logged too); the bf16 one
# again with --ep-overlap on (the exchanges on the layers' own stream, forked and joined by events
# inside the graph), whose eager run also logs the serial exchange's numbers bit for bit; and two
# data-parallel ranks in f32.
# A capture fails on any host sync inside it, so the runs also prove the captured steps make none.
# And --cuda-graph on the CPU, with --zero, or with --ep and the exact exchange fails with a message.
# With fewer GPUs than local ranks --device auto trains on the CPU, and cuda fails naming the ranks
# that would share one.
# Prints `[test_train_graph] totals: P passed / F failed / S skipped`; exits non-zero on failure.
TEST_NAME=test_train_graph
source "$(dirname "$0")/train_test_lib.sh"
BIN=$BUILD/emu/examples/train_moe
if [ "${EMULATE:-1}" = 0 ]; then
    skip "the emulated GPU is not built (EMULATE=0)"; finish
fi
need_built "$BIN"

TINY=(--seq 16 --d-model 32 --heads 2 --layers 2 --dense-layers 1 --ffn-hidden 32 --experts 4 --top-k 2
      --expert-hidden 16 --shared 1 --batch 4 --lr 3e-3 --warmup 2 --data "$CORPUS" --corpus-mb 0.05 --val-every 10
      --val-interval 3 --val-batches 1 --sample-len 0 --peak-tflops 0.1 --steps 4 --device cuda)

run() { # name args...
    local name=$1; shift
    timeout 300 "$BIN" "$@" --log "$work/$name.jsonl" >"$work/$name.out" 2>&1
    echo $? >"$work/$name.rc"
}
expect_run() { # name ok|fail text what: the run exited 0 (ok) or not (fail) and its output has the text
    local rc exited=fail
    rc=$(cat "$work/$1.rc")
    [ "$rc" -eq 0 ] && exited=ok
    if [ "$exited" = "$2" ] && grep -qF -- "$3" "$work/$1.out"; then ok "$4"
    else bad "$4" "exit $rc" "$(tail -2 "$work/$1.out")"; fi
}
fields() { # the logged numbers of a run, one line per record
    $PY - "$work/$1.jsonl" <<'PYEOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["type"] == "step":
        print("step", r["step"], repr(r["loss"]), repr(r["grad_norm"]), repr(r["loss_scale"]), r["skipped"],
              r.get("ep_dispatch_bytes"), r.get("ep_combine_bytes"))
    elif r["type"] == "val": print("val", r["step"], repr(r["val_loss"]))
PYEOF
}

for variant in "bf16 --accum 2" "fp16" "fp16 --init-std 0.5" "fp8 --optim-dtype bf16" \
               "bf16 --accum 2 --nproc 2 --ep 2 --ep-exchange bounded --steps 10" \
               "bf16 --accum 2 --nproc 2 --ep 2 --ep-exchange bounded --steps 10 --ep-overlap on" \
               "fp16 --init-std 0.5 --nproc 2 --ep 2 --ep-exchange bounded" "f32 --nproc 2"; do
    set -- $variant
    dt=$1; shift
    name="${dt}_$#"
    run "eager_$name" "${TINY[@]}" --dtype "$dt" "$@"
    run "graph_$name" "${TINY[@]}" --dtype "$dt" "$@" --cuda-graph
    what="--cuda-graph $dt${*:+ $*}: the logged steps and validation equal the eager run's bit for bit"
    if [ "$(cat "$work/eager_$name.rc")" -ne 0 ] || [ "$(cat "$work/graph_$name.rc")" -ne 0 ]; then
        bad "$what" "exit $(cat "$work/eager_$name.rc")/$(cat "$work/graph_$name.rc")" "$(tail -3 "$work/graph_$name.out")"
        continue
    fi
    a=$(fields "eager_$name"); b=$(fields "graph_$name")
    steps=4; [[ " $* " == *" --steps 10 "* ]] && steps=10
    if [ -n "$a" ] && [ "$a" = "$b" ] && [ "$(echo "$a" | grep -c '^step')" -eq $steps ] &&
       grep -q "cuda graph: each step replays one captured graph" "$work/graph_$name.out"; then ok "$what"
    else bad "$what" "$(diff <(echo "$a") <(echo "$b") | head -6)"; fi
    if [[ " $* " == *" --init-std "* ]]; then # the overflow run: skipped and applied steps, more than one loss scale
        skips=$(echo "$b" | awk '$1 == "step" { print $6 }' | sort -u | tr -d '\n')
        scales=$(echo "$b" | awk '$1 == "step" { print $5 }' | sort -u | wc -l)
        what="--cuda-graph $dt $*: the replayed run skipped and applied steps and moved its loss scale"
        if [ "$skips" = "01" ] && [ "$scales" -ge 2 ]; then ok "$what"
        else bad "$what" "skip flags seen: '$skips', loss scales: $scales" "$b"; fi
    fi
done

what="--ep-overlap on, bf16 --accum 2 --nproc 2 --ep 2 --ep-exchange bounded: the eager run logs the serial one's numbers"
a=$(fields eager_bf16_10); b=$(fields eager_bf16_12)
if [ -n "$a" ] && [ "$a" = "$b" ]; then ok "$what"; else bad "$what" "$(diff <(echo "$a") <(echo "$b") | head -6)"; fi

# the exact exchange chunked on the emulated GPUs (the experts start on a rank's own rows while ring shifts on the
# layers' exchange stream carry the other rank's, its chunk waiting for its shift's event): the serial numbers
run ep_serial "${TINY[@]}" --dtype bf16 --accum 2 --nproc 2 --ep 2 --steps 6
run ep_chunked "${TINY[@]}" --dtype bf16 --accum 2 --nproc 2 --ep 2 --steps 6 --ep-overlap chunked
what="--ep-overlap chunked, bf16 --accum 2 --nproc 2 --ep 2 (exact): the run logs the serial one's numbers bit for bit"
a=$(fields ep_serial); b=$(fields ep_chunked)
if [ "$(cat "$work/ep_serial.rc")$(cat "$work/ep_chunked.rc")" = 00 ] && [ "$(echo "$a" | grep -c '^step')" -eq 6 ] &&
   [ "$a" = "$b" ]; then ok "$what"
else bad "$what" "exit $(cat "$work/ep_serial.rc")/$(cat "$work/ep_chunked.rc")" "$(diff <(echo "$a") <(echo "$b") | head -6)"; fi

# the bounded exchange chunked: no host sync still, so the step is one graph; eager and replayed, the serial
# bounded exchange's numbers
run ep_bchunked "${TINY[@]}" --dtype bf16 --accum 2 --nproc 2 --ep 2 --ep-exchange bounded --steps 10 --ep-overlap chunked
run ep_bchunked_graph "${TINY[@]}" --dtype bf16 --accum 2 --nproc 2 --ep 2 --ep-exchange bounded --steps 10 \
    --ep-overlap chunked --cuda-graph
what="--ep-overlap chunked --ep-exchange bounded, bf16 --accum 2 --nproc 2 --ep 2: eager and --cuda-graph log the"
what="$what serial exchange's numbers bit for bit"
a=$(fields eager_bf16_10); b=$(fields ep_bchunked); g=$(fields ep_bchunked_graph)
if [ "$(cat "$work/ep_bchunked.rc")$(cat "$work/ep_bchunked_graph.rc")" = 00 ] && [ -n "$a" ] && [ "$a" = "$b" ] &&
   [ "$a" = "$g" ] && grep -q "cuda graph: each step replays one captured graph" "$work/ep_bchunked_graph.out"; then
    ok "$what"
else bad "$what" "exit $(cat "$work/ep_bchunked.rc")/$(cat "$work/ep_bchunked_graph.rc")" \
    "$(diff <(echo "$a") <(echo "$b") | head -4; diff <(echo "$a") <(echo "$g") | head -4)"; fi

run zero "${TINY[@]}" --zero 1 --cuda-graph
expect_run zero fail "--cuda-graph runs without --zero" "--cuda-graph with --zero fails with a message"

run exact "${TINY[@]}" --ep 2 --cuda-graph
expect_run exact fail "--cuda-graph with --ep 2 needs --ep-exchange bounded" \
    "--cuda-graph with --ep 2 and the exact exchange fails with a message"

# fewer GPUs than local ranks: auto trains on the CPU over the host backend, cuda fails naming the
# ranks and their device (nccl would refuse two ranks on one), and --device cpu stays off nccl where GPUs are
for dev in auto cuda cpu; do
    CUDA_EMU_DEVICES=$([ $dev = cpu ] && echo 4 || echo 1) run "few_$dev" "${TINY[@]}" --nproc 2 --device $dev --steps 2
done
expect_run few_auto ok "2 ranks (expert parallel 1), CPU" "--nproc 2 on 1 GPU, --device auto: the CPU"
expect_run few_cuda fail "the nccl backend needs a CUDA device per rank; ranks 0 and 1 (" \
    "--nproc 2 on 1 GPU, --device cuda: fails naming the two ranks and the device"
expect_run few_cpu ok "2 ranks (expert parallel 1), CPU" "--nproc 2 --device cpu on 4 GPUs: the CPU over the host backend"

run cpu "${TINY[@]}" --device cpu --cuda-graph
expect_run cpu fail "--cuda-graph needs GPUs" "--cuda-graph on the CPU fails with a message"
finish
