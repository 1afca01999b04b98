#!/usr/bin/env bash
# The small examples of examples/ (each one file, one path; README.md, Examples) run briefly and do
# what they say:
# - moe_layer: the MoE layer trained with AdamW and loss scaling on its own slabs lowers its loss
#   at least 4-fold in 200 steps;
# - ckpt_resume: a run to 8 steps resumed to 12 gives the weights of one run to 12 bit for bit;
#   with the newest checkpoint's file damaged (one byte), the resume falls back to the one
#   before, names the damaged file, and still ends on the same bits;
# - expert_parallel: two expert-parallel ranks (host backend) give one rank's y bit for bit, and
#   its dx and summed router gradient within 1e-5 of the largest value;
# - hf_moe_layer: the MoE layer of the Hugging Face fixtures (tests/hf: v3, v2, v3_fp8) on fresh
#   random input equals a float64 implementation in Python (tests/hf/moe_layer_ref.py);
# - cuda_graph_step: on the CUDA emulator (build/emu) the step replayed as a CUDA graph logs the
#   eager step's losses and ends on its weights bit for bit (and on a GPU the same, when the
#   build has CUDA and a device); without a GPU the CPU build says it needs one and exits 77
#   (a named skip only where the emulator is not built: EMULATE=0).
# Prints `[test_teach] totals: P passed / F failed / S skipped`; exits non-zero on failure.
TEST_NAME=test_teach
source "$(dirname "$0")/train_test_lib.sh"
EX=$BUILD/examples
for e in moe_layer ckpt_resume expert_parallel hf_moe_layer cuda_graph_step; do need_built "$EX/$e"; done
SEED=${DSK_TEST_SEED:-$((RANDOM * 32768 + RANDOM))}

# ---- moe_layer: the loss falls 4-fold
if timeout 60 "$EX/moe_layer" 200 >"$work/moe.out" 2>&1; then
    read -r first last < <(sed -nE 's/^loss: ([0-9.e+-]+) -> ([0-9.e+-]+) .*/\1 \2/p' "$work/moe.out")
    if [ -n "${last:-}" ] && $PY -c "import sys; sys.exit(not (float('$first') >= 4 * float('$last')))"; then
        ok "moe_layer: 200 steps of AdamW with loss scaling lower the loss at least 4-fold ($first -> $last)"
    else
        bad "moe_layer: the loss falls at least 4-fold in 200 steps" "$(tail -3 "$work/moe.out")"
    fi
else
    bad "moe_layer runs" "$(tail -3 "$work/moe.out")"
fi

# ---- ckpt_resume: resume is exact; a damaged newest checkpoint is passed over, named
ck() { timeout 60 "$EX/ckpt_resume" "$work/$1" "$2" >>"$work/$1.out" 2>&1; }
if ck full 12 && ck part 8 && ck part 12; then
    if grep -q "^resumed from step 8$" "$work/part.out" && cmp -s "$work/full/final.bin" "$work/part/final.bin"; then
        ok "ckpt_resume: 8 steps, then resumed to 12 = 12 steps uninterrupted, bit for bit"
    else
        bad "ckpt_resume: resumed run = uninterrupted run" "$(grep resumed "$work/part.out")" \
            "$(cmp "$work/full/final.bin" "$work/part/final.bin" 2>&1)"
    fi
else
    bad "ckpt_resume runs" "$(tail -3 "$work/full.out" "$work/part.out")"
fi
if ck dmg 8; then
    f=$(ls "$work"/dmg/step_00000008/rank_00000.*.safetensors)
    # flip a byte of the last tensor's data
    $PY -c 'import sys; f = open(sys.argv[1], "r+b"); f.seek(-5, 2); b = f.read(1)[0]
f.seek(-5, 2); f.write(bytes([~b & 255]))' "$f"
    if ck dmg 12 && grep -q "^resumed from step 4$" "$work/dmg.out" &&
        grep -qE "^passed over 1 damaged checkpoint\(s\), the newest step 8: .*step_00000008/rank_00000\..*crc32c" \
            "$work/dmg.out" && cmp -s "$work/full/final.bin" "$work/dmg/final.bin"; then
        ok "ckpt_resume: step 8's file damaged: resumes from step 4 naming that file's CRC32C, ends on the same bits"
    else
        bad "ckpt_resume: fallback past a damaged checkpoint" "$(tail -5 "$work/dmg.out")" \
            "$(cmp "$work/full/final.bin" "$work/dmg/final.bin" 2>&1)"
    fi
else
    bad "ckpt_resume runs (damage case)" "$(tail -3 "$work/dmg.out")"
fi

