#!/usr/bin/env bash
# Hugging Face DeepSeek checkpoints in and out of examples/train_moe.c (examples/train_hf.h),
# against the committed fixtures under tests/hf/ (tests/hf/make_fixture.py wrote them with
# transformers):
# - build/tests/trainer/test_hf (the C cases: import -> logits and loss, FP8, round trips, bad
#   input), keeping its exports of the fixtures' (moved) weights for the checks below;
# - Python's safetensors reads every tensor of those exports and of the trainer's f32, bf16 and
#   fp8 exports after two fine-tuning steps: the hub's names and shapes, config.json with every
#   key of the fixture's (tests/hf/check_export.py);
# - where torch and transformers are installed, from_pretrained loads the exports with no
#   missing or unexpected keys and its logits are within 1e-5 of dsk's (skipped otherwise,
#   with the reason);
# - on the emulated GPU, the YaRN model imports, trains and exports (fp8) with the CPU's losses;
# - --grad-check of a YaRN model (v3's weights, v3_yarn's rope_scaling) against central differences;
# - --nproc 2 --ep 2 imports each rank's experts (the one-rank run's losses); --resume at the last
#   step with --export-hf writes the saved weights (byte for byte the first run's export);
# - the trainer refuses a config.json with an unknown topk_method, naming the file and key, and
#   the flags it cannot combine (data vocabulary, --export-dtype, --attn mha, --ep, --zero, --mtp-ffn dense or
#   another depth on a checkpoint with an MTP layer).
# Prints `[test_hf] totals: P passed / F failed / S skipped`; exits non-zero on failure.
TEST_NAME=test_hf
source "$(dirname "$0")/train_test_lib.sh"
need_built "$BIN"
need_built "$BUILD/tests/trainer/test_hf"

mkdir -p "$work/keep"
if "$BUILD/tests/trainer/test_hf" "$work/keep" >"$work/c.out" 2>&1; then
    ok "build/tests/trainer/test_hf: $(tail -1 "$work/c.out")"
else
    bad "build/tests/trainer/test_hf" "$(grep -E 'FAIL|tests/trainer/test_hf.c' "$work/c.out" | head -5)"
fi

# an llm.c token shard over the fixtures' 64-token vocabulary, from the frozen corpus
$PY - "$CORPUS" "$work/tok.bin" <<'PYEOF'
import struct, sys
data = open(sys.argv[1], "rb").read()[:20000]
toks = [b % 64 for b in data]
with open(sys.argv[2], "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, len(toks), *([0] * 253)))
    f.write(struct.pack("<%dH" % len(toks), *toks))
PYEOF

TRAIN=(--data "$work/tok.bin" --seq 8 --batch 2 --steps 2 --warmup 1 --lr 1e-3 --val-interval 2 --val-batches 1
       --sample-len 0 --log-every 1)

check() { # name export fixture [fp8]
    if $PY tests/hf/check_export.py tensors "$2" "$3" ${4:-} >"$work/$1.chk" 2>&1; then
        ok "$1: Python safetensors reads every tensor with the hub's names and shapes; config.json has the fixture's keys ($(tail -1 "$work/$1.chk"))"
    else
        bad "$1" "$(head -5 "$work/$1.chk")"
    fi
}
for f in v3 v2; do check "test_hf's $f export" "$work/keep/${f}_export" tests/hf/$f; done
check "test_hf's v3_yarn export (tensors of v3, config keys of v3)" "$work/keep/v3_yarn_export" tests/hf/v3
if $PY -c 'import json, sys; c = json.load(open(sys.argv[1])); r = c["rope_scaling"]; sys.exit(not (r["type"] == "yarn" and r["factor"] == 4.0 and r["beta_slow"] == 0.5 and r["mscale_all_dim"] == 0.707))' \
    "$work/keep/v3_yarn_export/config.json"; then
    ok "the v3_yarn export's config.json keeps rope_scaling (yarn, factor 4, beta_slow 0.5, mscale_all_dim 0.707)"
else
    bad "v3_yarn export rope_scaling" "$(grep -A2 rope_scaling "$work/keep/v3_yarn_export/config.json")"
fi

for f in v3 v2; do
    for dt in f32 bf16 fp8; do
        out=$work/tr_${f}_$dt
        if timeout 300 "$BIN" --init-from-hf tests/hf/$f "${TRAIN[@]}" --export-hf "$out" --export-dtype $dt \
            >"$out.log" 2>&1 && grep -q "^imported tests/hf/$f" "$out.log" && grep -q "^exported step 2" "$out.log"; then
            ok "train_moe --init-from-hf tests/hf/$f, 2 steps, --export-hf --export-dtype $dt"
            check "train_moe's $f $dt export" "$out" tests/hf/$f $([ $dt = fp8 ] && echo fp8)
        else
            bad "train_moe --init-from-hf tests/hf/$f --export-dtype $dt" "$(tail -3 "$out.log")"
        fi
    done
done

# the fixture's MTP layer imported into --mtp 1 (MoE FFN), trained, exported with the hub's names
if timeout 300 "$BIN" --init-from-hf tests/hf/v3 "${TRAIN[@]}" --mtp 1 --export-hf "$work/mtp1" --export-dtype f32 \
    >"$work/mtp1.log" 2>&1 && grep -q "^exported step 2" "$work/mtp1.log"; then
    ok "train_moe --init-from-hf tests/hf/v3 --mtp 1 (the fixture's MTP layer, MoE FFN) trains and exports"
    check "its export holds the fixture's tensors, the MTP layer's included" "$work/mtp1" tests/hf/v3
    $PY tests/hf/check_export.py keys "$work/mtp1" >"$work/mtp1.keys" 2>&1
    case $? in
    0) ok "its export loads with from_pretrained, which skips only the MTP layer ($(grep skipped "$work/mtp1.keys"))" ;;
    3) skip "from_pretrained of the --mtp 1 export (not run: $(tail -1 "$work/mtp1.keys"))" ;;
    *) bad "from_pretrained of the --mtp 1 export" "$(grep -v Loading "$work/mtp1.keys" | tail -3)" ;;
    esac
