#!/usr/bin/env bash
# End-to-end tests of examples/train_moe.c (the main job) on tiny configurations:
# the loss falls, stop + resume is bitwise equal to a straight run, 2 ranks (data and
# expert parallel) match 1 rank, token shards load, --corpus-mb caps --data, the log/metrics/plot
# outputs are well formed, --help prints each default once, MFU never reads above 100%, and bad
# inputs fail cleanly with a message and a non-zero exit.
# Prints `[test_train] totals: P passed / F failed / S skipped`; exits non-zero on failure.
TEST_NAME=test_train
source "$(dirname "$0")/train_test_lib.sh"
need_built "$BIN"

# A tiny model on 0.3 MB of the repository's corpus: one step takes milliseconds.
TINY=(--seq 32 --d-model 32 --heads 2 --layers 3 --dense-layers 1 --ffn-hidden 64 --experts 4 --top-k 2
      --expert-hidden 32 --shared 1 --batch 8 --lr 3e-3 --warmup 5 --data "$CORPUS" --corpus-mb 0.3 --val-every 10
      --val-interval 10 --val-batches 2 --sample-len 0 --peak-tflops 0.1)

# run NAME ARGS...: runs the trainer, output in $work/NAME.out, status in $work/NAME.rc
run() {
    local name=$1; shift
    timeout 120 "$BIN" "$@" >"$work/$name.out" 2>&1
    echo $? >"$work/$name.rc"
}
rc() { cat "$work/$1.rc"; }

# field NAME FIELD [TYPE]: "step value" lines of a JSONL log
field() {
    $PY - "$work/$1.jsonl" "$2" "${3:-step}" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["type"] == sys.argv[3]:
        print(r["step"], repr(r[sys.argv[2]]))
EOF
}

# ---- 1. a tiny model learns: the loss of the last steps is well below the first ones
run learn "${TINY[@]}" --steps 30 --log "$work/learn.jsonl" --metrics "$work/learn.prom"
if [ "$(rc learn)" -ne 0 ]; then
    bad "tiny model trains 30 steps" "exit $(rc learn)" "$(tail -5 "$work/learn.out")"
else
    verdict=$($PY - "$work/learn.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in rows if r["type"] == "step"]
vals = [r for r in rows if r["type"] == "val"]
first = sum(r["loss"] for r in steps[:3]) / 3
last = sum(r["loss"] for r in steps[-3:]) / 3
problems = []
if len(steps) != 30: problems.append("%d step lines, want 30" % len(steps))
if not all(r["loss"] is not None and r["grad_norm"] is not None for r in steps): problems.append("non-finite loss or norm")
if not first > 5.0: problems.append("first loss %.3f, want about ln 256 = 5.55" % first)
if not last < first - 1.0: problems.append("loss %.3f -> %.3f did not fall by 1 nat" % (first, last))
if not vals or not vals[-1]["val_loss"] < vals[0]["val_loss"]: problems.append("validation loss did not fall: %s" % [v["val_loss"] for v in vals])
print("; ".join(problems) if problems else "ok %.3f -> %.3f" % (first, last))
EOF
)
    case $verdict in ok*) ok "tiny model trains 30 steps, loss falls ($verdict)";; *) bad "tiny model trains 30 steps, loss falls" "$verdict";; esac
fi

# ---- 2. the per-step line and the output files; --corpus-mb 0.3 keeps 300000 bytes of the corpus:
#         9090 windows of 33, every 10th held out
want="^data: $CORPUS (1 byte file, 300000 of 473235 tokens); 8181 training and 909 held-out windows"
if grep -q "$want" "$work/learn.out"; then
    ok "the banner names the corpus; --corpus-mb 0.3 keeps its first 300000 of 473235 bytes (8181 + 909 windows)"
else
    bad "--corpus-mb caps --data" "$(grep '^data:' "$work/learn.out")"
