#!/usr/bin/env bash
# End-to-end tests of every layout of examples/train_moe.c through its one gradient and optimizer
# engine (train_zero.h on dsk_zero.h; tensor, sequence and pipeline parallelism in train_par.h on
# dsk_par.h), tiny model on the CPU host backend:
#   the layout matrix: 8 ranks as tp2 x pp2 x dp2 (ZeRO-0 and ZeRO-1) and tp2 x pp2 x ep2, pp2 x
#   ep2 x dp2 at ZeRO-1, 4 ranks as tp4, pp4, pp2 interleaved x dp2 at ZeRO-3 and tp2 x ep2 at
#   ZeRO-2, 2 ranks as pp2 interleaved, each against one rank over 30 steps: the loss of every step
#   within 1e-5 relative, the weights at the end (assembled from the checkpoint's boxes by
#   tests/par_ckpt_compare.py) within 1e-5 relative (L2 per tensor), the AdamW moments within
#   1e-4 (v holds squared gradients: the rounding of another summation order in the small
#   gradient elements counts twice; one rank against dp2 shows 7e-6 there, these layouts 2e-5);
#   bf16 and fp16: pp2 with one micro-batch logs one rank's numbers bit for bit; tp2 x pp2 (1f1b),
#   pp2 interleaved, tp2, tp2 x pp2 x dp2 at ZeRO-1 and pp2 x ep2 x dp2 at ZeRO-1 in bf16 match one
#   rank in bf16 over 30 steps within a bound the test derives (twice one rank's bf16-to-f32
#   distance); fp16 as tp2 x pp2 and as tp2 x ep2 at ZeRO-2 skips an overflowing step on every
#   rank, halves the loss scale and leaves the weights as they were;
#   on the emulated GPU over nccl, tp2 x pp2 against one emulated GPU in f32 (MHA, and MLA with an
#   MTP module) and in bf16;
#   checkpoints across layouts (tp2 x pp2 x ZeRO-1 -> one rank and dp4, dp4 x ZeRO-3 -> tp2 x dp2 x
#   ZeRO-1, one rank -> pp2 x ep2 x dp2 x ZeRO-1) continue as the run that did not stop;
#   the same objective: with the Switch, sequence-wise and z losses on, every split logs one
#   rank's aux loss and every pipeline schedule gpipe's; PowerSGD at ZeRO-3 logs ZeRO-0's losses;
#   ZeRO-1's optimizer state per rank under tp x pp is 1/dp of ZeRO-0's plus unit padding;
#   a rank killed in tp2 x pp2 x ZeRO-1: every survivor names it, no hang;
#   the text sampled at the end through the pipeline is one rank's;
#   --attn mla --mtp 1 as tp2 x pp2 against an MLA/MTP run on one rank, in f32 (1e-5 as above,
#   the same sample; a one-rank checkpoint of it resumes as tp2 x pp2) and bf16 (the derived
#   bound; pp2 with one micro-batch bit for bit); two MTP
#   modules with MoE FFNs as tp2 x pp2 and as pp2 x dp2 at --zero 2 and 3, in f32;
#   --recompute attn|full under tp2 x pp2 bit for bit as without, with fewer activation bytes;
#   --pair-micro-batches (pp2 x ep2, interleaved with ZeRO-2 in fp16, an MTP head reached while the
#   backward is in a block, tp2 x pp2 with MLA, on the emulated GPU over nccl) bit for bit as without,
#   and on one stage as --accum; --pp-schedule dualpipev (pp2, pp4, paired pp2 x ep2 at ZeRO-1 in bf16, tp2 x pp2
#   with full recomputation, ZeRO-3 with FP8 GEMMs) bit for bit as interleaved with 2 virtual stages;
#   the grid and the bubble are printed; unsupported combinations fail with a message.
# Routing is replayed: the one-rank reference writes every MoE decision (--routing-record: each
#   step's, validation's and sampled token's top-k experts per layer and token) and every layout
#   takes them (--routing-replay, each rank the tokens it holds). A layout sums in another order,
#   so its router scores differ from one rank's in the last bits; top-k selection and the sign of
#   the expert-bias update are discontinuous, and a near-tie decided the other way would move a
#   token to another expert and fail the 1e-5 checks by luck, not by a defect. With the decisions
#   fixed, what remains is continuous (the weights g come from the layout's own scores, and the
#   bias update counts the same loads), so the tolerances stay strict.
#   The checkpoint cases replay the same record; the emulated GPU cases record their own.
# Prints `[test_par_train] totals: P passed / F failed / S skipped`; exits non-zero on failure.
TEST_NAME=test_par_train
source "$(dirname "$0")/train_test_lib.sh"
need_built "$BIN"

# 4 heads and 4 blocks (1 dense, 3 MoE with 4 experts, a shared one) so that tp4 and pp4 fit.
TINY=(--seq 32 --d-model 32 --heads 4 --layers 4 --dense-layers 1 --ffn-hidden 64 --experts 4 --top-k 2
      --expert-hidden 32 --shared 1 --batch 8 --lr 3e-3 --warmup 5 --data "$CORPUS" --corpus-mb 0.3 --val-every 10
      --val-interval 10 --val-batches 2 --sample-len 0 --peak-tflops 0.1)

run() { # NAME ARGS...: output in $work/NAME.out, status in $work/NAME.rc
    local name=$1; shift
    timeout 120 "$BIN" "$@" >"$work/$name.out" 2>&1
    echo $? >"$work/$name.rc"
}
rc() { cat "$work/$1.rc"; }

# worst relative difference of the common steps' losses and validation losses (at least $3
# of them), or an error
compare_losses() {
    $PYS - "$work/$1.jsonl" "$work/$2.jsonl" "$3" <<'EOF'
import json, sys
def rows(p): # the loss of every step and every validation
    return {(r["type"], r["step"]): r["loss" if r["type"] == "step" else "val_loss"] for r in map(json.loads, open(p))}
a, b = rows(sys.argv[1]), rows(sys.argv[2])
common = sorted(set(a) & set(b))
if len(common) < int(sys.argv[3]) or any(a[k] is None or b[k] is None for k in common):
    print("bad: %d common steps of %d and %d" % (len(common), len(a), len(b))); sys.exit()
print("%.3g" % max(abs(a[k] - b[k]) / abs(a[k]) for k in common))
EOF
}
within() { $PYS -c "import sys; sys.exit(0 if float('$1') <= $2 else 1)" 2>/dev/null; }

# ---- 1. layouts against one rank: loss every step, weights and moments at the end
REC=(--routing-replay "$work/routes.bin")
run one "${TINY[@]}" --steps 30 --log "$work/one.jsonl" --ckpt-dir "$work/ck_one" --sample-len 40 \
    --routing-record "$work/routes.bin"
# the sample a run ends with (40 tokens drawn at temperature 0.8 through the pipeline), rank 0's lines
sample() { sed -n '/---- sample/,/---- end of sample/p' "$work/$1.out" | sed 's/^\[rank 0\] //'; }
LAYOUTS=(
    "tp2pp2dp2|8|--tp 2 --pp 2 --micro-batches 2|tp 2 x dp 2 (ep 1 inside) x pp 2|pipeline 1f1b, 2 stages x 1 virtual, 2 micro-batches of 2 sequences, bubble 0.500"
    "tp2pp2ep2|8|--tp 2 --pp 2 --ep 2 --micro-batches 2 --pp-schedule gpipe|tp 2 x dp 2 (ep 2 inside) x pp 2|pipeline gpipe, 2 stages x 1 virtual, 2 micro-batches of 2 sequences, bubble 0.500"
    "tp4|4|--tp 4|tp 4 x dp 1 (ep 1 inside) x pp 1|pipeline 1f1b, 1 stage x 1 virtual"
    "pp4|4|--pp 4 --micro-batches 4|tp 1 x dp 1 (ep 1 inside) x pp 4|pipeline 1f1b, 4 stages x 1 virtual, 4 micro-batches of 2 sequences, bubble 0.750"
    "pp2il|2|--pp 2 --pp-schedule interleaved --virtual-stages 2 --micro-batches 4|tp 1 x dp 1 (ep 1 inside) x pp 2|pipeline interleaved, 2 stages x 2 virtual, 4 micro-batches of 2 sequences, bubble 0.125"
    # the layout matrix: every layout above goes through the one engine (train_zero.h); these add
    # its sharded stages and compression under tensor and pipeline parallelism
    "tp2pp2dp2z1|8|--tp 2 --pp 2 --micro-batches 2 --zero 1|tp 2 x dp 2 (ep 1 inside) x pp 2|pipeline 1f1b, 2 stages x 1 virtual, 2 micro-batches of 2 sequences, bubble 0.500"
    "pp2ep2dp2z1|8|--pp 2 --ep 2 --micro-batches 2 --zero 1|tp 1 x dp 4 (ep 2 inside) x pp 2|pipeline 1f1b, 2 stages x 1 virtual, 2 micro-batches of 1 sequences, bubble 0.500"
    "pp2ildp2z3|4|--pp 2 --pp-schedule interleaved --virtual-stages 2 --micro-batches 2 --zero 3|tp 1 x dp 2 (ep 1 inside) x pp 2|pipeline interleaved, 2 stages x 2 virtual, 2 micro-batches of 2 sequences"
    "tp2ep2z2|4|--tp 2 --ep 2 --zero 2|tp 2 x dp 2 (ep 2 inside) x pp 1|pipeline 1f1b, 1 stage x 1 virtual"
)
for spec in "${LAYOUTS[@]}"; do
    IFS='|' read -r name n flags grid sched <<<"$spec"
    # shellcheck disable=SC2086
    run "$name" "${TINY[@]}" --steps 30 --nproc "$n" $flags --log "$work/$name.jsonl" --ckpt-dir "$work/ck_$name" --sample-len 40 \
        "${REC[@]}"
    what="$n ranks as $name ($flags) match 1 rank over 30 steps: loss every step and weights at the end within 1e-5"
    what="$what (moments 1e-4), the same 40-token sample"
    if [ "$(rc one)" -ne 0 ] || [ "$(rc "$name")" -ne 0 ]; then
        bad "$what" "exit $(rc one)/$(rc "$name")" "$(grep -E 'rank|error' "$work/$name.out" | tail -3)"
        continue
    fi
    loss=$(compare_losses one "$name" 30)
    read -r pmax pmax_at pl2 pl2_at _ < <($PY tests/par_ckpt_compare.py "$work/ck_one" "$work/ck_$name" 2>&1)
    read -r _ _ ml2 ml2_at _ < <($PY tests/par_ckpt_compare.py "$work/ck_one" "$work/ck_$name" --moments 2>&1)
    if within "$loss" 1e-5 && within "${pl2:-x}" 1e-5 && within "${ml2:-x}" 1e-4 && grep -qF "rank grid: $grid" "$work/$name.out" &&
       grep -qF "$sched" "$work/$name.out" && [ -n "$(sample one)" ] && [ "$(sample one)" = "$(sample "$name")" ]; then
        ok "$what (loss $loss; weights: L2 $pl2 in $pl2_at, largest element difference / largest element $pmax in $pmax_at; moments L2 $ml2)"
    else
        bad "$what" "loss $loss, weights ${pmax:-?} ${pmax_at:-} ${pl2:-?} ${pl2_at:-}, moments ${ml2:-?} ${ml2_at:-}" \
            "sample: $(sample "$name" | tr '\n' ' ' | cut -c1-100)" \
            "$(grep -E 'rank grid|parallel model' "$work/$name.out" | head -2)"
    fi