else
    bad "train_moe --init-from-hf --mtp 1" "$(tail -3 "$work/mtp1.log")"
fi

# the exported f32 directory again as the starting point: the import reads what the export wrote
if timeout 300 "$BIN" --init-from-hf "$work/tr_v3_f32" "${TRAIN[@]}" >"$work/again.log" 2>&1 &&
    grep -q "^imported $work/tr_v3_f32" "$work/again.log"; then
    ok "train_moe --init-from-hf on its own export"
else
    bad "train_moe --init-from-hf on its own export" "$(tail -3 "$work/again.log")"
fi

# the imported MTP layer (MoE FFN) in the whole model's gradient check
if timeout 300 "$BIN" --init-from-hf tests/hf/v3 --data "$work/tok.bin" --seq 8 --batch 2 --grad-check 3 --mtp 1 \
    >"$work/mtpgc.log" 2>&1 && grep -q "^grad-check: 0 of [0-9]* parameters off" "$work/mtpgc.log" &&
    grep -q "^grad-check blocks.2.moe.router " "$work/mtpgc.log" && grep -q "^grad-check blocks.2.mtp.proj " "$work/mtpgc.log"; then
    ok "v3 with its MTP layer imported into --mtp 1: $(grep '^grad-check: ' "$work/mtpgc.log")"
else
    bad "--init-from-hf --mtp 1 --grad-check" "$(tail -3 "$work/mtpgc.log")"
fi

# YaRN: the whole model's gradients against central differences with v3's weights under v3_yarn's rope_scaling
mkdir -p "$work/yarn" && cp tests/hf/v3/model* "$work/yarn/" && cp tests/hf/v3_yarn/config.json "$work/yarn/"
if timeout 300 "$BIN" --init-from-hf "$work/yarn" --data "$work/tok.bin" --seq 8 --batch 2 --grad-check 3 \
    >"$work/yarn.log" 2>&1 && grep -q "^grad-check: 0 of [0-9]* parameters off" "$work/yarn.log"; then
    ok "YaRN model (v3 weights, v3_yarn config): $(grep '^grad-check: ' "$work/yarn.log")"
else
    bad "YaRN --grad-check" "$(tail -3 "$work/yarn.log")"
fi

# the device path (emulated GPU: the import's copies to the device, YaRN's rotations, the export from the device)
EMU_BIN=$BUILD/emu/examples/train_moe
if [ "${EMULATE:-1}" = 0 ]; then
    skip "emulated GPU: not built (EMULATE=0)"
elif ! make --no-print-directory -s BUILD="$BUILD" "$EMU_BIN" >"$work/emu_build.log" 2>&1; then
    bad "build $EMU_BIN" "$(tail -3 "$work/emu_build.log")"