fi
if grep -qE '^step +30/30 \| loss [0-9.]+ \| lr .* \| norm .* \| scale .* ms \| .* tok/s \| mfu .*% \| comm .*% \| data +[0-9.]+% \| load [0-9.]+ \| drop [0-9]+ \| eta ' "$work/learn.out" &&
   grep -q 'validation loss' "$work/learn.out"; then
    ok "per-step line carries loss, lr, norm, scale, time, tokens/s, MFU, comm, data wait, load, drops, ETA"
else
    bad "per-step line format" "$(grep '^step' "$work/learn.out" | tail -2)"
fi
if [ -f "$work/learn.prom" ] && grep -q '^dsk_train_steps_total{rank="0"} 30$' "$work/learn.prom" &&
   grep -q '^# TYPE dsk_train_loss gauge$' "$work/learn.prom" &&
   [ "$(grep -c '^dsk_train_expert_load_ratio{rank="0",layer="[0-9]*",expert="[0-9]*"} ' "$work/learn.prom")" -eq 8 ] &&
   grep -q '^dsk_train_tokens_total{rank="0"} 7680$' "$work/learn.prom" && grep -q '^dsk_train_comm_seconds_total{rank="0"} ' "$work/learn.prom" &&
   grep -q '^dsk_train_loss_scale{rank="0"} 1$' "$work/learn.prom" && grep -q '^dsk_train_step_seconds_count{rank="0"} 30$' "$work/learn.prom"; then
    ok "--metrics writes a Prometheus text file (steps, loss, tokens, comm seconds, loss scale, step-time histogram, 2x4 expert loads)"
else
    bad "--metrics Prometheus file" "$(head -c 600 "$work/learn.prom" 2>/dev/null)"
