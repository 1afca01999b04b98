#!/usr/bin/env bash
# examples/train_moe.c with the DeepSeek-V3 parts of examples/train_mla.h, end to end on tiny
# configurations: --grad-check of the whole model (MLA with a query latent, MoE blocks, two
# MTP modules) against central differences; --recompute attn and full log the same losses and
# gradient norms as none, bit for bit, on the CPU (and under --zero 3 on 2 ranks) and on the emulated GPU (where they also
# match the CPU's within f32 rounding, and --cuda-graph replays them bit for bit); the v2-lite
# and v3 presets train a few steps and print the memory report at start and end; bad flags
# fail with a message naming them.
# Prints `[test_mla_sh] totals: P passed / F failed / S skipped`; exits non-zero on failure.
TEST_NAME=test_mla_sh
source "$(dirname "$0")/train_test_lib.sh"
EMU_BIN=$BUILD/emu/examples/train_moe
need_built "$BIN"

run() { # name binary args...
    local name=$1 bin=$2; shift 2
    timeout 300 "$bin" "$@" >"$work/$name.out" 2>&1
    echo $? >"$work/$name.rc"
}
rc() { cat "$work/$1.rc"; }
fields() { # the logged numbers of a run (loss, gradient norm, validation loss), one line per record
    $PY - "$work/$1.jsonl" <<'PYEOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["type"], r["step"], repr(r.get("loss")), repr(r.get("grad_norm")), repr(r.get("val_loss")))
PYEOF
}

MLA=(--attn mla --q-lora-rank 12 --kv-lora-rank 10 --qk-nope-dim 6 --qk-rope-dim 4 --v-head-dim 8)
TINY=(--seq 16 --d-model 32 --heads 2 --layers 3 --dense-layers 2 --ffn-hidden 32 --experts 4 --top-k 2
      --expert-hidden 16 --shared 1 --batch 4 --lr 3e-3 --warmup 2 --data "$CORPUS" --corpus-mb 0.05 --val-every 10
      --val-interval 3 --val-batches 1 --sample-len 0 --peak-tflops 0.1 --steps 4 "${MLA[@]}" --mtp 2)

close_losses() { # run-a run-b: the same records, losses and validation losses within 1e-4 relative
    $PY - "$work/$1.jsonl" "$work/$2.jsonl" <<'PYEOF'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert len(a) == len(b) and len(a) > 0
for x, y in zip(a, b):
    for k in ("loss", "val_loss"):
        if k in x:
            assert abs(x[k] - y[k]) <= 1e-4 * abs(x[k]), (k, x[k], y[k])
PYEOF
}

# ---- 1. whole-model gradients against central differences (every parameter, 4 elements each)
run gradcheck "$BIN" --seq 16 --d-model 16 --heads 2 --layers 2 --dense-layers 1 --ffn-hidden 24 --experts 4 --top-k 2 \
    --expert-hidden 8 --batch 2 --data "$CORPUS" --corpus-mb 0.1 --aux-loss 0.01 --init-std 0.1 --grad-check 4 \
    --attn mla --q-lora-rank 8 --kv-lora-rank 8 --qk-nope-dim 4 --qk-rope-dim 4 --v-head-dim 6 --mtp 2 --mtp-lambda 0.5
n_params=$(grep -c '^grad-check ' "$work/gradcheck.out")
if [ "$(rc gradcheck)" -eq 0 ] && grep -q "grad-check: 0 of 63 parameters off" "$work/gradcheck.out" &&
   grep -q 'blocks.3.mtp.proj' "$work/gradcheck.out" && grep -q 'blocks.0.attn.wkv_a' "$work/gradcheck.out"; then
    ok "--grad-check, MLA (query latent) + MoE + MTP depth 2: 4 elements of each of 63 parameters match central differences"
else
    bad "--grad-check MLA + MTP" "exit $(rc gradcheck), $n_params lines" "$(grep -E 'FAIL|off|rank|error' "$work/gradcheck.out" | head -4)"
fi