else
    for dev in cpu cuda; do
        bin=$BIN; [ $dev = cuda ] && bin=$EMU_BIN
        timeout 600 "$bin" --init-from-hf "$work/yarn" "${TRAIN[@]}" --device $dev --dtype f32 --log "$work/y_$dev.jsonl" \
            --export-hf "$work/y_$dev" --export-dtype fp8 >"$work/y_$dev.log" 2>&1
        echo $? >"$work/y_$dev.rc"
    done
    if [ "$(cat "$work/y_cpu.rc")" = 0 ] && [ "$(cat "$work/y_cuda.rc")" = 0 ] &&
        $PY - "$work/y_cpu.jsonl" "$work/y_cuda.jsonl" <<'PYEOF'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert len(a) == len(b) == 3
for x, y in zip(a, b):
    for k in ("loss", "val_loss"):
        if k in x:
            assert abs(x[k] - y[k]) <= 1e-5 * abs(x[k]), (k, x[k], y[k])
PYEOF
    then
        ok "emulated GPU: the YaRN model imported, trained 2 steps and exported (fp8) with the CPU's losses (1e-5)"
        check "the emulated GPU's fp8 export" "$work/y_cuda" tests/hf/v3 fp8
    else
        bad "emulated GPU import/train/export" "$(tail -2 "$work/y_cuda.log")" "$(cat "$work/y_cpu.jsonl" "$work/y_cuda.jsonl")"
    fi
fi

# experts spread over ranks: each rank imports its own (expert0 of its share), the losses are the one-rank run's
losses() { grep -oE '(step +[0-9]+/[0-9]+ \| loss [0-9.]+|validation loss [0-9.]+)' "$1"; }
if timeout 300 "$BIN" --init-from-hf tests/hf/v3 "${TRAIN[@]}" --nproc 2 --ep 2 >"$work/ep2.log" 2>&1 &&
    [ -n "$(losses "$work/tr_v3_f32.log")" ] && [ "$(losses "$work/ep2.log")" = "$(losses "$work/tr_v3_f32.log")" ]; then
    ok "train_moe --init-from-hf --nproc 2 --ep 2 logs the one-rank run's losses ($(losses "$work/ep2.log" | tr '\n' ' '))"
else
    bad "train_moe --init-from-hf --nproc 2 --ep 2" "$(losses "$work/ep2.log" | tr '\n' ' ')" \
        "one rank: $(losses "$work/tr_v3_f32.log" | tr '\n' ' ')"
fi

# export as a tool over a dsk checkpoint: --resume at the last step writes the same files as the run that saved it
if timeout 300 "$BIN" --init-from-hf tests/hf/v3 "${TRAIN[@]}" --ckpt-dir "$work/ck" --export-hf "$work/ck_e1" \
    --export-dtype f32 >"$work/ck1.log" 2>&1 &&
    timeout 300 "$BIN" --init-from-hf tests/hf/v3 "${TRAIN[@]}" --ckpt-dir "$work/ck" --resume --export-hf "$work/ck_e2" \
        --export-dtype f32 >"$work/ck2.log" 2>&1 && grep -q "^resume: step 2" "$work/ck2.log" &&
    cmp -s "$work/ck_e1/model-00001-of-00001.safetensors" "$work/ck_e2/model-00001-of-00001.safetensors" &&
    cmp -s "$work/ck_e1/config.json" "$work/ck_e2/config.json"; then
    ok "--resume at the checkpoint's last step with --export-hf exports the saved weights byte for byte"
else
    bad "--resume + --export-hf" "$(tail -2 "$work/ck2.log")"
fi

# from_pretrained, where torch and transformers are installed
for f in v3 v2 v3_yarn; do
    $PY tests/hf/check_export.py transformers "$work/keep/${f}_export" "$work/keep/${f}_export_logits.safetensors" \
        tests/hf/$f >"$work/tf_$f.out" 2>&1
    case $? in
    0) ok "$f: from_pretrained loads the export with no missing or unexpected keys; $(grep logits "$work/tf_$f.out")" ;;
    3) skip "$f: from_pretrained of the export (not run: $(tail -1 "$work/tf_$f.out"))" ;;
    *) bad "$f: from_pretrained of the export" "$(grep -v Loading "$work/tf_$f.out" | tail -4)" ;;
    esac
done