fi
if $PY scripts/plot_loss.py "$work/learn.jsonl" "$work/learn.png" >"$work/plot.out" 2>&1 &&
   [ "$(head -c 8 "$work/learn.png" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ]; then
    ok "scripts/plot_loss.py turns the log into a PNG"
else
    bad "scripts/plot_loss.py" "$(cat "$work/plot.out")"
fi

# ---- 3. stop + resume == a straight 30-step run, to the last bit (losses, norms, val losses).
#         Stop at 20 (async checkpoints): step 20 both validates and checkpoints, so the resumed
#         run must replay what validation left in the expert-load counters of the next bias
#         update. Stop at 15 (--sync-ckpt): the stop itself writes the checkpoint.
run straight "${TINY[@]}" --steps 30 --ckpt-dir "$work/ck_a" --ckpt-every 10 --log "$work/straight.jsonl"
for variant in "20" "15 --sync-ckpt"; do
    set -- $variant
    at=$1; shift
    run "first$at" "${TINY[@]}" --steps 30 --ckpt-dir "$work/ck_$at" --ckpt-every 10 --stop-at "$at" "$@" --log "$work/first$at.jsonl"
    run "resumed$at" "${TINY[@]}" --steps 30 --ckpt-dir "$work/ck_$at" --ckpt-every 10 --resume "$@" --log "$work/resumed$at.jsonl"
    what="stop at step $at${*:+ $*} + --resume: steps $((at + 1))-30 bitwise equal to the straight run (loss, norm, validation)"
    if [ "$(rc straight)" -ne 0 ] || [ "$(rc "first$at")" -ne 0 ] || [ "$(rc "resumed$at")" -ne 0 ]; then
        bad "$what" "exit $(rc straight)/$(rc "first$at")/$(rc "resumed$at")" "$(tail -3 "$work/resumed$at.out")"
        continue
    fi
    a=$( (field straight loss; field straight grad_norm; field straight val_loss val) | awk -v s="$at" '$1 > s')
    b=$( (field "resumed$at" loss; field "resumed$at" grad_norm; field "resumed$at" val_loss val) | awk -v s="$at" '$1 > s')
    c=$(field "first$at" loss)
    d=$(field straight loss | awk -v s="$at" '$1 <= s')
    if grep -q "resume: step $at " "$work/resumed$at.out" && [ -n "$a" ] && [ "$a" = "$b" ] && [ "$c" = "$d" ] &&
       [ "$(echo "$b" | wc -l)" -ge $((2 * (30 - at) + 1)) ]; then
        ok "$what"
    else
        bad "$what" "$(diff <(echo "$a") <(echo "$b") | head -6)" "$(grep resume "$work/resumed$at.out")"
    fi
done

# ---- 4. two ranks (data parallel; expert parallel) and four (2 x 2) match one rank within 1e-4 over 50 steps
compare_runs() { # name1 name2 -> worst relative loss difference, or an error
    $PY - "$work/$1.jsonl" "$work/$2.jsonl" <<'EOF'
import json, sys
def losses(p): return [r["loss"] for r in map(json.loads, open(p)) if r["type"] == "step"]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
if len(a) != len(b) or not a: print("steps %d vs %d" % (len(a), len(b))); sys.exit()
print("%.3g" % max(abs(x - y) / abs(x) for x, y in zip(a, b)))
EOF
}
run one "${TINY[@]}" --steps 50 --log "$work/one.jsonl"
run dp2 "${TINY[@]}" --steps 50 --nproc 2 --log "$work/dp2.jsonl"
run ep2 "${TINY[@]}" --steps 50 --nproc 2 --ep 2 --log "$work/ep2.jsonl"
run dp2ep2 "${TINY[@]}" --steps 50 --nproc 4 --ep 2 --log "$work/dp2ep2.jsonl"
for r in dp2 ep2 dp2ep2; do
    what="${r/dp2ep2/4 ranks (dp2 x ep2)} match 1 rank within 1e-4 relative over 50 steps"
    what="${what/#dp2/2 ranks (dp2)}"
    what="${what/#ep2/2 ranks (ep2)}"
    if [ "$(rc one)" -ne 0 ] || [ "$(rc $r)" -ne 0 ]; then
        bad "$what" "exit $(rc one)/$(rc $r)" "$(tail -4 "$work/$r.out")"
        continue
    fi
    worst=$(compare_runs one $r)
    if $PY -c "import sys; sys.exit(0 if float('$worst') <= 1e-4 else 1)" 2>/dev/null; then
        ok "$what (worst $worst)"
    else
        bad "$what" "worst relative difference: $worst"
    fi
done

# The same binary under Open MPI's launcher (OMPI_COMM_WORLD_* environment), when installed.
if command -v mpirun >/dev/null 2>&1; then
    OMPI_MCA_plm_rsh_agent=false timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 "$BIN" "${TINY[@]}" --steps 50 --ep 2 \
        --log "$work/mpi.jsonl" >"$work/mpi.out" 2>&1
    code=$?
    worst=$( [ $code -eq 0 ] && compare_runs one mpi)
    if [ $code -eq 0 ] && $PY -c "import sys; sys.exit(0 if float('$worst') <= 1e-4 else 1)" 2>/dev/null; then
        ok "mpirun -np 2 (expert parallel) matches 1 rank within 1e-4 relative (worst $worst)"
    else
        bad "mpirun -np 2 matches 1 rank" "exit $code, worst $worst" "$(tail -3 "$work/mpi.out")"
    fi
else
    echo "skip mpirun -np 2: Open MPI's mpirun is not installed"; skipped=$((skipped + 1))
fi

# ---- 5. backward of the whole model (attention, dense and MoE blocks, aux loss) against
#         central differences (weights of std 0.1 give gradients well above f32 noise; dropping
#         one backward term makes 6 parameters fail); bf16 and fp16 (dynamic loss scaling) training
run gradcheck --seq 16 --d-model 16 --heads 2 --layers 3 --dense-layers 1 --ffn-hidden 24 --experts 4 --top-k 2 \
    --expert-hidden 8 --batch 2 --data "$CORPUS" --corpus-mb 0.1 --aux-loss 0.01 --init-std 0.1 --grad-check 6
if [ "$(rc gradcheck)" -eq 0 ] && grep -q 'grad-check: 0 of 38 parameters off' "$work/gradcheck.out"; then
    ok "--grad-check: 6 elements of each of 38 parameters match central differences"
else
    bad "--grad-check" "exit $(rc gradcheck)" "$(grep -E 'FAIL|off|rank' "$work/gradcheck.out" | head -4)"
fi
for d in bf16 fp16; do
    run "dtype_$d" "${TINY[@]}" --steps 30 --dtype $d --log "$work/dtype_$d.jsonl"
    verdict=$($PY - "$work/dtype_$d.jsonl" "$work/learn.jsonl" <<'EOF'
import json, sys
def rows(p): return [r for r in map(json.loads, open(p)) if r["type"] == "step"]
a, ref = rows(sys.argv[1]), rows(sys.argv[2])
if len(a) != 30: print("bad %d steps" % len(a)); sys.exit()
drop = a[0]["loss"] - sum(r["loss"] for r in a[-3:]) / 3
gap = abs(a[-1]["loss"] - ref[-1]["loss"])
print("ok" if drop > 1.0 and gap < 0.2 else "bad", "loss falls by %.2f, last step %.3f vs f32 %.3f, scales %s" % (
      drop, a[-1]["loss"], ref[-1]["loss"], sorted(set(r["loss_scale"] for r in a))))
EOF
)
    if [ "$(rc "dtype_$d")" -eq 0 ] && [ "${verdict%% *}" = ok ]; then ok "--dtype $d trains like f32 (${verdict#ok })"
    else bad "--dtype $d trains like f32" "exit $(rc "dtype_$d"): $verdict" "$(grep -E 'rank|error' "$work/dtype_$d.out" | head -2)"; fi
done

# ---- 6. llm.c token shards
$PY - "$work" <<'EOF'
import struct, sys, random
random.seed(7)
def shard(path, toks, version=1, count=None):
    hdr = [0] * 256
    hdr[0], hdr[1], hdr[2] = 20240520, version, len(toks) if count is None else count
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *hdr)); f.write(struct.pack("<%dH" % len(toks), *toks))
# a learnable stream: a repeating pattern of 300-symbol "words" with noise
toks = [(i * 37 + (i // 11)) % 300 for i in range(40000)]
shard(sys.argv[1] + "/a.bin", toks[:20000]); shard(sys.argv[1] + "/b.bin", toks[20000:])
shard(sys.argv[1] + "/v2.bin", toks[:1000], version=2)
shard(sys.argv[1] + "/short.bin", toks[:1000], count=5000)
shard(sys.argv[1] + "/big.bin", [1, 2, 400, 3])
open(sys.argv[1] + "/empty.txt", "wb").close()
open(sys.argv[1] + "/small.txt", "w").write("int main(void) { return 0; }\n" * 3)
EOF
run shards "${TINY[@]}" --steps 20 --data "$work/a.bin" "$work/b.bin" --vocab 300 --log "$work/shards.jsonl"
# --corpus-mb counts 2 bytes a shard token: 0.05 MB = 25000 tokens, all of a.bin and 5000 of b.bin
run shards_cap "${TINY[@]}" --steps 2 --data "$work/a.bin" "$work/b.bin" --vocab 300 --corpus-mb 0.05
want="^data: $work/a.bin $work/b.bin (2 token shards, 25000 of 40000 tokens)"
if [ "$(rc shards_cap)" -eq 0 ] && grep -q "$want" "$work/shards_cap.out"; then
    ok "--corpus-mb 0.05 keeps the first 25000 of 40000 tokens of two shards (cut inside the second)"
else
    bad "--corpus-mb over token shards" "exit $(rc shards_cap)" \
        "$(grep -E '^data|rror' "$work/shards_cap.out" | head -2)"
fi
if [ "$(rc shards)" -eq 0 ] && grep -q 'token shards' "$work/shards.out" && grep -q 'vocab 300' "$work/shards.out" &&
   $PY -c "
import json,sys; s=[r['loss'] for r in map(json.loads, open('$work/shards.jsonl')) if r['type']=='step']
sys.exit(0 if s[0] > 5.0 and s[-1] < s[0] - 0.5 else 1)"; then
    ok "llm.c token shards (2 files, vocab 300) are detected and learned"
else
    bad "llm.c token shards" "exit $(rc shards)" "$(grep -E 'data|error|rank' "$work/shards.out" | head -3)"
fi

# ---- 7. --help prints each flag's default once: the run-decided ones (--dtype, --peak-tflops, --data)
#         as words, the others as set_defaults holds them; never an empty or a second default
"$BIN" --help >"$work/help.out" 2>&1
doubled=$(grep -nE '\[\]|\] \[[^]]*\]$' "$work/help.out")
if grep -qxE '  --dtype +f32 \| bf16 \| fp16 \| fp8 \[bf16 on a GPU, f32 on the CPU\]' "$work/help.out" &&
   grep -qE '^  --peak-tflops .*[^]] \[CPU: measured at start; GPU: 989\]$' "$work/help.out" &&
   grep -qE '^  --lr +peak learning rate \[0.003\]$' "$work/help.out" &&
   grep -qE '^  --data +PATH\.\.\. .*[^]] \[C headers of /usr/include\]$' "$work/help.out" && [ -z "$doubled" ]; then
    ok "--help: $(grep -E '^  --dtype' "$work/help.out" | tr -s ' '); no flag with an empty or a second default"
else
    bad "--help prints each default once" "$(grep -E '^  --(dtype|peak-tflops) ' "$work/help.out")" "doubled: $doubled"
fi

# ---- 8. MFU. A peak given far below what a step does (1 MFLOP/s): the first step raises the
#         peak to its rate, said once, and no step reads above 100%. Without --peak-tflops the
#         banner says how the peak was measured. Two ranks divide by twice the peak: MFU per
#         token/s of dp2 is half that of one rank (steps before any raise).
run mfu_tiny "${TINY[@]}" --steps 10 --peak-tflops 1e-6 --log "$work/mfu_tiny.jsonl"
run mfu_measured "${TINY[@]}" --steps 10 --peak-tflops 0 --log "$work/mfu_measured.jsonl"
mfu_check() { # NAME: the largest MFU of the step lines and the log, or a problem
    $PY - "$work/$1.out" "$work/$1.jsonl" <<'EOF'
import json, re, sys
printed = [float(x) for x in re.findall(r"^step .*\| mfu +([0-9.]+)% \|", open(sys.argv[1]).read(), re.M)]
logged = [r["mfu"] for r in map(json.loads, open(sys.argv[2])) if r["type"] == "step"]
if len(printed) != 10 or len(logged) != 10: print("%d printed and %d logged steps" % (len(printed), len(logged)))
elif max(printed) > 100 or max(logged) > 1:
    print("MFU above 100%%: printed %s, logged %s" % (max(printed), max(logged)))
else: print("ok %.2f%%" % max(printed))
EOF
}
v1=$(mfu_check mfu_tiny) v2=$(mfu_check mfu_measured)
given='^mfu: .* per rank \(given by --peak-tflops\) x 1 rank'
raised='^mfu: step 1 ran at [0-9.e+]+ GFLOP/s, above the peak of 0.001 GFLOP/s'
measured='^mfu: .* per rank \(measured at start: best of 16 512\^3 f32 GEMMs on 1 thread\) x 1 rank'
if [ "$(rc mfu_tiny)" -eq 0 ] && [ "${v1%% *}" = ok ] && [ "${v2%% *}" = ok ] &&
   grep -qE "$given" "$work/mfu_tiny.out" && [ "$(grep -cE "$raised" "$work/mfu_tiny.out")" -eq 1 ] &&
   grep -qE "$measured" "$work/mfu_measured.out"; then
    what="--peak-tflops 1e-6 (raised to step 1's rate, said once; max ${v1#ok }), measured (max ${v2#ok })"
    ok "MFU never above 100%: $what"
else
    bad "MFU never above 100%" "exit $(rc mfu_tiny)/$(rc mfu_measured): $v1; $v2" \
        "$(grep '^mfu' "$work/mfu_tiny.out" | head -2)" "$(grep '^mfu' "$work/mfu_measured.out" | head -1)"
fi
verdict=$($PY - "$work/one.jsonl" "$work/one.out" "$work/dp2.jsonl" "$work/dp2.out" <<'EOF'
import json, re, statistics, sys
def per_tps(log, out):
    m = re.search(r"mfu: step (\d+) ran at", open(out).read())
    raised = int(m.group(1)) if m else 1 << 30
    rows = [r for r in map(json.loads, open(log)) if r["type"] == "step" and r["step"] < raised]
    return [r["mfu"] / r["tokens_per_s"] for r in rows]
a, b = per_tps(sys.argv[1], sys.argv[2]), per_tps(sys.argv[3], sys.argv[4])
if len(a) < 10 or len(b) < 10: print("only %d and %d steps before the peak was raised" % (len(a), len(b))); sys.exit()
ratio = statistics.median(a) / statistics.median(b)
print("%s 1 rank / 2 ranks: %.5f" % ("ok" if abs(ratio - 2) < 2e-3 else "bad", ratio))
EOF
)
if [ "${verdict%% *}" = ok ] && grep -qE '^\[rank 0\] mfu: .* x 2 ranks' "$work/dp2.out"; then
    ok "MFU divides by the peak of every rank: (MFU per token/s) ${verdict#ok }"
else bad "MFU over 2 ranks" "$verdict" "$(grep 'mfu:' "$work/dp2.out" | head -2)"; fi

# ---- 9. bad input: clean message, non-zero exit, never a crash
expect_fail() { # name, message regex, args...
    local name=$1 msg=$2; shift 2
    run "$name" "$@"
    local code; code=$(rc "$name")
    if [ "$code" -ne 0 ] && [ "$code" -lt 128 ] && grep -qE -e "$msg" "$work/$name.out" && ! grep -qiE 'sanitizer|segmentation|core dumped' "$work/$name.out"; then
        ok "bad input fails cleanly: $name (exit $code: $(grep -E -e "$msg" "$work/$name.out" | head -1 | cut -c1-110))"
    else
        bad "bad input fails cleanly: $name" "exit $code, want non-zero with /$msg/" "$(head -3 "$work/$name.out")"
    fi
}
expect_fail unknown_flag 'unknown flag "--bogus"' "${TINY[@]}" --bogus 1
expect_fail missing_value '--steps needs a value' "${TINY[@]}" --steps
expect_fail bad_number '--lr "fast" is not a valid number' "${TINY[@]}" --lr fast
expect_fail missing_data 'cannot open ".*/nope.txt"' "${TINY[@]}" --data "$work/nope.txt"
expect_fail empty_data '".*/empty.txt" is empty' "${TINY[@]}" --data "$work/empty.txt"
expect_fail tiny_corpus 'one global batch needs 8 training windows' "${TINY[@]}" --data "$work/small.txt"
expect_fail corpus_cap_tiny 'one global batch needs 8 training windows' "${TINY[@]}" --corpus-mb 0.0003
expect_fail corpus_mb_negative '--corpus-mb -1: must be >= 0' "${TINY[@]}" --corpus-mb -1
expect_fail shard_version 'token shard ".*v2.bin" has version 2' "${TINY[@]}" --data "$work/v2.bin"
expect_fail shard_truncated 'says 5000 tokens' "${TINY[@]}" --data "$work/short.bin"
expect_fail shard_vocab 'token 400 at 2 is >= --vocab 300' "${TINY[@]}" --data "$work/big.bin" --vocab 300
expect_fail heads_divide '--heads 3 does not divide --d-model 32' "${TINY[@]}" --heads 3
expect_fail ep_experts '--ep 2 must divide --experts 3' "${TINY[@]}" --experts 3 --top-k 1 --nproc 2 --ep 2
expect_fail batch_world '--batch 7 \(global\) must be a multiple of the world size 2' "${TINY[@]}" --batch 7 --nproc 2
expect_fail resume_no_dir '--resume needs --ckpt-dir' "${TINY[@]}" --resume
expect_fail fresh_over_ckpt 'already holds checkpoints' "${TINY[@]}" --steps 30 --ckpt-dir "$work/ck_a"

# A damaged newest checkpoint: --resume names it and continues from the one saved before, as
# the straight run did; when every checkpoint is damaged it fails and leaves the directory as it was.
damage() { # flips 4 bytes near the end of the first rank file of each step directory named
    local d f size
    for d in "$@"; do
        f=$(ls "$d"/rank_*.safetensors | head -1)
        size=$(stat -c %s "$f")
        printf '\x5a\x5a\x5a\x5a' | dd of="$f" bs=1 seek=$((size - 64)) conv=notrunc status=none
    done
}
if [ -d "$work/ck_a" ]; then
    cp -r "$work/ck_a" "$work/ck_bad"
    damage "$work"/ck_bad/step_*30
    run corrupt_newest "${TINY[@]}" --steps 30 --ckpt-dir "$work/ck_bad" --resume --log "$work/corrupt_newest.jsonl"
    same=$($PY - "$work/straight.jsonl" "$work/corrupt_newest.jsonl" <<'EOF2'
import json, sys
def losses(p): return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if r["type"] == "step"}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
print("ok" if sorted(b) == list(range(21, 31)) and all(a[k] == b[k] for k in b) else "differ: steps %s" % sorted(b))
EOF2
)
    what="--resume past a damaged newest checkpoint (step 30): names it, resumes at step 20, steps 21-30 bitwise as the straight run"
    if [ "$(rc corrupt_newest)" -eq 0 ] && grep -q 'checkpoint step 30 in .* is damaged' "$work/corrupt_newest.out" &&
       grep -q 'resume: step 20 ' "$work/corrupt_newest.out" && [ "$same" = ok ]; then ok "$what"
    else bad "$what" "exit $(rc corrupt_newest): $same" "$(grep -E 'resume|error' "$work/corrupt_newest.out" | head -3)"; fi
    cp -r "$work/ck_a" "$work/ck_all_bad"
    damage "$work"/ck_all_bad/step_*
    before=$(cd "$work/ck_all_bad" && find . -type f -exec md5sum {} + | sort)
    expect_fail corrupt_ckpt 'resume from .* failed, nothing was written: .*every checkpoint is damaged' "${TINY[@]}" --steps 40 --ckpt-dir "$work/ck_all_bad" --resume
    after=$(cd "$work/ck_all_bad" && find . -type f -exec md5sum {} + | sort)
    if [ "$before" = "$after" ]; then ok "a failed resume leaves every checkpoint file untouched"
    else bad "a failed resume leaves every checkpoint file untouched" "$(diff <(echo "$before") <(echo "$after") | head -4)"; fi
    cp -r "$work/ck_a" "$work/ck_mismatch"
    # another model or MoE option: the message names it with both values (a resume with another
    # --top-k, without the shared expert, with another --routed-scale continued before some of these)
    expect_fail mismatched_ckpt 'written with d_model=32, this run has d_model=64' "${TINY[@]}" --d-model 64 --steps 40 --ckpt-dir "$work/ck_mismatch" --resume
    expect_fail resume_top_k 'written with top_k=2, this run has top_k=3' "${TINY[@]}" --top-k 3 --steps 40 --ckpt-dir "$work/ck_mismatch" --resume
    expect_fail resume_no_shared 'written with shared=1, this run has shared=0' "${TINY[@]}" --shared 0 --steps 40 --ckpt-dir "$work/ck_mismatch" --resume
    expect_fail resume_scale 'moe.routed_scale: the checkpoint has 1, this layer 2.5' "${TINY[@]}" --routed-scale 2.5 --steps 40 --ckpt-dir "$work/ck_mismatch" --resume
    expect_fail resume_groups 'moe.n_group: the checkpoint has 1, this layer 2' "${TINY[@]}" --groups 2 --topk-groups 1 --steps 40 --ckpt-dir "$work/ck_mismatch" --resume
else
    bad "corrupt checkpoint on --resume" "no checkpoint from the straight run"
fi

finish