# ---- 1b. MTP blocks with an MoE FFN (--mtp-ffn moe, DeepSeek-V3): the gradient check and routing record/replay
GCM=(--seq 16 --d-model 16 --heads 2 --layers 2 --dense-layers 1 --ffn-hidden 24 --experts 4 --top-k 2 --expert-hidden 8
     --batch 2 --data "$CORPUS" --corpus-mb 0.1 --aux-loss 0.01 --init-std 0.1 --attn mla --q-lora-rank 8
     --kv-lora-rank 8 --qk-nope-dim 4 --qk-rope-dim 4 --v-head-dim 6 --mtp 2 --mtp-lambda 0.5 --mtp-ffn moe)
run gradcheck_moe "$BIN" "${GCM[@]}" --grad-check 4
if [ "$(rc gradcheck_moe)" -eq 0 ] && grep -q "grad-check: 0 of 71 parameters off" "$work/gradcheck_moe.out" &&
   grep -q 'blocks.3.moe.router' "$work/gradcheck_moe.out" && grep -q 'blocks.2.moe.w1' "$work/gradcheck_moe.out"; then
    ok "--grad-check, MLA + MoE + MTP depth 2 with MoE FFNs: 4 elements of each of 71 parameters (the MTP blocks' routers, shared and routed experts too) match central differences"
else
    bad "--grad-check MTP MoE" "exit $(rc gradcheck_moe)" "$(grep -E 'FAIL|off|rank|error' "$work/gradcheck_moe.out" | head -4)"
fi
RR=("${GCM[@]}" --steps 3 --lr 3e-3 --warmup 1 --val-every 10 --val-interval 3 --val-batches 1 --sample-len 0)
run rr_rec "$BIN" "${RR[@]}" --routing-record "$work/mtp.routes" --log "$work/rr_rec.jsonl"
run rr_rep "$BIN" "${RR[@]}" --routing-replay "$work/mtp.routes" --log "$work/rr_rep.jsonl"
run rr_miss "$BIN" "${RR[@]}" --mtp 1 --mtp-ffn dense --routing-record "$work/dense.routes"
run rr_miss2 "$BIN" "${RR[@]}" --routing-replay "$work/dense.routes"
if [ "$(rc rr_rec)" -eq 0 ] && [ "$(rc rr_rep)" -eq 0 ] && [ -n "$(fields rr_rec)" ] &&
   [ "$(fields rr_rec)" = "$(fields rr_rep)" ] && [ "$(rc rr_miss2)" -ne 0 ] &&
   grep -q "no decision recorded .* layer 2" "$work/rr_miss2.out"; then
    ok "--mtp-ffn moe: routing replay of a record gives the same losses bit for bit; a record without the MTP blocks' MoE layers is refused naming layer 2"
else
    bad "--mtp-ffn moe routing record/replay" "exit $(rc rr_rec)/$(rc rr_rep)/$(rc rr_miss2)" "$(diff <(fields rr_rec) <(fields rr_rep) | head -3)" "$(tail -2 "$work/rr_miss2.out")"
fi

# checkpoints (the MTP blocks' MoE parameters and expert biases) and ZeRO-3 (their parameters in the head's unit)
MM=("${TINY[@]}" --mtp-ffn moe --bias-rate 0.05)
run mm_full "$BIN" "${MM[@]}" --log "$work/mm_full.jsonl"
run mm_a "$BIN" "${MM[@]}" --steps 2 --ckpt-dir "$work/mmck" --ckpt-every 2
run mm_res "$BIN" "${MM[@]}" --ckpt-dir "$work/mmck" --resume --log "$work/mm_res.jsonl"
if [ "$(rc mm_res)" -eq 0 ] && [ -n "$(fields mm_res)" ] &&
   [ "$(fields mm_full | grep -vE '^(step|val) [12] ')" = "$(fields mm_res)" ] &&
   grep -q '"blocks.4.moe.bias"' "$work/mmck/step_00000002/manifest.json" &&
   grep -q '"blocks.4.moe.w1"' "$work/mmck/step_00000002/manifest.json"; then
    ok "--mtp-ffn moe: resumed at step 2, steps 3-4 log the uninterrupted run's numbers bit for bit; the checkpoint holds the MTP blocks' MoE weights and expert biases"
else
    bad "--mtp-ffn moe resume" "exit $(rc mm_a)/$(rc mm_res)" "$(diff <(fields mm_full) <(fields mm_res) | head -4)"