done

# The same through the data/expert-parallel path (no --tp/--pp, the grid's groups): dp4 with ep2
# saves each expert shard once (its two replicas once both wrote it: overlapping pieces).
run dp4ep2 "${TINY[@]}" --steps 30 --nproc 4 --ep 2 --ckpt-dir "$work/ck_dp4ep2" "${REC[@]}"
read -r pmax pmax_at pl2 pl2_at _ < <($PY tests/par_ckpt_compare.py "$work/ck_one" "$work/ck_dp4ep2" 2>&1)
if [ "$(rc dp4ep2)" -eq 0 ] && within "${pl2:-x}" 1e-5; then
    ok "4 ranks as dp4 x ep2 save a checkpoint whose weights match 1 rank's within 1e-5 (L2 $pl2, largest element $pmax)"
else
    bad "4 ranks as dp4 x ep2 save a checkpoint matching 1 rank" "exit $(rc dp4ep2), ${pmax:-?} ${pl2:-?}" \
        "$(grep -E 'rank|error' "$work/dp4ep2.out" | tail -2)"
fi

# ---- 1b. bf16 and fp16 (train_par.h runs the one-rank model's ops in its dtypes)
# pp2 with one micro-batch runs every op of one rank on the same rows (the residual add folded
# into the row-parallel GEMM as one rank does, the residual stream sent in the compute dtype),
# so in bf16 and in fp16 (its MoE layers in f32, dynamic loss scaling) every logged number
# equals one rank's bit for bit: loss, gradient norm, loss scale, skip flag, validation loss.
fields() { # the logged numbers of a run, one line per record
    $PYS - "$work/$1.jsonl" <<'PYEOF'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    if r["type"] == "step":
        print("step", r["step"], repr(r["loss"]), repr(r["grad_norm"]), repr(r["loss_scale"]), r["skipped"])
    elif r["type"] == "val": print("val", r["step"], repr(r["val_loss"]))
PYEOF
}
for dt in bf16 fp16; do
    run "one_$dt" "${TINY[@]}" --steps 30 --dtype $dt --log "$work/one_$dt.jsonl" --ckpt-dir "$work/ck_one_$dt" \
        --routing-record "$work/routes_$dt.bin"
    run "pp2m1_$dt" "${TINY[@]}" --steps 30 --dtype $dt --nproc 2 --pp 2 --log "$work/pp2m1_$dt.jsonl" \
        --routing-replay "$work/routes_$dt.bin"
    a=$(fields "one_$dt"); b=$(fields "pp2m1_$dt")
    what="--dtype $dt: 2 ranks as pp2 (one micro-batch) log every step and validation of 1 rank bit for bit"
    if [ "$(rc "one_$dt")" -eq 0 ] && [ "$(rc "pp2m1_$dt")" -eq 0 ] && [ "$(echo "$a" | grep -c '^step')" -eq 30 ] &&
       [ "$a" = "$b" ]; then
        scales=$(echo "$a" | awk '$1 == "step" { print $5 }' | sort -u | tr '\n' ' ')
        ok "$what (loss scales ${scales}skipped $(echo "$a" | awk '$1 == "step" { s += $6 } END { print s + 0 }'))"
    else
        bad "$what" "exit $(rc "one_$dt")/$(rc "pp2m1_$dt")" "$(diff <(echo "$a") <(echo "$b") | head -4)" \
            "$(grep -E 'rank|error' "$work/pp2m1_$dt.out" | tail -2)"
    fi
done