# ---- expert_parallel: 2 ranks = 1 rank
if timeout 60 "$EX/expert_parallel" --nproc 1 --out "$work/ep1" >"$work/ep1.out" 2>&1 &&
    timeout 60 "$EX/expert_parallel" --nproc 2 --out "$work/ep2" >"$work/ep2.out" 2>&1; then
    if grep -q "^\[rank 1\] rank 1 of 2: experts \[4, 8) of 8$" "$work/ep2.out" &&
        cat "$work/ep2.y.rank0" "$work/ep2.y.rank1" | cmp -s - "$work/ep1.y.rank0"; then
        ok "expert_parallel: 2 ranks holding 4 experts each give one rank's y bit for bit"
    else
        bad "expert_parallel: 2 ranks' y = 1 rank's" "$(tail -4 "$work/ep2.out")"
    fi
    cat "$work/ep2.dx.rank0" "$work/ep2.dx.rank1" >"$work/ep2.dx"
    if out=$($PY - "$work" <<'PYEOF' 2>&1
import struct, sys
w = sys.argv[1]
def f32(p):
    b = open(p, "rb").read()
    return struct.unpack("<%df" % (len(b) // 4), b)
for what, a, b in (("dx", "ep2.dx", "ep1.dx.rank0"), ("router gradient", "ep2.router_grad", "ep1.router_grad")):
    x, y = f32(w + "/" + a), f32(w + "/" + b)
    scale = max(abs(q) for q in y) if y else 0.0
    err = max(abs(p - q) for p, q in zip(x, y)) / scale if len(x) == len(y) and scale > 0 else float("inf")
    print("%s: %d values, largest error %.3g of the largest value" % (what, len(y), err))
    if not err <= 1e-5: sys.exit(1)
PYEOF
    ); then
        ok "expert_parallel: 2 ranks' dx and summed router gradient = 1 rank's within 1e-5 ($(echo $out))"
    else
        bad "expert_parallel: dx and router gradient" "$out"
    fi
else
    bad "expert_parallel runs" "$(tail -3 "$work/ep1.out" "$work/ep2.out")"
fi

# ---- hf_moe_layer: the hub layer = a float64 reference
for f in v3 v2 v3_fp8; do
    what="hf_moe_layer tests/hf/$f --seed $SEED: y = tests/hf/moe_layer_ref.py's float64 layer"
    if timeout 60 "$EX/hf_moe_layer" "tests/hf/$f" --tokens 16 --seed "$SEED" --out "$work/hf_$f.safetensors" \
        >"$work/hf_$f.out" 2>&1 &&
        $PY tests/hf/moe_layer_ref.py "tests/hf/$f" "$work/hf_$f.safetensors" >"$work/hf_$f.ref" 2>&1; then
        ok "$what ($(cat "$work/hf_$f.ref"))"
    else
        bad "$what" "$(tail -3 "$work/hf_$f.out")" "$(tail -3 "$work/hf_$f.ref" 2>/dev/null)"
    fi
done

# ---- cuda_graph_step: the replayed graph = the eager step
graph_vs_eager() { # name binary
    timeout 120 "$2" --eager --out "$work/$1.eager.bin" >"$work/$1.eager.out" 2>&1
    local re=$?
    timeout 120 "$2" --graph --out "$work/$1.graph.bin" >"$work/$1.graph.out" 2>&1
    local rg=$?
    local a b
    a=$(grep '^step ' "$work/$1.eager.out"); b=$(grep '^step ' "$work/$1.graph.out")
    if [ $re -eq 0 ] && [ $rg -eq 0 ] && [ "$(echo "$a" | wc -l)" -eq 6 ] && [ "$a" = "$b" ] &&
        grep -q "captured once, replayed each step" "$work/$1.graph.out" &&
        cmp -s "$work/$1.eager.bin" "$work/$1.graph.bin"; then
        ok "cuda_graph_step ($1): 6 steps replayed as a CUDA graph log the eager losses, end on its weights bitwise"
    else
        bad "cuda_graph_step ($1): graph = eager" "exit $re/$rg" "$(diff <(echo "$a") <(echo "$b") | head -4)" \
            "$(tail -2 "$work/$1.graph.out")"
    fi
}
timeout 60 "$EX/cuda_graph_step" --steps 1 >"$work/cg.out" 2>&1
rc=$?
if [ $rc -eq 77 ]; then
    if grep -q "^cuda_graph_step: needs a GPU" "$work/cg.out"; then
        ok "cuda_graph_step ($EX, no GPU here): says it needs a GPU and exits 77"
    else
        bad "cuda_graph_step without a GPU says so" "$(cat "$work/cg.out")"
    fi
elif [ $rc -eq 0 ]; then
    graph_vs_eager gpu "$EX/cuda_graph_step"
else
    bad "cuda_graph_step ($EX) runs or exits 77" "exit $rc" "$(tail -3 "$work/cg.out")"
fi
if [ "${EMULATE:-1}" = 0 ]; then
    skip "cuda_graph_step on the CUDA emulator: not built (EMULATE=0)"
else
    need_built "$BUILD/emu/examples/cuda_graph_step"
    graph_vs_eager emulator "$BUILD/emu/examples/cuda_graph_step"
fi
finish