fi
for z in 0 3; do run "mmz$z" "$BIN" "${MM[@]}" --nproc 2 --zero "$z" --log "$work/mmz$z.jsonl"; done
if [ "$(rc mmz0)" -eq 0 ] && [ "$(rc mmz3)" -eq 0 ] && [ -n "$(fields mmz0)" ] && [ "$(fields mmz0)" = "$(fields mmz3)" ]; then
    ok "2 ranks, MTP blocks with MoE FFNs: --zero 3 logs --zero 0's numbers bit for bit"
else
    bad "--mtp-ffn moe under --zero 3" "exit $(rc mmz0) $(rc mmz3)" "$(diff <(fields mmz0) <(fields mmz3) | head -3)"
fi

# ---- 2. recomputation: the same logged numbers, bit for bit, and the memory report
for r in none attn full; do run "cpu_$r" "$BIN" "${TINY[@]}" --recompute "$r" --log "$work/cpu_$r.jsonl"; done
for r in attn full; do
    if [ "$(rc cpu_none)" -eq 0 ] && [ "$(rc "cpu_$r")" -eq 0 ] && [ -n "$(fields cpu_none)" ] &&
       [ "$(fields cpu_none)" = "$(fields "cpu_$r")" ]; then
        ok "CPU --recompute $r: losses, gradient norms and validation losses equal none's bit for bit"
    else
        bad "CPU --recompute $r" "exit $(rc "cpu_$r")" "$(diff <(fields cpu_none) <(fields "cpu_$r") | head -4)" "$(tail -2 "$work/cpu_$r.out")"
    fi
done
peaks=$(for r in none attn full; do grep 'memory at end' "$work/cpu_$r.out" | sed -E 's/.*peak activations [0-9.]+ MiB \(([0-9]+) B\).*/\1/'; done | tr '\n' ' ')
if $PY -c "import sys; a = [float(x) for x in sys.argv[1:]]; sys.exit(0 if len(a) == 3 and a[2] < a[1] < a[0] else 1)" $peaks &&
   grep -q 'memory, rank 0: parameters' "$work/cpu_none.out"; then
    ok "memory report at start and end; peak activations none > attn > full: $peaks bytes"
else
    bad "memory report" "peaks: $peaks" "$(grep memory "$work/cpu_none.out" | head -2)"
fi

# ---- 2b. two ranks under ZeRO-3 (the MTP modules' embedding in the table's unit) log ZeRO-0's numbers
for z in 0 3; do run "zero$z" "$BIN" "${TINY[@]}" --recompute full --nproc 2 --zero "$z" --log "$work/zero$z.jsonl"; done
if [ "$(rc zero0)" -eq 0 ] && [ "$(rc zero3)" -eq 0 ] && [ -n "$(fields zero0)" ] && [ "$(fields zero0)" = "$(fields zero3)" ]; then
    ok "2 ranks, MLA + MTP + --recompute full: --zero 3 logs --zero 0's numbers bit for bit"
else
    bad "MLA + MTP under --zero 3" "exit $(rc zero0) $(rc zero3)" "$(diff <(fields zero0) <(fields zero3) | head -3)" \
        "$(grep -i error "$work/zero3.out" | head -2)"
fi

# ---- 3. the same on the emulated GPU (CUDA paths of every MLA/MTP op, graph capture)
if [ "${EMULATE:-1}" = 0 ]; then
    echo "skip the emulated GPU is not built (EMULATE=0)"; skipped=$((skipped + 1))
elif ! make --no-print-directory -s BUILD="$BUILD" "$EMU_BIN" >"$work/emu_build.log" 2>&1; then
    cat "$work/emu_build.log"; bad "build $EMU_BIN" "make failed"