# models trained from scratch (the v3 and v2-lite presets: MLA, MoE; v3's MTP module stays out) export too
for pr in v3 v2-lite; do
    if timeout 300 "$BIN" --preset $pr --data "$work/tok.bin" --vocab 64 --seq 8 --batch 2 --steps 2 --warmup 1 \
        --val-batches 1 --sample-len 0 --export-hf "$work/scratch_$pr" $([ $pr = v2-lite ] && echo --bias-rate 0) \
        >"$work/scratch_$pr.log" 2>&1; then
        $PY tests/hf/check_export.py keys "$work/scratch_$pr" >"$work/scratch_$pr.chk" 2>&1
        case $? in
        0) ok "--preset $pr from scratch: from_pretrained loads its export with no missing or unexpected keys ($(tail -1 "$work/scratch_$pr.chk"))" ;;
        3) skip "--preset $pr export into transformers (not run: $(tail -1 "$work/scratch_$pr.chk"))" ;;
        *) bad "--preset $pr export into transformers" "$(grep -v Loading "$work/scratch_$pr.chk" | tail -3)" ;;
        esac
    else
        bad "--preset $pr --export-hf" "$(tail -3 "$work/scratch_$pr.log")"
    fi
done

# bad input through the trainer: an unknown topk_method
cp -r tests/hf/v3 "$work/badcfg"
sed -i 's/"noaux_tc"/"balanced"/' "$work/badcfg/config.json"
if ! timeout 60 "$BIN" --init-from-hf "$work/badcfg" "${TRAIN[@]}" >"$work/badcfg.log" 2>&1 &&
    grep -q "topk_method" "$work/badcfg.log" && grep -q "$work/badcfg/config.json" "$work/badcfg.log"; then
    ok "train_moe --init-from-hf refuses an unknown topk_method, naming config.json and the key"
else
    bad "train_moe --init-from-hf with topk_method \"balanced\"" "$(tail -3 "$work/badcfg.log")"
fi
# the trainer's other refusals, each before any step
refuse() { # name needle args...
    local name=$1 needle=$2; shift 2
    if ! timeout 60 "$BIN" "$@" >"$work/refuse.log" 2>&1 && grep -qF -- "$needle" "$work/refuse.log"; then
        ok "refused: $name"
    else
        bad "refused: $name" "want a failure mentioning: $needle" "$(tail -2 "$work/refuse.log")"
    fi
}
refuse "data vocabulary other than the model's" "the data's vocabulary is 256 tokens, the model's 64" \
    --init-from-hf tests/hf/v3 --data "$CORPUS" --seq 8 --batch 2 --steps 1
refuse "--export-dtype fp16" '--export-dtype "fp16"' --data "$CORPUS" --attn mla --export-hf "$work/x" --export-dtype fp16 \
    --steps 1
refuse "--export-hf with --attn mha" "use --attn mla" --data "$CORPUS" --export-hf "$work/x" --steps 1
refuse "--export-hf with --ep 2" "--export-hf runs without" --init-from-hf tests/hf/v3 "${TRAIN[@]}" --export-hf "$work/x" \
    --ep 2
refuse "--export-hf of a softmax model with a moving expert bias" "pass --bias-rate 0" --preset v2-lite --data "$CORPUS" \
    --export-hf "$work/x" --steps 1
refuse "--init-from-hf with --tp 2" "--init-from-hf runs without --tp and --pp" --init-from-hf tests/hf/v3 "${TRAIN[@]}" \
    --nproc 2 --tp 2
# --zero 1-3 import the same weights: each rank keeps its pieces of the hub's tensors, so two ranks at
# --zero 3 log the losses of --zero 0 (every rank's whole tensors)
for z in 0 3; do
    timeout 120 "$BIN" --init-from-hf tests/hf/v3 "${TRAIN[@]}" --nproc 2 --zero $z --log "$work/hfz$z.jsonl" \
        >"$work/hfz$z.log" 2>&1 || echo "exit $?" >>"$work/hfz$z.log"
done
zl=$($PY -c "
import json, sys
def l(p): return [r['loss'] for r in map(json.loads, open(p)) if r['type'] == 'step']
a, b = l('$work/hfz0.jsonl'), l('$work/hfz3.jsonl')
print('ok' if a and a == b else 'off %s %s' % (a[:3], b[:3]))" 2>&1)
if [ "$zl" = ok ]; then ok "--init-from-hf with --zero 3 on 2 ranks logs --zero 0's losses bit for bit"
else bad "--init-from-hf with --zero 3 on 2 ranks logs --zero 0's losses" "$zl" "$(grep -E 'error|exit' "$work/hfz3.log" | head -2)"; fi
refuse "--init-from-hf with an MTP layer and --mtp 1 --mtp-ffn dense" "num_nextn_predict_layers" \
    --init-from-hf tests/hf/v3 "${TRAIN[@]}" --mtp 1 --mtp-ffn dense
refuse "--init-from-hf with one MTP layer and --mtp 2" "differs from --mtp" --init-from-hf tests/hf/v3 "${TRAIN[@]}" \
    --mtp 2
finish
