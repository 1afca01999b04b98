#!/usr/bin/env bash
# FP8 on the wire in the trainer (examples/train_moe.c; issue 26): --ep-dispatch fp8.
#   1. 150 steps at 2 ranks with --ep 2 (each MoE layer's experts split over both): with
#      --ep-dispatch fp8 the token rows of the dispatch all-to-all are e4m3 codes with 1x128 f32
#      scales, dequantised at the experts. The validation loss ends within 1% of --ep-dispatch act
#      (the rows in f32 on the CPU), and every step's logged dispatch bytes are the formula's: the
#      run is dropless, so each MoE layer sends its T K kept rows whatever the routing, and
#      fp8 / act = (D + 4 ceil(D / 128)) / (4 D) exactly. The combine stays f32: its bytes follow the
#      routing, so only their presence is checked.
#   2. The emulated GPU (tests/cuda_emu), 2 ranks, --ep 2, bf16, 20 steps: with fp8 dispatch the
#      validation loss within 2% of act's, the dispatch bytes (D + 4 ceil(D/128)) / (2 D) of bf16's.
#   3. A bad value, and fp8 without --ep (nothing to send), fail naming the flag.
# (--grad-compress fp8 is in tests/test_zero_train.sh, section 4.)
# Prints `[test_fp8_comm] totals: P passed / F failed / S skipped`.
TEST_NAME=test_fp8_comm
source "$(dirname "$0")/train_test_lib.sh"
need_built "$BIN"

D=32
P=(--seq 32 --d-model $D --heads 2 --layers 3 --dense-layers 1 --ffn-hidden 64 --experts 4 --top-k 2
   --expert-hidden 32 --shared 1 --batch 8 --lr 3e-3 --warmup 5 --data "$CORPUS" --val-every 10
   --val-interval 50 --val-batches 4 --sample-len 0 --peak-tflops 0.1 --nproc 2)
P0=("${P[@]}")
P+=(--ep 2)

# run NAME ARGS...: output in $work/NAME.out, JSON lines in $work/NAME.jsonl; returns the exit status
run() {
    local name=$1; shift
    timeout 300 "$1" "${@:2}" --log "$work/$name.jsonl" >"$work/$name.out" 2>&1
}

# compare A B DTYPE_BYTES TOL: validation loss of B within TOL of A's, B's dispatch bytes per step
# A's times (D + 4 ceil(D/128)) / (DTYPE_BYTES D), combine bytes logged
compare() {
    $PY - "$work/$1.jsonl" "$work/$2.jsonl" "$D" "$3" "$4" <<'EOF'
import json, sys
def rows(p): return [json.loads(l) for l in open(p)]
a, b = rows(sys.argv[1]), rows(sys.argv[2])
D, es, tol = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
ratio = (D + 4 * ((D + 127) // 128)) / (es * D)
va = [r["val_loss"] for r in a if r["type"] == "val"][-1]
vb = [r["val_loss"] for r in b if r["type"] == "val"][-1]
sa = [r for r in a if r["type"] == "step"]
sb = [r for r in b if r["type"] == "step"]
problems = []
if not abs(vb / va - 1) <= tol: problems.append("validation loss %.4f against %.4f (> %g)" % (vb, va, tol))
if len(sa) != len(sb) or not sa: problems.append("%d and %d steps" % (len(sa), len(sb)))
for r0, r in zip(sa, sb):
    if r0["ep_dispatch_bytes"] <= 0 or r["ep_dispatch_bytes"] != r0["ep_dispatch_bytes"] * ratio or \
            r["ep_combine_bytes"] <= 0:
        problems.append("step %d: dispatch %s bytes, want %s x %.5f; combine %s"
                        % (r["step"], r["ep_dispatch_bytes"], r0["ep_dispatch_bytes"], ratio, r["ep_combine_bytes"]))
        break
print("; ".join(problems) if problems else
      "ok validation loss %.4f vs %.4f (%+.3f%%); dispatch %.0f vs %.0f bytes per step and rank (%.3fx fewer), "
      "combine %.0f" % (vb, va, 100 * (vb / va - 1), sb[-1]["ep_dispatch_bytes"], sa[-1]["ep_dispatch_bytes"],
                        sa[-1]["ep_dispatch_bytes"] / sb[-1]["ep_dispatch_bytes"], sb[-1]["ep_combine_bytes"]))
EOF
}

# ---- 1. the CPU: fp8 against f32 rows
if run act "$BIN" "${P[@]}" --steps 150 && run fp8 "$BIN" "${P[@]}" --steps 150 --ep-dispatch fp8; then
    grep -q "expert dispatch: e4m3 codes with 1x128 f32 scales" "$work/fp8.out" || bad "fp8 banner" "$(head -3 "$work/fp8.out")"
    v=$(compare act fp8 4 0.01)
    case $v in ok*) ok "--ep 2 --ep-dispatch fp8, 150 steps at 2 ranks: ${v#ok }";; *) bad "--ep-dispatch fp8" "$v";; esac
else
    bad "--ep-dispatch act and fp8 at 2 ranks" "$(tail -3 "$work/act.out")" "$(tail -3 "$work/fp8.out")"
fi

# ---- 2. the emulated GPU, bf16
EMU_BIN=$BUILD/emu/examples/train_moe
if [ "${EMULATE:-1}" = 0 ]; then
    skip "the emulated GPU is not built (EMULATE=0)"
else
    need_built "$EMU_BIN"
    G=("${P[@]}" --steps 20 --val-interval 10 --val-batches 1 --device cuda --dtype bf16)
    if run g_act "$EMU_BIN" "${G[@]}" && run g_fp8 "$EMU_BIN" "${G[@]}" --ep-dispatch fp8; then
        v=$(compare g_act g_fp8 2 0.02)
        case $v in ok*) ok "emulated GPU, bf16, --ep 2 --ep-dispatch fp8, 20 steps: ${v#ok }";; *) bad "emulated GPU fp8 dispatch" "$v";; esac
    else
        bad "emulated GPU --ep-dispatch act and fp8" "$(tail -3 "$work/g_act.out")" "$(tail -3 "$work/g_fp8.out")"
    fi
fi

# ---- 3. bad input
if run bad "$BIN" "${P[@]}" --steps 1 --ep-dispatch e5m2; then bad "--ep-dispatch e5m2 was accepted"
elif grep -qF -- '--ep-dispatch "e5m2": use act or fp8' "$work/bad.out"; then ok "--ep-dispatch e5m2 fails naming the flag"
else bad "--ep-dispatch e5m2 fails cleanly" "$(tail -2 "$work/bad.out")"; fi
if run bad1 "$BIN" "${P0[@]}" --steps 1 --ep-dispatch fp8; then bad "--ep-dispatch fp8 without --ep was accepted"
elif grep -qF -- '--ep-dispatch fp8 needs --ep 2 or more' "$work/bad1.out"; then ok "--ep-dispatch fp8 without --ep fails naming both"
else bad "--ep-dispatch fp8 without --ep fails cleanly" "$(tail -2 "$work/bad1.out")"; fi

finish