else
    for r in none full; do run "gpu_$r" "$EMU_BIN" "${TINY[@]}" --device cuda --dtype f32 --recompute "$r" --log "$work/gpu_$r.jsonl"; done
    run gpu_graph "$EMU_BIN" "${TINY[@]}" --device cuda --dtype f32 --recompute attn --cuda-graph --log "$work/gpu_graph.jsonl"
    if [ "$(rc gpu_none)" -eq 0 ] && [ "$(rc gpu_full)" -eq 0 ] && [ "$(rc gpu_graph)" -eq 0 ] && [ -n "$(fields gpu_none)" ] &&
       [ "$(fields gpu_none)" = "$(fields gpu_full)" ] && [ "$(fields gpu_none)" = "$(fields gpu_graph)" ]; then
        ok "emulated GPU: --recompute full and --recompute attn --cuda-graph log none's numbers bit for bit"
    else
        bad "emulated GPU recompute/graph" "exit $(rc gpu_none) $(rc gpu_full) $(rc gpu_graph)" \
            "$(diff <(fields gpu_none) <(fields gpu_full) | head -3)" "$(tail -2 "$work/gpu_graph.out")"
    fi
    if [ "$(rc gpu_none)" -eq 0 ] && close_losses cpu_none gpu_none; then
        ok "emulated GPU f32 losses match the CPU's within 1e-4 (MLA + MTP on the CUDA ops)"
    else
        bad "emulated GPU vs CPU losses" "$(paste <(fields cpu_none) <(fields gpu_none) | head -3)"
    fi
    run gpu_mm "$EMU_BIN" "${MM[@]}" --device cuda --dtype f32 --log "$work/gpu_mm.jsonl"
    if [ "$(rc gpu_mm)" -eq 0 ] && close_losses mm_full gpu_mm; then
        ok "emulated GPU, MTP blocks with MoE FFNs: f32 losses match the CPU's within 1e-4"
    else
        bad "emulated GPU --mtp-ffn moe" "exit $(rc gpu_mm)" "$(tail -2 "$work/gpu_mm.out")"
    fi
fi

# ---- 4. presets train a few steps
for p in v2-lite v3; do
    run "preset_$p" "$BIN" --preset "$p" --steps 2 --seq 32 --batch 2 --data "$CORPUS" --corpus-mb 0.05 --val-every 10 \
        --val-interval 2 --val-batches 1 --sample-len 0 --peak-tflops 0.1
    if [ "$(rc "preset_$p")" -eq 0 ] && grep -q 'attention: MLA' "$work/preset_$p.out" && grep -q 'memory at end' "$work/preset_$p.out" &&
       grep -q 'final validation loss [0-9]' "$work/preset_$p.out"; then
        ok "--preset $p: $(grep '^model:' "$work/preset_$p.out" | cut -c1-110)"
    else
        bad "--preset $p" "exit $(rc "preset_$p")" "$(tail -3 "$work/preset_$p.out")"
    fi
done
if grep -q 'q_lora_rank 96' "$work/preset_v3.out" && grep -q 'depth 1' "$work/preset_v3.out" &&
   grep -q 'q_lora_rank 0' "$work/preset_v2-lite.out" && grep -q 'MoE 32 routed (sigmoid, top-4)' "$work/preset_v3.out"; then
    ok "presets: V3 has a query latent, MTP depth 1 and sigmoid top-4 of 32; V2-Lite no query latent"
else
    bad "preset contents" "$(grep -E 'attention|multi|model' "$work/preset_v3.out" | head -3)"
fi

# ---- 5. bad flags
check_bad() { # name expected-message args...
    local name=$1 msg=$2; shift 2
    run "$name" "$BIN" "$@" --data "$CORPUS" --corpus-mb 0.05 --steps 1 --sample-len 0
    if [ "$(rc "$name")" -ne 0 ] && grep -q -- "$msg" "$work/$name.out"; then ok "bad input fails: $msg"
    else bad "bad input $name" "exit $(rc "$name")" "$(tail -2 "$work/$name.out")"; fi
}
check_bad attn '--attn "gqa": use mha or mla' --attn gqa
check_bad recompute '--recompute "some": use none, attn or full' --recompute some
check_bad preset '--preset "v4": use tiny, v2-lite or v3' --preset v4
check_bad rope '--qk-rope-dim 5 must be even' --attn mla --qk-rope-dim 5
check_bad mtp '--mtp 9: between 0 and 4' --mtp 9
check_bad mtp_ffn '--mtp-ffn "wide": use dense or moe' --mtp 1 --mtp-ffn wide
check_bad mtp_ffn_dense '--mtp-ffn moe: the model has no MoE layer' --mtp 1 --mtp-ffn moe --layers 2 --dense-layers 2

finish