# --ep-overlap: the expert exchanges travelling beside what does not wait on them, and with chunked, the
# experts starting on a rank's own rows first (dsk_moe's ep_overlap, ep_chunk): every logged number is the serial
# run's, bit for bit (dp2 x ep2 in bf16 with the exact and the bounded exchange, and tp2 x dp2 x ep2 with its two
# trainers' MoE calls).
for spec in "dp2ep2|--nproc 2 --ep 2 --dtype bf16" "dp2ep2b|--nproc 2 --ep 2 --dtype bf16 --ep-exchange bounded" \
    "tp2ep2|--nproc 4 --tp 2 --ep 2"; do
    name=${spec%%|*}
    for ov in off on chunked; do
        # shellcheck disable=SC2086
        run "ov_${name}_$ov" "${TINY[@]}" --steps 8 ${spec#*|} --ep-overlap $ov --log "$work/ov_${name}_$ov.jsonl"
    done
    a=$(fields "ov_${name}_off")
    what="--ep-overlap on and chunked, ${spec#*|}: every logged number equals the serial exchange's bit for bit"
    if [ "$(rc "ov_${name}_off")$(rc "ov_${name}_on")$(rc "ov_${name}_chunked")" = 000 ] &&
       [ "$(echo "$a" | grep -c '^step')" -eq 8 ] && [ "$a" = "$(fields "ov_${name}_on")" ] &&
       [ "$a" = "$(fields "ov_${name}_chunked")" ]; then
        ok "$what"
    else
        bad "$what" "exit $(rc "ov_${name}_off")/$(rc "ov_${name}_on")/$(rc "ov_${name}_chunked")" \
            "$(diff <(echo "$a") <(fields "ov_${name}_chunked") | head -4)"
    fi
done

# --pair-micro-batches: each steady forward runs with the backward after it, interleaved at the MoE layers (one
# micro-batch's expert exchange, dispatch or return, on its thread while the other computes;
# dsk_par_schedule_init_paired): every logged number is the unpaired schedule's bit for bit, exchanges did travel
# beside the other micro-batch (ep_paired_exchanges, rank 0's), and on one stage it logs --accum's step numbers. With 7 layers the interleaved
# last stage's chunk is the shorter of its two, so its forward reaches the head while the pair's backward is still
# in a block: the head (the MTP module's backward) must keep to its own running gradient, and the module's MoE
# layer must wait for the backward's exchange in flight (each fault fails the case).
paired() { # the step records' ep_paired_exchanges summed
    $PYS -c "import json, sys; print(sum(r.get('ep_paired_exchanges', 0) for r in map(json.loads, open(sys.argv[1])) if r['type'] == 'step'))" "$work/$1.jsonl" 2>/dev/null
}
for spec in "pp2ep2|--nproc 4 --pp 2 --ep 2 --micro-batches 4 --dtype bf16 --ep-overlap on" \
            "ipp2ep2z2|--nproc 4 --pp 2 --pp-schedule interleaved --virtual-stages 2 --ep 2 --micro-batches 4 --zero 2 --dtype fp16 --ep-overlap chunked" \
            "ipp2ep2mtp|--nproc 4 --pp 2 --pp-schedule interleaved --virtual-stages 2 --ep 2 --micro-batches 4 --layers 7 --mtp 1 --mtp-ffn moe --ep-overlap on" \
            "tp2pp2mla|--nproc 4 --tp 2 --pp 2 --micro-batches 4 --recompute attn --attn mla --q-lora-rank 16 --kv-lora-rank 16 --qk-nope-dim 8 --qk-rope-dim 4 --v-head-dim 8"; do
    name=${spec%%|*}
    # shellcheck disable=SC2086
    run "pair_${name}_0" "${TINY[@]}" --steps 6 ${spec#*|} --log "$work/pair_${name}_0.jsonl"
    # shellcheck disable=SC2086
    run "pair_${name}_1" "${TINY[@]}" --steps 6 ${spec#*|} --pair-micro-batches --log "$work/pair_${name}_1.jsonl"
    a=$(fields "pair_${name}_0")
    n=$(paired "pair_${name}_1")
    what="--pair-micro-batches, ${spec#*|}: every logged number equals the unpaired run's bit for bit ($n exchanges paired)"
    if [ "$(rc "pair_${name}_0")$(rc "pair_${name}_1")" = 00 ] && [ "$(echo "$a" | grep -c '^step')" -eq 6 ] &&
       [ "$a" = "$(fields "pair_${name}_1")" ] && [ "${n:-0}" -gt 0 ]; then
        ok "$what"
    else
        bad "$what" "exit $(rc "pair_${name}_0")/$(rc "pair_${name}_1")" \
            "$(diff <(echo "$a") <(fields "pair_${name}_1") | head -4)"
    fi
done
run pair_acc "${TINY[@]}" --steps 6 --nproc 2 --ep 2 --batch 4 --accum 2 --dtype bf16 --ep-overlap on --log "$work/pair_acc.jsonl"
run pair_pp1 "${TINY[@]}" --steps 6 --nproc 2 --ep 2 --batch 8 --micro-batches 2 --pair-micro-batches --dtype bf16 \
    --ep-overlap on --log "$work/pair_pp1.jsonl"
a=$(fields pair_acc | grep '^step')
n=$(paired pair_pp1)
what="--pair-micro-batches on one stage, dp2 x ep2 in bf16, --micro-batches 2 logs --accum 2's steps bit for bit ($n exchanges"
what="$what paired: more than the pair's 6 MoE calls a step, 36, so returns travelled beside the other micro-batch too)"
if [ "$(rc pair_acc)$(rc pair_pp1)" = 00 ] && [ "$(echo "$a" | grep -c '^step')" -eq 6 ] &&
   [ "$a" = "$(fields pair_pp1 | grep '^step')" ] && [ "${n:-0}" -gt 36 ]; then
    ok "$what"
else
    bad "$what" "exit $(rc pair_acc)/$(rc pair_pp1)" "$(diff <(echo "$a") <(fields pair_pp1 | grep '^step') | head -4)"
fi

# Layouts in bf16 against one rank in bf16 over 30 steps, routing replayed from the bf16 record.
# Tensor parallelism rounds the row-parallel outputs' partial sums and then the residual add
# (one rank rounds once), and micro-batches sum the f32 weight gradients in another order, which
# the bf16 weight copies turn into whole bf16 steps on some elements: the curves part in low bits
# and training carries that on. The bound is derived in the test from bf16's own effect: one rank
# in f32 replaying the same routing is the trajectory without any bf16 rounding; a layout is
# another bf16 rounding of that trajectory of the same size, so by the triangle inequality its
# distance from one rank's bf16 run is at most twice one rank's bf16-to-f32 distance. Measured as
# the RMS over the 30 training losses of the relative difference (the max of 30 such numbers is
# noisier), and as the worst per-tensor relative L2 difference of the final weights. A layout that
# trains a part wrongly misses it (norm weights whose gradients never reach the optimizer: a loss
# RMS 35 times the bound; replicated weights' gradients not summed over tp: 1.6-2.4 times).
# The validation losses are left out: at this model they are not smooth in the weights. A change
# of rounding (a dot's summation order) moved one by 0.2% while every training loss moved by 1e-4
# and the weights by 0.014% in L2, and the mutant above moved it by the same 0.2%: it tells a
# rounding from a bug no better than chance. The f32 layouts above compare them within 1e-5, and
# pp2 in bf16 bit for bit.
run one_f32b "${TINY[@]}" --steps 30 --log "$work/one_f32b.jsonl" --ckpt-dir "$work/ck_one_f32b" \
    --routing-replay "$work/routes_bf16.bin"
loss_rms() { # RMS of the relative difference of the common training losses (at least $3), or an error
    $PYS - "$work/$1.jsonl" "$work/$2.jsonl" "$3" <<'EOF'
import json, math, sys
def rows(p):
    return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if r["type"] == "step"}
a, b = rows(sys.argv[1]), rows(sys.argv[2])
common = sorted(set(a) & set(b))
if len(common) < int(sys.argv[3]) or any(a[k] is None or b[k] is None for k in common):
    print("bad: %d common steps of %d and %d" % (len(common), len(a), len(b))); sys.exit()
print("%.3g" % math.sqrt(sum(((a[k] - b[k]) / a[k]) ** 2 for k in common) / len(common)))
EOF
}
d_loss=$( [ "$(rc one_bf16)" -eq 0 ] && [ "$(rc one_f32b)" -eq 0 ] && loss_rms one_bf16 one_f32b 30)
read -r _ _ d_w _ < <($PY tests/par_ckpt_compare.py "$work/ck_one_bf16" "$work/ck_one_f32b" 2>&1)
bound_loss=$($PYS -c "print('%.3g' % (2 * float('$d_loss')))" 2>/dev/null)
bound_w=$($PYS -c "print('%.3g' % (2 * float('${d_w:-x}')))" 2>/dev/null)
BF_LAYOUTS=(
    "tp2pp2_bf16|4|--tp 2 --pp 2 --micro-batches 2"
    "pp2il_bf16|2|--pp 2 --pp-schedule interleaved --virtual-stages 2 --micro-batches 4"
    "tp2_bf16|2|--tp 2"
    # the layout matrix in bf16, ZeRO-1 sharding the masters and moments: tp2 x pp2 x dp2, and
    # DeepSeek-V3's own layout in miniature (pipeline x expert x ZeRO-1 data parallel)
    "tp2pp2dp2z1_bf16|8|--tp 2 --pp 2 --micro-batches 2 --zero 1"
    "pp2ep2dp2z1_bf16|8|--pp 2 --ep 2 --micro-batches 2 --zero 1"
)
for spec in "${BF_LAYOUTS[@]}"; do
    IFS='|' read -r name n flags <<<"$spec"
    # shellcheck disable=SC2086
    run "$name" "${TINY[@]}" --steps 30 --dtype bf16 --nproc "$n" $flags --log "$work/$name.jsonl" \
        --ckpt-dir "$work/ck_$name" --routing-replay "$work/routes_bf16.bin"
    what="--dtype bf16: $n ranks as $flags match 1 rank in bf16 over 30 steps within twice bf16's own distance from f32"
    if [ -z "$bound_loss" ] || [ -z "$bound_w" ]; then
        bad "$what" "no bound: one rank bf16/f32 exit $(rc one_bf16)/$(rc one_f32b)," \
            "loss RMS '$d_loss', weights '${d_w:-}'"
        continue
    fi
    if [ "$(rc "$name")" -ne 0 ]; then
        bad "$what" "exit $(rc "$name")" "$(grep -E 'rank|error' "$work/$name.out" | tail -3)"
        continue
    fi
    loss=$(loss_rms one_bf16 "$name" 30)
    read -r _ _ pl2 pl2_at _ < <($PY tests/par_ckpt_compare.py "$work/ck_one_bf16" "$work/ck_$name" 2>&1)
    if within "$loss" "$bound_loss" && within "${pl2:-x}" "$bound_w" && grep -qF "CPU, bf16" "$work/$name.out"; then
        ok "$what (loss RMS $loss <= $bound_loss; weights L2 $pl2 in $pl2_at <= $bound_w)"
    else
        bad "$what" "loss RMS $loss (bound $bound_loss), weights L2 ${pl2:-?} in ${pl2_at:-?} (bound $bound_w)"
    fi
done

# ---- 1c. MLA with an MTP module (--attn mla --mtp 1) as tp2 x pp2 against one rank of its own, in
#      f32 and bf16: the heads split over tp (Wq_b and Wkv_b column-parallel, Wo row-parallel), the
#      latent down-projections and their norms replicated on the gathered input (train_par.h,
#      tp_mla_forward); the MTP module on the last stage, its embedding from the last stage's copy
#      of the table whose gradient sums with the first stage's (TP_G_EMBED).
#      Routing replayed from the MLA reference's own record. The latent ranks are 32 so that every
#      replicated parameter of a block starts on a row of the unit's checkpoint pieces: a piece of a
#      2-D parameter that starts or ends inside a row is several boxes under one name in a rank file,
#      which the engine's checkpoint writer refuses ("appears twice"; reported, not this layout's).
MLA=(--attn mla --q-lora-rank 32 --kv-lora-rank 32 --qk-nope-dim 6 --qk-rope-dim 4 --v-head-dim 8 --mtp 1)
run mla1 "${TINY[@]}" "${MLA[@]}" --steps 30 --log "$work/mla1.jsonl" --ckpt-dir "$work/ck_mla1" --sample-len 40 \
    --routing-record "$work/routes_mla.bin"
run mla4 "${TINY[@]}" "${MLA[@]}" --steps 30 --nproc 4 --tp 2 --pp 2 --micro-batches 2 --log "$work/mla4.jsonl" \
    --ckpt-dir "$work/ck_mla4" --sample-len 40 --routing-replay "$work/routes_mla.bin"
what="--attn mla --mtp 1: 4 ranks as tp2 x pp2 match 1 rank over 30 steps: loss every step and weights within 1e-5"
what="$what (moments 1e-4), the same 40-token sample"
if [ "$(rc mla1)" -ne 0 ] || [ "$(rc mla4)" -ne 0 ]; then
    bad "$what" "exit $(rc mla1)/$(rc mla4)" "$(grep -E 'rank|error' "$work/mla4.out" | tail -3)"
else
    loss=$(compare_losses mla1 mla4 33)
    read -r pmax pmax_at pl2 pl2_at _ < <($PY tests/par_ckpt_compare.py "$work/ck_mla1" "$work/ck_mla4" 2>&1)
    read -r _ _ ml2 ml2_at _ < <($PY tests/par_ckpt_compare.py "$work/ck_mla1" "$work/ck_mla4" --moments 2>&1)
    if within "$loss" 1e-5 && within "${pl2:-x}" 1e-5 && within "${ml2:-x}" 1e-4 && [ -n "$(sample mla1)" ] &&
       [ "$(sample mla1)" = "$(sample mla4)" ]; then
        ok "$what (loss $loss; weights: L2 $pl2 in $pl2_at, largest element $pmax in $pmax_at; moments L2 $ml2)"
    else
        bad "$what" "loss $loss, weights ${pmax:-?} ${pmax_at:-} ${pl2:-?} ${pl2_at:-}, moments ${ml2:-?} ${ml2_at:-}" \
            "sample: $(sample mla4 | tr '\n' ' ' | cut -c1-100)"
    fi
fi
# a one-rank checkpoint of this model resumes as tp2 x pp2: the first stage's embedding and the last
# stage's copy both load their box of the one table
run mla1_first "${TINY[@]}" "${MLA[@]}" --steps 30 --ckpt-dir "$work/ck_mla_of" --stop-at 15 \
    --routing-replay "$work/routes_mla.bin"
run mla4_res "${TINY[@]}" "${MLA[@]}" --steps 30 --nproc 4 --tp 2 --pp 2 --micro-batches 2 \
    --ckpt-dir "$work/ck_mla_of" --resume --log "$work/mla4_res.jsonl" --routing-replay "$work/routes_mla.bin"
loss=$( [ "$(rc mla1)" -eq 0 ] && [ "$(rc mla4_res)" -eq 0 ] && compare_losses mla1 mla4_res 15)
what="--attn mla --mtp 1: a one-rank checkpoint at step 15 resumes as tp2 x pp2 and steps 16-30 match one rank"
if [ "$(rc mla1_first)" -eq 0 ] && within "$loss" 1e-5 && grep -q "resume: step 15 " "$work/mla4_res.out"; then
    ok "$what within 1e-5 (worst $loss)"
else
    bad "$what" "exit $(rc mla1_first)/$(rc mla4_res), loss $loss" \
        "$(grep -E 'rank|error' "$work/mla4_res.out" | tail -2)"
fi
# bf16: pp2 with one micro-batch runs one rank's ops on the same rows (the MTP module's embedding
# gradient reaches the table from the last stage's copy: an f32 sum of the two parts, which here
# equals one rank's), so it logs one rank's numbers bit for bit; tp2 x pp2 within the bound
# derived as for the layouts above from this model's own bf16-to-f32 distance, over 10 steps: this
# model's bf16 trajectories part faster than the MHA model's (under DSK_CPU_ISA=avx2 even pp2 with
# two micro-batches, which runs no tensor-parallel code, is 6.3e-4 from one rank after 30 steps
# against a bf16-to-f32 distance of 1.7e-4, and 1.0e-4 against 1.3e-4 after 10), so the triangle
# bound is taken before that growth
run mla1_bf16 "${TINY[@]}" "${MLA[@]}" --steps 10 --dtype bf16 --log "$work/mla1_bf16.jsonl" \
    --ckpt-dir "$work/ck_mla1_bf16" --routing-record "$work/routes_mla_bf16.bin"
run mla2_bf16 "${TINY[@]}" "${MLA[@]}" --steps 10 --dtype bf16 --nproc 2 --pp 2 --log "$work/mla2_bf16.jsonl" \
    --routing-replay "$work/routes_mla_bf16.bin"
a=$(fields mla1_bf16); b=$(fields mla2_bf16)
what="--attn mla --mtp 1 --dtype bf16: 2 ranks as pp2 (one micro-batch) log every step and validation of 1 rank"
if [ "$(rc mla1_bf16)" -eq 0 ] && [ "$(rc mla2_bf16)" -eq 0 ] && [ "$(echo "$a" | grep -c '^step')" -eq 10 ] &&
   [ "$a" = "$b" ]; then
    ok "$what bit for bit"
else
    bad "$what bit for bit" "exit $(rc mla1_bf16)/$(rc mla2_bf16)" "$(diff <(echo "$a") <(echo "$b") | head -4)"
fi
run mla1_f32b "${TINY[@]}" "${MLA[@]}" --steps 10 --log "$work/mla1_f32b.jsonl" --ckpt-dir "$work/ck_mla1_f32b" \
    --routing-replay "$work/routes_mla_bf16.bin"
run mla4_bf16 "${TINY[@]}" "${MLA[@]}" --steps 10 --dtype bf16 --nproc 4 --tp 2 --pp 2 --micro-batches 2 \
    --log "$work/mla4_bf16.jsonl" --ckpt-dir "$work/ck_mla4_bf16" --routing-replay "$work/routes_mla_bf16.bin"
what="--attn mla --mtp 1 --dtype bf16: 4 ranks as tp2 x pp2 match 1 rank in bf16 over 10 steps within twice bf16's own"
what="$what distance from f32"
if [ "$(rc mla1_bf16)" -ne 0 ] || [ "$(rc mla1_f32b)" -ne 0 ] || [ "$(rc mla4_bf16)" -ne 0 ]; then
    bad "$what" "exit $(rc mla1_bf16)/$(rc mla1_f32b)/$(rc mla4_bf16)" \
        "$(grep -E 'rank|error' "$work/mla4_bf16.out" | tail -3)"
else
    d_loss=$(loss_rms mla1_bf16 mla1_f32b 10)
    read -r _ _ d_w _ < <($PY tests/par_ckpt_compare.py "$work/ck_mla1_bf16" "$work/ck_mla1_f32b" 2>&1)
    b_loss=$($PYS -c "print('%.3g' % (2 * float('$d_loss')))" 2>/dev/null)
    b_w=$($PYS -c "print('%.3g' % (2 * float('${d_w:-x}')))" 2>/dev/null)
    loss=$(loss_rms mla1_bf16 mla4_bf16 10)
    read -r _ _ pl2 pl2_at _ < <($PY tests/par_ckpt_compare.py "$work/ck_mla1_bf16" "$work/ck_mla4_bf16" 2>&1)
    if [ -n "$b_loss" ] && [ -n "$b_w" ] && within "$loss" "$b_loss" && within "${pl2:-x}" "$b_w"; then
        ok "$what (loss RMS $loss <= $b_loss; weights L2 $pl2 in $pl2_at <= $b_w)"
    else
        bad "$what" "loss RMS $loss (bound '$b_loss'), weights L2 ${pl2:-?} in ${pl2_at:-?} (bound '$b_w')"
    fi
fi

# MHA with two MTP modules whose FFNs are MoE layers (DeepSeek-V3's MTP layer): the second takes
# the first's output, each MoE block routes (replayed) and keeps its expert bias; the one-rank
# reference also checks that its checkpoint holds every MoE layer's bias (more than --layers)
MTPM=(--mtp 2 --mtp-ffn moe)
run mtpm1 "${TINY[@]}" "${MTPM[@]}" --steps 30 --log "$work/mtpm1.jsonl" --ckpt-dir "$work/ck_mtpm1" \
    --routing-record "$work/routes_mtpm.bin"
run mtpm4 "${TINY[@]}" "${MTPM[@]}" --steps 30 --nproc 4 --tp 2 --pp 2 --micro-batches 2 --log "$work/mtpm4.jsonl" \
    --ckpt-dir "$work/ck_mtpm4" --routing-replay "$work/routes_mtpm.bin"
what="--mtp 2 --mtp-ffn moe: 4 ranks as tp2 x pp2 match 1 rank over 30 steps: loss every step and weights within"
what="$what 1e-5 (moments 1e-4)"
if [ "$(rc mtpm1)" -ne 0 ] || [ "$(rc mtpm4)" -ne 0 ]; then
    bad "$what" "exit $(rc mtpm1)/$(rc mtpm4)" \
        "$(grep -E 'rank|error|free' "$work/mtpm1.out" "$work/mtpm4.out" | tail -3)"
else
    loss=$(compare_losses mtpm1 mtpm4 33)
    read -r pmax pmax_at pl2 pl2_at _ < <($PY tests/par_ckpt_compare.py "$work/ck_mtpm1" "$work/ck_mtpm4" 2>&1)
    read -r _ _ ml2 ml2_at _ < <($PY tests/par_ckpt_compare.py "$work/ck_mtpm1" "$work/ck_mtpm4" --moments 2>&1)
    if within "$loss" 1e-5 && within "${pl2:-x}" 1e-5 && within "${ml2:-x}" 1e-4; then
        ok "$what (loss $loss; weights: L2 $pl2 in $pl2_at, largest element $pmax in $pmax_at; moments L2 $ml2)"
    else
        bad "$what" "loss $loss, weights ${pmax:-?} ${pmax_at:-} ${pl2:-?} ${pl2_at:-}, moments ${ml2:-?} ${ml2_at:-}"
    fi
fi
# the same model as pp2 x dp2 at --zero 2 and 3: the first stage's embedding and the last stage's
# copy reduce as one group; at ZeRO-3 that pair keeps whole weights (a per-forward gather of the
# two would wait on each other across the pipeline), the rest gathers per unit
for z in 2 3; do
    run mtpm_z$z "${TINY[@]}" "${MTPM[@]}" --steps 30 --nproc 4 --pp 2 --micro-batches 2 --zero $z \
        --log "$work/mtpm_z$z.jsonl" --ckpt-dir "$work/ck_mtpm_z$z" --routing-replay "$work/routes_mtpm.bin"
    what="--mtp 2 --mtp-ffn moe: pp2 x dp2 at --zero $z matches 1 rank over 30 steps: loss every step and weights"
    what="$what within 1e-5"
    if [ "$(rc mtpm1)" -ne 0 ] || [ "$(rc mtpm_z$z)" -ne 0 ]; then
        bad "$what" "exit $(rc mtpm1)/$(rc mtpm_z$z)" "$(grep -E 'rank|error' "$work/mtpm_z$z.out" | tail -3)"
    else
        loss=$(compare_losses mtpm1 mtpm_z$z 33)
        read -r pmax pmax_at pl2 pl2_at _ < <($PY tests/par_ckpt_compare.py "$work/ck_mtpm1" "$work/ck_mtpm_z$z" 2>&1)
        if within "$loss" 1e-5 && within "${pl2:-x}" 1e-5; then
            ok "$what (loss $loss; weights: L2 $pl2 in $pl2_at, largest element $pmax in $pmax_at)"
        else
            bad "$what" "loss $loss, weights ${pmax:-?} ${pmax_at:-} ${pl2:-?} ${pl2_at:-}"
        fi
    fi
done

# fp16 with a skipped step: at --init-std 1.0 the scaled gradients of the first steps overflow
# f16 (tp2 x pp2 skipped steps 1, 2, 5 and 7 of 8; also tp2 x ep2 at ZeRO-2, where each rank holds only
# its shard of the gradients when the decision is taken). Every rank must take the one decision:
# the log flags the step skipped, the next step runs at half the loss scale (an applied step
# keeps it: growth comes after 2000), every rank's metrics count the same skipped steps and end
# at the same scale, and a skipped step k >= 2 leaves every rank's weights, moments and expert
# biases as step k - 1 did (checkpoints after every step, assembled from all ranks' boxes).
for spec in "skip16|--tp 2 --pp 2 --micro-batches 2" "skip16z2|--tp 2 --ep 2 --zero 2"; do
IFS='|' read -r sk flags <<<"$spec"
# shellcheck disable=SC2086
run $sk "${TINY[@]}" --steps 8 --dtype fp16 --init-std 1.0 --nproc 4 $flags \
    --log "$work/$sk.jsonl" --ckpt-dir "$work/ck_$sk" --ckpt-every 1 --metrics "$work/$sk.prom"
what="--dtype fp16 as $flags: an overflowing step is skipped on every rank and the loss scale halves"
if [ "$(rc $sk)" -ne 0 ]; then
    bad "$what" "exit $(rc $sk)" "$(grep -E 'rank|error' "$work/$sk.out" | tail -3)"
else
    read -r verdict k n_skip last_scale <<<"$($PYS - "$work/$sk.jsonl" <<'EOF'
import json, sys
r = [x for x in map(json.loads, open(sys.argv[1])) if x["type"] == "step"]
good = len(r) == 8 and any(x["skipped"] for x in r) and not all(x["skipped"] for x in r)
for a, b in zip(r, r[1:]):
    good = good and b["loss_scale"] == (a["loss_scale"] / 2 if a["skipped"] else a["loss_scale"])
k = next((x["step"] for x in r if x["skipped"] and x["step"] >= 2), 0)
print("ok" if good and k else "bad", k, sum(x["skipped"] for x in r), "%g" % r[-1]["loss_scale"] if r else "-")
EOF
)"
    ranks_agree=1
    for f in "$work/$sk.prom" "$work/$sk".rank{1,2,3}.prom; do
        grep -qE "^dsk_train_skipped_steps_total\{rank=\"[0-3]\"\} ${n_skip:-x}$" "$f" 2>/dev/null &&
            grep -qE "^dsk_train_loss_scale\{rank=\"[0-3]\"\} ${last_scale:-x}$" "$f" || ranks_agree=0
    done
    same=x
    if [ "${k:-0}" -ge 2 ]; then
        mkdir -p "$work/skip_before_$sk" "$work/skip_at_$sk"
        ln -s "$work/ck_$sk/$(printf 'step_%08d' $((k - 1)))" "$work/skip_before_$sk/"
        ln -s "$work/ck_$sk/$(printf 'step_%08d' "$k")" "$work/skip_at_$sk/"
        same=$($PY tests/par_ckpt_compare.py "$work/skip_before_$sk" "$work/skip_at_$sk" --moments 2>&1)
    fi
    if [ "$verdict" = ok ] && [ "$ranks_agree" = 1 ] && [ "$same" = "0 - 0 - 156" ]; then
        what="$what ($n_skip of 8 steps skipped, final scale $last_scale; step $k left weights, moments and biases"
        ok "$what as step $((k - 1)))"
    else
        bad "$what" "log: $verdict, first skip at step >= 2: ${k:-?}, skipped ${n_skip:-?}," \
            "final scale ${last_scale:-?};" \
            "every rank's metrics agree: $ranks_agree; checkpoints $((${k:-1} - 1)) and ${k:-?}: $same" \
            "$(grep -h -E 'skipped_steps_total\{|loss_scale\{' "$work/$sk"*.prom 2>/dev/null | tr '\n' ' ')"
    fi
fi
done

# ---- 2. checkpoints across layouts: every layout and ZeRO stage saves boxes of the full tensors
#      under their names, so any reads any other. Saved as tp2 x pp2 x ZeRO-1 at step 15, resumed
#      as one rank and as dp4; saved as dp4 x ZeRO-3, resumed as tp2 x dp2 x ZeRO-1; saved by one
#      rank, resumed as pp2 x ep2 x ZeRO-1 (DeepSeek-V3's layout): steps 16-30 and the final
#      weights match the run that did not stop, within 1e-5 (another summation order).
resume_case() { # SRC_NAME SRC_N SRC_FLAGS DST_NAME DST_N DST_FLAGS
    local sname=$1 sn=$2 sflags=$3 dname=$4 dn=$5 dflags=$6
    # shellcheck disable=SC2086
    [ -e "$work/straight_$sname.rc" ] || run "straight_$sname" "${TINY[@]}" --steps 30 --nproc "$sn" $sflags \
        --ckpt-dir "$work/ck_s_$sname" --log "$work/straight_$sname.jsonl" "${REC[@]}"
    # shellcheck disable=SC2086
    [ -e "$work/first_$sname.rc" ] || run "first_$sname" "${TINY[@]}" --steps 30 --nproc "$sn" $sflags \
        --ckpt-dir "$work/ck_f_$sname" --stop-at 15 "${REC[@]}"
    rm -rf "$work/ck_$dname.r"
    cp -r "$work/ck_f_$sname" "$work/ck_$dname.r"
    # shellcheck disable=SC2086
    run "res_$dname" "${TINY[@]}" --steps 30 --nproc "$dn" $dflags --ckpt-dir "$work/ck_$dname.r" --resume \
        --log "$work/res_$dname.jsonl" "${REC[@]}"
    local what="a checkpoint saved as $sname at step 15 resumes as $dname; steps 16-30 and the final weights match the"
    what="$what $sname run within 1e-5"
    if [ "$(rc "straight_$sname")" -ne 0 ] || [ "$(rc "first_$sname")" -ne 0 ] || [ "$(rc "res_$dname")" -ne 0 ]; then
        bad "$what" "exit $(rc "straight_$sname")/$(rc "first_$sname")/$(rc "res_$dname")" \
            "$(grep -E 'rank|error' "$work/res_$dname.out" | tail -3)"
        return
    fi
    local loss pmax pl2 pl2_at first_step
    loss=$(compare_losses "straight_$sname" "res_$dname" 15)
    read -r pmax _ pl2 pl2_at _ < <($PY tests/par_ckpt_compare.py "$work/ck_s_$sname" "$work/ck_$dname.r" 2>&1)
    first_step=$($PYS -c "import json; print(min(r['step'] for r in map(json.loads, open('$work/res_$dname.jsonl')) if r['type'] == 'step'))" 2>&1)
    if [ "$first_step" = 16 ] && grep -q "resume: step 15 " "$work/res_$dname.out" && within "$loss" 1e-5 &&
       within "${pl2:-x}" 1e-5; then
        ok "$what (loss $loss; parameters: L2 $pl2, largest element $pmax)"
    else
        bad "$what" "first step $first_step, loss $loss, parameters ${pmax:-?} ${pl2:-?} ${pl2_at:-}" \
            "$(grep -E 'resume|error' "$work/res_$dname.out" | head -3)"
    fi
}
resume_case tp2pp2z1 4 "--tp 2 --pp 2 --micro-batches 2 --zero 1" one_rank 1 ""
resume_case tp2pp2z1 4 "--tp 2 --pp 2 --micro-batches 2 --zero 1" dp4 4 ""
resume_case dp4z3 4 "--zero 3" tp2dp2z1 4 "--tp 2 --zero 1"
resume_case one 1 "" pp2ep2dp2z1 8 "--pp 2 --ep 2 --micro-batches 2 --zero 1"

# The sections from here to the recompute check (DualPipeV, the emulated GPU, the objective, PowerSGD) and
# those after it (memory, a killed rank, bad input) test no CPU kernel: run_tests.sh re-runs this
# script under each other ISA with ISA_RERUN=1, which keeps only the numeric comparisons.
if [ -z "${ISA_RERUN:-}" ]; then
# --pp-schedule dualpipev (DeepSeek's DualPipeV: rank r holds stages r and 2 pp - 1 - r, chunk 1 runs back up the
# ranks and the turn at the last rank hands over in memory): the same stages' layers as interleaved with 2 virtual
# stages, each chunk's forwards and backwards in micro-batch order, so every logged number, the validation and the
# sample equal the interleaved run's bit for bit; unpaired at pp2 (f32) and pp4 (8 layers, 8 micro-batches), paired
# as pp2 x ep2 at ZeRO-1 in bf16 with the exchanges overlapped, with tensor parallelism and full recomputation
# (tp2 x pp2), and at ZeRO-3 with FP8 GEMMs (dp2 x pp2); at pp2 its pipeline sends are 2/3 of interleaved's (the
# turn sends nothing).
pp_bytes() { # the step records' pp_send_bytes of the first step
    $PYS -c "import json, sys; print([r for r in map(json.loads, open(sys.argv[1])) if r['type'] == 'step'][0]['pp_send_bytes'])" "$work/$1.jsonl" 2>/dev/null
}
for spec in "pp2|--nproc 2 --pp 2 --micro-batches 4 --sample-len 40" \
            "pp4|--nproc 4 --pp 4 --layers 8 --micro-batches 8" \
            "pp2ep2|--nproc 4 --pp 2 --ep 2 --micro-batches 4 --zero 1 --dtype bf16 --ep-overlap on --pair-micro-batches" \
            "tp2pp2|--nproc 4 --tp 2 --pp 2 --micro-batches 4 --recompute full" \
            "dp2pp2|--nproc 4 --pp 2 --micro-batches 4 --zero 3 --dtype fp8"; do
    name=${spec%%|*}
    # shellcheck disable=SC2086
    run "dpv_${name}_il" "${TINY[@]}" --steps 6 ${spec#*|} --pp-schedule interleaved --virtual-stages 2 \
        --log "$work/dpv_${name}_il.jsonl"
    # shellcheck disable=SC2086
    run "dpv_${name}_v" "${TINY[@]}" --steps 6 ${spec#*|} --pp-schedule dualpipev --log "$work/dpv_${name}_v.jsonl"
    a=$(fields "dpv_${name}_il")
    bi=$(pp_bytes "dpv_${name}_il") bv=$(pp_bytes "dpv_${name}_v")
    what="--pp-schedule dualpipev, ${spec#*|}: every logged number and the sample equal interleaved's bit for bit"
    what="$what (pipeline sends $bv against $bi bytes a step)"
    if [ "$(rc "dpv_${name}_il")$(rc "dpv_${name}_v")" = 00 ] && [ "$(echo "$a" | grep -c '^step')" -eq 6 ] &&
       [ "$a" = "$(fields "dpv_${name}_v")" ] && [ "$(sample "dpv_${name}_il")" = "$(sample "dpv_${name}_v")" ] &&
       grep -qF 'pipeline dualpipev' "$work/dpv_${name}_v.out" &&
       { [ "$name" != pp2 ] || [ "$((3 * ${bv:-0}))" -eq "$((2 * ${bi:-1}))" ]; }; then
        ok "$what"
    else
        bad "$what" "exit $(rc "dpv_${name}_il")/$(rc "dpv_${name}_v")" \
            "$(diff <(echo "$a") <(fields "dpv_${name}_v") | head -4)"
    fi
done
# With an MTP module the V holds the last stage beside the embedding, so the embedding's two gradients add on one
# rank micro-batch by micro-batch instead of as two sums across the embedding group: another order, within 1e-5
# (routing replayed from one rank's record, so that no near-tie decides).
run dpv_mtp_one "${TINY[@]}" --steps 6 --mtp 1 --routing-record "$work/dpv_routes.bin"
for kind in interleaved dualpipev; do
    run "dpv_mtp_$kind" "${TINY[@]}" --steps 6 --nproc 2 --pp 2 --micro-batches 4 --mtp 1 --pp-schedule "$kind" \
        --virtual-stages 2 --routing-replay "$work/dpv_routes.bin" --log "$work/dpv_mtp_$kind.jsonl"
done
loss=$( [ "$(rc dpv_mtp_one)$(rc dpv_mtp_interleaved)$(rc dpv_mtp_dualpipev)" = 000 ] &&
       compare_losses dpv_mtp_interleaved dpv_mtp_dualpipev 6)
what="--pp-schedule dualpipev --mtp 1 as pp2 (the MTP module beside the embedding) logs interleaved's losses within 1e-5"
if within "$loss" 1e-5; then ok "$what (worst $loss)"
else bad "$what" "exit $(rc dpv_mtp_one)/$(rc dpv_mtp_interleaved)/$(rc dpv_mtp_dualpipev), loss $loss"; fi

# ---- the CUDA path on the emulated GPU (tests/cuda_emu: CUDA, cuBLAS and NCCL on the CPU): tp2 x pp2
#      over the nccl backend (device buffers in every mapping, send and receive) matches one emulated GPU,
#      in f32 and in bf16
EMU_BIN=$BUILD/emu/examples/train_moe
if [ "${EMULATE:-1}" = 0 ]; then
    echo "skip tp2 x pp2 on the emulated GPU: not built (EMULATE=0)"; skipped=$((skipped + 1))
elif ! make --no-print-directory -s BUILD="$BUILD" "$EMU_BIN" >"$work/emu_build.log" 2>&1; then
    bad "build $EMU_BIN" "$(tail -3 "$work/emu_build.log")"
else
    ES=4 # steps of each emulated run: the emulator runs every CUDA thread as a fiber, about 0.45 s a step here
    EMU=(--steps $ES --device cuda --dtype f32)
    timeout 300 "$EMU_BIN" "${TINY[@]}" "${EMU[@]}" --log "$work/emu1.jsonl" --routing-record "$work/emu_routes.bin" \
        >"$work/emu1.out" 2>&1; e1=$?
    timeout 300 "$EMU_BIN" "${TINY[@]}" "${EMU[@]}" --nproc 4 --tp 2 --pp 2 --micro-batches 2 --log "$work/emu4.jsonl" \
        --routing-replay "$work/emu_routes.bin" >"$work/emu4.out" 2>&1; e4=$?
    loss=$( [ $e1 -eq 0 ] && [ $e4 -eq 0 ] && compare_losses emu1 emu4 $ES)
    if within "$loss" 1e-5 && grep -q "4 ranks (expert parallel 1), CUDA, f32" "$work/emu4.out"; then
        ok "tp2 x pp2 on the emulated GPU (nccl backend) matches one emulated GPU over $ES steps within 1e-5 (worst $loss)"
    else
        bad "tp2 x pp2 on the emulated GPU matches one emulated GPU" "exit $e1/$e4, loss $loss" "$(grep -E 'rank|error' "$work/emu4.out" | tail -3)"
    fi
    # --pp-schedule dualpipev over nccl (the turn's hand-over in device memory): interleaved's numbers bit for bit
    for kind in interleaved dualpipev; do
        timeout 300 "$EMU_BIN" "${TINY[@]}" "${EMU[@]}" --nproc 2 --pp 2 --micro-batches 4 --pp-schedule "$kind" \
            --virtual-stages 2 --log "$work/emuv_$kind.jsonl" >"$work/emuv_$kind.out" 2>&1
        echo $? >"$work/emuv_$kind.rc"
    done
    a=$(fields emuv_interleaved)
    what="--pp-schedule dualpipev as pp2 on the emulated GPU logs interleaved's numbers bit for bit"
    if [ "$(rc emuv_interleaved)$(rc emuv_dualpipev)" = 00 ] && [ "$(echo "$a" | grep -c '^step')" -eq $ES ] &&
       [ "$a" = "$(fields emuv_dualpipev)" ] && grep -q "pipeline dualpipev" "$work/emuv_dualpipev.out"; then
        ok "$what"
    else
        bad "$what" "exit $(rc emuv_interleaved)/$(rc emuv_dualpipev)" "$(diff <(echo "$a") <(fields emuv_dualpipev) | head -4)"
    fi
    # and in bf16 (nccl's bf16 gathers, scatters and sends, the CUDA cross-entropy on bf16 logits),
    # within twice one emulated GPU's bf16-to-f32 distance as in the CPU cases above
    EMB=(--steps $ES --device cuda)
    timeout 300 "$EMU_BIN" "${TINY[@]}" "${EMB[@]}" --dtype bf16 --log "$work/emub1.jsonl" \
        --routing-record "$work/emub_routes.bin" >"$work/emub1.out" 2>&1; e1=$?
    timeout 300 "$EMU_BIN" "${TINY[@]}" "${EMB[@]}" --dtype f32 --log "$work/emubf.jsonl" \
        --routing-replay "$work/emub_routes.bin" >"$work/emubf.out" 2>&1; ef=$?
    timeout 300 "$EMU_BIN" "${TINY[@]}" "${EMB[@]}" --dtype bf16 --nproc 4 --tp 2 --pp 2 --micro-batches 2 \
        --log "$work/emub4.jsonl" --routing-replay "$work/emub_routes.bin" >"$work/emub4.out" 2>&1; e4=$?
    d=$( [ $e1 -eq 0 ] && [ $ef -eq 0 ] && loss_rms emub1 emubf $ES)
    loss=$( [ $e1 -eq 0 ] && [ $e4 -eq 0 ] && loss_rms emub1 emub4 $ES)
    bound=$($PYS -c "print('%.3g' % (2 * float('$d')))" 2>/dev/null)
    what="tp2 x pp2 in bf16 on the emulated GPU matches one emulated GPU in bf16 over $ES steps"
    what="$what within twice its distance from f32"
    if [ -n "$bound" ] && within "$loss" "$bound" &&
       grep -q "4 ranks (expert parallel 1), CUDA, bf16" "$work/emub4.out"; then
        ok "$what (loss RMS $loss <= $bound)"
    else
        bad "$what" "exit $e1/$ef/$e4, loss RMS $loss, bound '$bound'" \
            "$(grep -E 'rank|error' "$work/emub4.out" | tail -3)"
    fi
    # MLA (heads split over tp, the latent down-projections replicated) and an MTP module on the
    # last stage, through the CUDA kernels and nccl
    timeout 300 "$EMU_BIN" "${TINY[@]}" "${MLA[@]}" "${EMU[@]}" --log "$work/emum1.jsonl" \
        --routing-record "$work/emum_routes.bin" >"$work/emum1.out" 2>&1; e1=$?
    timeout 300 "$EMU_BIN" "${TINY[@]}" "${MLA[@]}" "${EMU[@]}" --nproc 4 --tp 2 --pp 2 --micro-batches 2 \
        --log "$work/emum4.jsonl" --routing-replay "$work/emum_routes.bin" >"$work/emum4.out" 2>&1; e4=$?
    loss=$( [ $e1 -eq 0 ] && [ $e4 -eq 0 ] && compare_losses emum1 emum4 $ES)
    what="--attn mla --mtp 1 as tp2 x pp2 on the emulated GPU matches one emulated GPU over $ES steps within 1e-5"
    if within "$loss" 1e-5 && grep -q "4 ranks (expert parallel 1), CUDA, f32" "$work/emum4.out"; then
        ok "$what (worst $loss)"
    else
        bad "$what" "exit $e1/$e4, loss $loss" "$(grep -E 'rank|error' "$work/emum4.out" | tail -3)"
    fi
    # --pair-micro-batches over nccl: each exchange on the layer's own stream while the other micro-batch's
    # kernels run on the compute stream; the unpaired run's numbers bit for bit
    EPP=(--steps $ES --device cuda --dtype bf16 --nproc 4 --pp 2 --ep 2 --micro-batches 4 --ep-exchange bounded
         --ep-overlap on)
    timeout 300 "$EMU_BIN" "${TINY[@]}" "${EPP[@]}" --log "$work/pair_emu_0.jsonl" >"$work/pair_emu_0.out" 2>&1; e1=$?
    timeout 300 "$EMU_BIN" "${TINY[@]}" "${EPP[@]}" --pair-micro-batches --log "$work/pair_emu_1.jsonl" \
        >"$work/pair_emu_1.out" 2>&1; e4=$?
    a=$(fields pair_emu_0)
    n=$(paired pair_emu_1)
    what="--pair-micro-batches as pp2 x ep2 in bf16 on the emulated GPU (nccl, bounded exchange on the layer's stream)"
    what="$what logs the unpaired run's numbers bit for bit ($n exchanges paired)"
    if [ "$e1$e4" = 00 ] && [ "$(echo "$a" | grep -c '^step')" -eq $ES ] && [ "$a" = "$(fields pair_emu_1)" ] &&
       [ "${n:-0}" -gt 0 ] && grep -q "4 ranks (expert parallel 2), CUDA, bf16" "$work/pair_emu_1.out"; then
        ok "$what"
    else
        bad "$what" "exit $e1/$e4" "$(grep -E 'rank|error' "$work/pair_emu_1.out" | tail -3)"
    fi
fi

# ---- the same objective in every layout: with the Switch, sequence-wise and z losses on, every
#      MoE call takes a loss span over the ranks sharing its micro-batch, so the balancing losses
#      count the global batch whatever the dp/ep/tp/pp split: the logged aux loss of each step equals
#      one rank's within 1e-6 (f64 sums in another order; before the spans a dp2 split was 8e-4
#      off), the loss within 1e-5 (routing replayed). Pipelines with M micro-batches count each
#      micro-batch of the global batch: every schedule logs the same aux loss as gpipe.
LOSSES=(--aux-loss 0.01 --seq-aux-loss 0.01 --z-loss 0.001)
run obj1 "${TINY[@]}" "${LOSSES[@]}" --steps 10 --log "$work/obj1.jsonl" --routing-record "$work/obj_routes.bin"
compare_aux() { # A B: worst relative difference of the steps' aux losses, or an error
    $PYS - "$work/$1.jsonl" "$work/$2.jsonl" <<'EOF'
import json, sys
def aux(p): return {r["step"]: r["aux_loss"] for r in map(json.loads, open(p)) if r["type"] == "step"}
a, b = aux(sys.argv[1]), aux(sys.argv[2])
if len(a) < 10 or set(a) != set(b) or not all(a[k] > 0 for k in a): print("bad: %d and %d steps" % (len(a), len(b))); sys.exit()
print("%.3g" % max(abs(a[k] - b[k]) / a[k] for k in a))
EOF
}
for spec in "obj_dp2|2|" "obj_dp2ep2|4|--ep 2" "obj_tp2|2|--tp 2" "obj_tp2dp2|4|--tp 2" "obj_pp2|2|--pp 2"; do
    IFS='|' read -r name n flags <<<"$spec"
    # shellcheck disable=SC2086
    run "$name" "${TINY[@]}" "${LOSSES[@]}" --steps 10 --nproc "$n" $flags --log "$work/$name.jsonl" \
        --routing-replay "$work/obj_routes.bin"
    aux=$(compare_aux obj1 "$name"); loss=$(compare_losses obj1 "$name" 10)
    what="balancing losses on, $n ranks ($flags): every step's aux loss is one rank's within 1e-6, the loss within 1e-5"
    if [ "$(rc obj1)" -eq 0 ] && [ "$(rc "$name")" -eq 0 ] && within "$aux" 1e-6 && within "$loss" 1e-5; then
        ok "$what (aux $aux, loss $loss)"
    else
        bad "$what" "exit $(rc obj1)/$(rc "$name"), aux $aux, loss $loss" "$(grep -E 'error' "$work/$name.out" | head -2)"
    fi
done
# DeepSeek-V3's own balancing (the sequence-wise loss and the expert bias) and the z-loss are means
# over sequences and tokens, so a pipeline's equal micro-batches add up to the global batch's:
# with them (no Switch loss, whose expert counts are each micro-batch's) pp2 x 2 micro-batches and
# tp2 x pp2 x dp2 x 2 micro-batches log one rank's aux loss and loss every step.
SEQ_LOSSES=(--seq-aux-loss 0.01 --z-loss 0.001)
run objq1 "${TINY[@]}" "${SEQ_LOSSES[@]}" --steps 10 --log "$work/objq1.jsonl" --routing-record "$work/objq_routes.bin"
for spec in "objq_pp2m2|2|--pp 2 --micro-batches 2" "objq_tp2pp2dp2m2|8|--tp 2 --pp 2 --micro-batches 2"; do
    IFS='|' read -r name n flags <<<"$spec"
    # shellcheck disable=SC2086
    run "$name" "${TINY[@]}" "${SEQ_LOSSES[@]}" --steps 10 --nproc "$n" $flags --log "$work/$name.jsonl" \
        --routing-replay "$work/objq_routes.bin"
    aux=$(compare_aux objq1 "$name"); loss=$(compare_losses objq1 "$name" 10)
    what="sequence-wise and z losses, $n ranks ($flags): every step's aux loss is one rank's within 1e-6, the loss"
    what="$what within 1e-5"
    if [ "$(rc objq1)" -eq 0 ] && [ "$(rc "$name")" -eq 0 ] && within "$aux" 1e-6 && within "$loss" 1e-5; then
        ok "$what (aux $aux, loss $loss)"
    else
        bad "$what" "exit $(rc objq1)/$(rc "$name"), aux $aux, loss $loss" "$(grep -E 'error' "$work/$name.out" | head -2)"
    fi
done
run obj_gpipe "${TINY[@]}" "${LOSSES[@]}" --steps 10 --nproc 2 --pp 2 --micro-batches 2 --pp-schedule gpipe \
    --log "$work/obj_gpipe.jsonl"
for sched in "1f1b|" "interleaved|--virtual-stages 2"; do
    IFS='|' read -r kind flags <<<"$sched"
    # shellcheck disable=SC2086
    run "obj_$kind" "${TINY[@]}" "${LOSSES[@]}" --steps 10 --nproc 2 --pp 2 --micro-batches 2 --pp-schedule "$kind" $flags \
        --log "$work/obj_$kind.jsonl"
    aux=$(compare_aux obj_gpipe "obj_$kind")
    what="balancing losses on, pp2 with 2 micro-batches: $kind logs gpipe's aux loss every step within 1e-6"
    if [ "$(rc obj_gpipe)" -eq 0 ] && [ "$(rc "obj_$kind")" -eq 0 ] && within "$aux" 1e-6; then ok "$what ($aux)"
    else bad "$what" "exit $(rc obj_gpipe)/$(rc "obj_$kind"), aux $aux"; fi
done

# ---- PowerSGD under expert parallelism and ZeRO-3: dp4 (ep2 inside) compresses each unit's
#      gradients the same way at every stage (the approximation is computed on the full unit, each
#      stage keeping its chunks), so --zero 3 logs --zero 0's losses bit for bit over 20 steps.
for z in 0 3; do
    run "psgd_z$z" "${TINY[@]}" --steps 20 --nproc 4 --ep 2 --zero $z --grad-compress powersgd:2:0 --log "$work/psgd_z$z.jsonl"
done
psgd=$( [ "$(rc psgd_z0)" -eq 0 ] && [ "$(rc psgd_z3)" -eq 0 ] && compare_losses psgd_z0 psgd_z3 20)
what="dp4 x ep2 with PowerSGD rank 2: --zero 3 logs --zero 0's losses bit for bit over 20 steps"
if [ "$psgd" = 0 ] && grep -q 'gradient reductions powersgd:2:0' "$work/psgd_z3.out"; then ok "$what"
else bad "$what" "exit $(rc psgd_z0)/$(rc psgd_z3), worst $psgd" "$(grep -E 'error' "$work/psgd_z3.out" | head -2)"; fi
fi  # ISA_RERUN

# ---- --recompute under tensor and pipeline parallelism: attn recomputes the attention core (its
#      output and statistics, or MHA's probabilities, one slot shared by the layers), full reruns
#      each block's forward from its kept input before its backward; the same ops on the same
#      inputs, so every logged number equals the run without recomputation bit for bit (tp2 x pp2 x
#      ZeRO-1 as the run `straight_tp2pp2z1` above, and MLA with MTP as mla4), and rank 0 ends with fewer peak
#      activation bytes
peak0() { grep -o 'memory at end, rank 0 .*peak activations [0-9.]* MiB ([0-9]* B)' "$work/$1.out" |
          sed 's/.*(\([0-9]*\) B)$/\1/'; }
for spec in "straight_tp2pp2z1|attn|" "straight_tp2pp2z1|full|" "mla4|full|mla"; do
    IFS='|' read -r ref mode kind <<<"$spec"
    name="rc_${mode}_$ref"
    # the reference's flags (a checkpoint at the end, the MLA run's sample) so the peaks compare
    if [ "$kind" = mla ]; then
        run "$name" "${TINY[@]}" "${MLA[@]}" --steps 30 --nproc 4 --tp 2 --pp 2 --micro-batches 2 --recompute "$mode" \
            --log "$work/$name.jsonl" --ckpt-dir "$work/ck_$name" --sample-len 40 \
            --routing-replay "$work/routes_mla.bin"
    else
        run "$name" "${TINY[@]}" --steps 30 --nproc 4 --tp 2 --pp 2 --micro-batches 2 --zero 1 --recompute "$mode" \
            --log "$work/$name.jsonl" --ckpt-dir "$work/ck_$name" "${REC[@]}"
    fi
    a=$(fields "$ref"); b=$(fields "$name"); p0=$(peak0 "$ref"); p1=$(peak0 "$name")
    what="--recompute $mode as tp2 x pp2 ($ref) logs every step and validation of the run without it bit for bit"
    if [ "$(rc "$ref")" -eq 0 ] && [ "$(rc "$name")" -eq 0 ] && [ "$(echo "$a" | grep -c '^step')" -eq 30 ] &&
       [ "$a" = "$b" ] && [ -n "$p0" ] && [ -n "$p1" ] && [ "$p1" -lt "$p0" ]; then
        ok "$what, peak activations of rank 0 $p0 -> $p1 B"
    else
        bad "$what, fewer peak activation bytes" "exit $(rc "$ref")/$(rc "$name"), peak '$p0' -> '$p1'" \
            "$(diff <(echo "$a") <(echo "$b") | head -4)" "$(grep -E 'rank|error' "$work/$name.out" | tail -2)"
    fi
done

if [ -z "${ISA_RERUN:-}" ]; then
# ---- optimizer state per rank under pipeline and tensor parallelism: ZeRO-1 keeps 1/dp of what
#      --zero 0 holds on the same rank (the stage's parameters, the rank's tensor-parallel box),
#      plus the padding of the units' last chunks: each unit of E elements is cut into N chunks of
#      ceil(E / N), so a rank holds at most N - 1 padding elements per unit and object; with at most
#      4 units per object and 3 groups here that is 8 bytes (two f32 moments) x N x 12.
for spec in "pp2dp2|4|--pp 2 --micro-batches 2|2|2" "tp2pp2dp2|8|--tp 2 --pp 2 --micro-batches 2|2|4"; do
    IFS='|' read -r name n flags dp nmax <<<"$spec"
    # shellcheck disable=SC2086
    run "mem0_$name" "${TINY[@]}" --steps 1 --nproc "$n" $flags --zero 0
    # shellcheck disable=SC2086
    run "mem1_$name" "${TINY[@]}" --steps 1 --nproc "$n" $flags --zero 1
    verdict=$($PYS - "$work/mem0_$name.out" "$work/mem1_$name.out" "$n" "$dp" "$nmax" <<'EOF'
import re, sys
def opt(p):
    return {int(r): int(v) for r, v in re.findall(r"memory bytes, rank (\d+): .*optimizer state (\d+),", open(p).read())}
z0, z1, n, dp, nmax = opt(sys.argv[1]), opt(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
if len(z0) != n or len(z1) != n: print("bad: %d and %d ranks reported" % (len(z0), len(z1))); sys.exit()
slack = 8 * nmax * 12
off = [(r, z0[r], z1[r]) for r in range(n) if not (z1[r] <= z0[r] / dp + slack and z1[r] < z0[r])]
print("off %s" % off if off else "ok " + ", ".join("rank %d %d -> %d B" % (r, z0[r], z1[r]) for r in range(n)))
EOF
)
    what="$name: --zero 1 optimizer state per rank <= 1/$dp of --zero 0's on that rank + unit padding"
    if [ "$(rc "mem0_$name")" -eq 0 ] && [ "$(rc "mem1_$name")" -eq 0 ] && [ "${verdict%% *}" = ok ]; then
        ok "$what (${verdict#ok })"
    else
        bad "$what" "exit $(rc "mem0_$name")/$(rc "mem1_$name"): $verdict"
    fi
done

# ---- a rank killed in a pipeline x tensor-parallel x ZeRO-1 layout: every survivor stops with an
#      error of its own naming it (the host backend's peer failure travels through every group), no hang
"$BIN" "${TINY[@]}" --steps 100000 --nproc 4 --tp 2 --pp 2 --micro-batches 2 --zero 1 --log "$work/kill.jsonl" \
    >"$work/kill.out" 2>&1 &
pid=$!
t0=$SECONDS
while [ $((SECONDS - t0)) -lt 60 ] && ! grep -q '"step":5,' "$work/kill.jsonl" 2>/dev/null; do sleep 0.2; done
ranks=($(cat "/proc/$pid/task/$pid/children" 2>/dev/null))
[ ${#ranks[@]} -eq 4 ] && kill -9 "${ranks[2]}"
t1=$SECONDS
( sleep 90; kill -9 $pid 2>/dev/null ) >/dev/null 2>&1 &
watchdog=$!
wait $pid
kill_rc=$?
kill $watchdog 2>/dev/null
# Each survivor's own line names rank 2: directly, or inside the error of the peer it saw hang up
# (dsk_comm_abort publishes every failing rank's error and rank 0 keeps the store up for the look-ups).
named=0
for r in 0 1 3; do
    grep -E "^\[rank $r\] train_moe: rank $r: " "$work/kill.out" | head -1 | grep -qE "rank 2\b" && named=$((named + 1))
done
what="rank 2 of tp2 x pp2 x ZeRO-1 SIGKILLed at step 5: ranks 0, 1 and 3 each exit with an error naming rank 2, no hang"
if [ ${#ranks[@]} -eq 4 ] && [ $kill_rc -ne 0 ] && [ $named -eq 3 ] && [ $((SECONDS - t1)) -lt 60 ]; then
    ok "$what (launcher exit $kill_rc after $((SECONDS - t1)) s)"
else
    bad "$what" "${#ranks[@]} ranks seen, exit $kill_rc, $named of 3 named it, $((SECONDS - t1)) s" \
        "$(grep -E 'train_moe: ' "$work/kill.out" | head -4)"
fi

# ---- 3. unsupported combinations and bad sizes: a message naming the flags, a non-zero exit, no crash
expect_fail() { # name, message regex, args...
    local name=$1 msg=$2; shift 2
    run "$name" "$@"
    local code; code=$(rc "$name")
    if [ "$code" -ne 0 ] && [ "$code" -lt 128 ] && grep -qE -e "$msg" "$work/$name.out" && ! grep -qiE 'sanitizer|segmentation|core dumped' "$work/$name.out"; then
        ok "bad input fails cleanly: $name (exit $code: $(grep -E -e "$msg" "$work/$name.out" | head -1 | cut -c1-120))"
    else
        bad "bad input fails cleanly: $name" "exit $code, want non-zero with /$msg/" "$(head -3 "$work/$name.out")"
    fi
}
expect_fail grid_divide '--tp 3 x --pp 1 = 3 must divide the world size 4' "${TINY[@]}" --nproc 4 --tp 3
expect_fail ep_dp '--ep 2 must divide the 1 data-parallel ranks' "${TINY[@]}" --nproc 4 --tp 2 --pp 2 --ep 2
expect_fail tp_heads '--tp 4 must divide --heads 2' "${TINY[@]}" --nproc 4 --tp 4 --heads 2
expect_fail ep_overlap '--ep-overlap "ring": use off, on or chunked' "${TINY[@]}" --nproc 2 --ep 2 --ep-overlap ring
expect_fail mla_tp_heads '--tp 4 must divide --heads 2' "${TINY[@]}" "${MLA[@]}" --nproc 4 --tp 4 --heads 2
expect_fail pp_layers '--layers 4 cannot fill 8 pipeline stages' "${TINY[@]}" --nproc 4 --pp 4 --pp-schedule interleaved --virtual-stages 2 --micro-batches 4
expect_fail micro_no_pp '--micro-batches, --virtual-stages and --pp-schedule need --pp 2' "${TINY[@]}" --micro-batches 2
expect_fail pair_one '--pair-micro-batches needs several ranks' "${TINY[@]}" --micro-batches 2 --pair-micro-batches
expect_fail pair_m1 '--pair-micro-batches needs --micro-batches 2 or more' "${TINY[@]}" --nproc 2 --pp 2 --pair-micro-batches
expect_fail pair_gpipe '--pair-micro-batches needs --pp-schedule 1f1b, interleaved or dualpipev' "${TINY[@]}" --nproc 2 --pp 2 --micro-batches 2 --pp-schedule gpipe --pair-micro-batches
expect_fail pair_zero3 '--pair-micro-batches runs with --zero 0 to 2' "${TINY[@]}" --nproc 2 --pp 2 --micro-batches 2 --zero 3 --pair-micro-batches
expect_fail pair_full '--pair-micro-batches runs without --recompute full' "${TINY[@]}" --nproc 2 --pp 2 --micro-batches 2 --recompute full --pair-micro-batches
expect_fail micro_divide '--micro-batches 3 must divide the 8 sequences' "${TINY[@]}" --nproc 2 --pp 2 --micro-batches 3
expect_fail virtual_kind '--virtual-stages 2 needs --pp-schedule interleaved' "${TINY[@]}" --nproc 2 --pp 2 --virtual-stages 2
expect_fail interleaved_m 'interleaved needs --micro-batches \(3\) to be a multiple of --pp 2' "${TINY[@]}" --nproc 2 --pp 2 --pp-schedule interleaved --micro-batches 3
expect_fail dpv_micro 'dualpipev needs --micro-batches 4 or more \(2 x --pp 2\), not 2' "${TINY[@]}" --nproc 2 --pp 2 --pp-schedule dualpipev --micro-batches 2
expect_fail dpv_virtual 'dualpipev runs 2 stages a rank \(a V\), not --virtual-stages 3' "${TINY[@]}" --nproc 2 --pp 2 --pp-schedule dualpipev --virtual-stages 3 --micro-batches 4
expect_fail bad_schedule '--pp-schedule "zigzag": use gpipe, 1f1b, interleaved or dualpipev' "${TINY[@]}" --nproc 2 --pp 2 --pp-schedule zigzag
expect_fail routes_topk 'holds top_k 2 decisions, the model takes top_k 3' "${TINY[@]}" --top-k 3 "${REC[@]}"
expect_fail routes_missing 'no decision recorded for phase 0 step 30 sub 0' "${TINY[@]}" --steps 31 "${REC[@]}"
expect_fail routes_file 'routing replay: cannot open' "${TINY[@]}" --routing-replay "$work/no_such_file"

fi  # ISA_RERUN
finish
