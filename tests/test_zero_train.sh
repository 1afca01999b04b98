#!/usr/bin/env bash
# The trainer's sharded data parallelism (examples/train_moe.c --zero, --grad-compress; issue 14).
#   1. 50 steps of --zero 1, 2 and 3 at 2 and 4 ranks and with expert parallelism (2 data x 2
#      expert) log --zero 0's losses bit for bit, their checkpoints hold its weights and moments bit
#      for bit and the final samples are the same text; also in bf16. Bitwise because the math is
#      the same: the host backend folds every reduction in rank order whether it all-reduces or
#      reduce-scatters, AdamW is elementwise, and the clipping norm is an f64 sum of f64 partial
#      sums (its order changes the f64 result in the last bits, far below the f32 rounding of the
#      clip factor).
#   2. Gradient accumulation (2 micro-batches): --zero 1 reduces once, on the last micro-batch, as
#      --zero 0 does: bit for bit. --zero 2 and 3 reduce every micro-batch and add the reduced
#      parts (sum over ranks, then over micro-batches, where --zero 0 sums over micro-batches
#      first): f32 rounding of another order, so within 1e-4 relative over 30 steps (section 2).
#      The MoE routing of --zero 0 is recorded and replayed by the sharded runs, so that rounding
#      cannot move a token to another expert (a discontinuity no tolerance covers).
#   3. A checkpoint saved at one data-parallel size resumes at another (4 -> 2, 2 -> 3, 3 -> 1, in
#      other stages) and continues bit for bit as an unsharded (--zero 0) run resumed the same way.
#   4. Compression on all of the corpus: PowerSGD rank 4 and bf16 end within 3% of the
#      uncompressed validation loss after the same 150 steps, with the bytes handed to the
#      reductions cut by the factor the shapes give (PowerSGD) or exactly 2 (bf16); fp8 and fp8:ef
#      within 1%, with 3.5x to 4x fewer bytes.
#   5. Each rank prints its memory at start, from the allocator: at 4 ranks the optimizer state
#      is a quarter of --zero 0's (plus the padding of each unit's last chunk), --zero 2's
#      gradients a quarter plus two units' buffers and one chunk (and the MoE layers' stand-in
#      gradient), --zero 3's parameters a quarter plus two units' gather buffers.
#   6. Bad flags fail with a message naming them; a --zero 0 checkpoint resumes at --zero 2 and a
#      --zero 3 one at --zero 0 (one format: boxes of the full tensors), continuing bit for bit.
#   7. The CUDA path (nccl, the communication stream) on the emulated GPU: 2 ranks with expert
#      parallelism in bf16 give --zero 0's losses and norms bit for bit in every stage; a sharded
#      checkpoint resumes on another world size as --zero 0's does.
# Prints `[test_zero_train] totals: P passed / F failed / S skipped`.
TEST_NAME=test_zero_train
source "$(dirname "$0")/train_test_lib.sh"
need_built "$BIN"

TINY=(--seq 32 --d-model 32 --heads 2 --layers 3 --dense-layers 1 --ffn-hidden 64 --experts 4 --top-k 2
      --expert-hidden 32 --shared 1 --batch 12 --lr 3e-3 --warmup 5 --data "$CORPUS" --corpus-mb 0.3 --val-every 10
      --val-interval 10 --val-batches 2 --sample-len 0 --peak-tflops 0.1)

# run NAME ARGS...: output in $work/NAME.out, JSON lines in $work/NAME.jsonl, status in $work/NAME.rc
run() {
    local name=$1; shift
    rm -f "$work/$name.jsonl"
    timeout 120 "$BIN" "$@" --log "$work/$name.jsonl" >"$work/$name.out" 2>&1
    echo $? >"$work/$name.rc"
}
rc() { cat "$work/$1.rc"; }
ran() { # NAME: 0 if the run exited 0, else reports it
    [ "$(rc "$1")" -eq 0 ] && return 0
    bad "$2" "$1 exited $(rc "$1")" "$(tail -3 "$work/$1.out")"
    return 1
}

# same_log A B [TOL]: the step losses, the steps' gradient norms (as logged, 9 digits) and the
# validation losses of two logs: bit for bit (TOL unset) or within TOL relative; prints "ok ..."
# or the first difference.
same_log() {
    $PY - "$work/$1.jsonl" "$work/$2.jsonl" "${3:-0}" <<'EOF'
import json, sys
def rows(p):
    out = []
    for r in map(json.loads, open(p)):
        if r["type"] == "step": out += [("step", r["step"], r["loss"]), ("norm", r["step"], r["grad_norm"])]
        elif r["type"] == "val": out.append(("val", r["step"], r["val_loss"]))
    return out
a, b, tol = rows(sys.argv[1]), rows(sys.argv[2]), float(sys.argv[3])
if len(a) != len(b) or not a: print("%d and %d records" % (len(a), len(b))); sys.exit()
worst = 0.0
for x, y in zip(a, b):
    if x[:2] != y[:2]: print("records %s vs %s" % (x[:2], y[:2])); sys.exit()
    d = abs(x[2] - y[2]) / max(abs(x[2]), 1e-30)
    worst = max(worst, d)
    if (tol == 0 and x[2] != y[2]) or d > tol:
        print("%s %d: %.9g vs %.9g" % (x[0], x[1], x[2], y[2])); sys.exit()
print("ok %d records, largest relative difference %.2g" % (len(a), worst))
EOF
}

# same_ckpt DIR_A DIR_B: every tensor of the newest checkpoint of each, rebuilt whole from the
# rank files its manifest lists (whole tensors, or pieces placed by their "dsk.box.<key>"
# metadata: expert rows, dsk_zero's boxes; a file keys several boxes of one name "<name>@<offset>"
# with "dsk.name.<key>" = the name), equal byte for byte.
same_ckpt() {
    $PY - "$1" "$2" <<'EOF'
import json, os, struct, sys
import numpy as np
DT = {"F32": np.float32, "F64": np.float64, "BF16": np.uint16, "F16": np.float16, "I32": np.int32, "I64": np.int64}
def newest(d):
    steps = sorted(s for s in os.listdir(d) if s.startswith("step_") and os.path.exists(os.path.join(d, s, "manifest.json")))
    return os.path.join(d, steps[-1])
def tensors(d):
    man = json.load(open(os.path.join(d, "manifest.json")))
    out = {}
    for f in man["files"]:
        path = os.path.join(os.path.dirname(d), "step_%08d" % f["step"], "rank_%05d.%s.safetensors" % (f["rank"], f["attempt"]))
        raw = open(path, "rb").read()
        n = struct.unpack("<Q", raw[:8])[0]
        head = json.loads(raw[8:8 + n])
        meta = head.pop("__metadata__", {})
        for key, t in head.items():
            a = np.frombuffer(raw[8 + n + t["data_offsets"][0]:8 + n + t["data_offsets"][1]], DT[t["dtype"]])
            a = a.reshape(t["shape"])
            name, box = meta.get("dsk.name." + key, key), meta.get("dsk.box." + key)
            if box is None:
                out[name] = a.copy(); continue
            org, whole = ([int(x) for x in part.split(",")] for part in box.split(";"))
            if name not in out: out[name] = np.full(whole, np.nan, a.dtype)
            out[name][tuple(slice(o, o + s) for o, s in zip(org, a.shape))] = a
    for k, v in out.items():
        if v.dtype.kind == "f" and np.isnan(v).any(): print("%s: the pieces leave a gap" % k); sys.exit()
    return {k: v.reshape(-1) for k, v in out.items()}
a, b = tensors(newest(sys.argv[1])), tensors(newest(sys.argv[2]))
if sorted(a) != sorted(b): print("names differ: %s" % sorted(set(a) ^ set(b))[:5]); sys.exit()
for k in sorted(a):
    if a[k].shape != b[k].shape or a[k].tobytes() != b[k].tobytes():
        i = int(np.argmax(a[k] != b[k])) if a[k].shape == b[k].shape else -1
        print("%s differs (%s vs %s, element %d)" % (k, a[k].shape, b[k].shape, i)); sys.exit()
print("ok %d tensors" % len(a))
EOF
}

echo "# section 1 at ${SECONDS}s"
# ---- 1. 50 steps: every stage logs --zero 0's losses and checkpoints its state, bit for bit
# sample_of NAME: the text of the final sample
sample_of() { sed -n '/---- sample (/,/---- end of sample/p' "$work/$1.out"; }
for cfg in "2 1 f32" "4 1 f32" "4 2 f32" "2 1 bf16"; do
    set -- $cfg; n=$1; ep=$2; dt=$3
    steps=50; [ "$dt" = bf16 ] && steps=30
    for z in 0 1 2 3; do
        run "s${n}e${ep}${dt}z$z" "${TINY[@]}" --steps "$steps" --nproc "$n" --ep "$ep" --dtype "$dt" --zero "$z" \
            --sample-len 24 --ckpt-dir "$work/ck_${n}_${ep}_${dt}_$z"
    done
    if [ "$ep" -gt 1 ] && ran "s${n}e${ep}${dt}z0" "--zero 0 at $n ranks (2 data x 2 expert) saves its checkpoint"; then
        ok "--zero 0 at $n ranks (2 data x 2 expert) saves its checkpoint: the ranks holding the same experts write them once"
    fi
    for z in 1 2 3; do
        what="--zero $z at $n ranks$( [ "$ep" -gt 1 ] && echo " (2 data x 2 expert)"), $dt: $steps steps equal --zero 0"
        ran "s${n}e${ep}${dt}z0" "$what" && ran "s${n}e${ep}${dt}z$z" "$what" || continue
        v=$(same_log "s${n}e${ep}${dt}z0" "s${n}e${ep}${dt}z$z")
        c=$(same_ckpt "$work/ck_${n}_${ep}_${dt}_0" "$work/ck_${n}_${ep}_${dt}_$z")
        smp=ok
        s0=$(sample_of "s${n}e${ep}${dt}z0")
        if [ -z "$s0" ] || [ "$s0" != "$(sample_of "s${n}e${ep}${dt}z$z")" ]; then
            smp="samples differ or are missing"
        fi
        case "$v|$c|$smp" in
            "ok "*"|ok "*"|ok") ok "$what: losses bit for bit ($v), weights and moments bit for bit ($c), same sample";;
            *) bad "$what" "log: $v" "checkpoint: $c" "sample: $smp";;
        esac
    done
done

echo "# section 2 at ${SECONDS}s"
# ---- 2. gradient accumulation: ZeRO-1 reduces once (bitwise); ZeRO-2 and 3 each micro-batch (another order).
#      The sharded runs replay --zero 0's MoE routing (--routing-record/--routing-replay): another
#      order of sums could decide a near-tie of the top-k or the bias update's sign the other way.
#      Within 1e-4, not tighter: the gradient norm is of a sum of four gradients (2 ranks x 2
#      micro-batches) that come to cancel as training goes on, so the summation order's rounding
#      grows relative to it. Under avx2 the norms differed by at most 3e-8, 4e-7 and 1.4e-6 in
#      steps 1-10, 11-20 and 21-30 (the losses and validations bit for bit); before a dot in the
#      backward changed its summation order, by 3e-8, 7e-7 and 3e-7: a bound of 1e-6 passed or
#      failed on the rounding of one run. A micro-batch's gradient missed or counted twice moves
#      the norm by 10% or more.
run acc0 "${TINY[@]}" --steps 30 --nproc 2 --accum 2 --routing-record "$work/acc_routes.bin"
for z in 1 2 3; do
    run "acc$z" "${TINY[@]}" --steps 30 --nproc 2 --accum 2 --zero "$z" --routing-replay "$work/acc_routes.bin"
    tol=1e-4; [ "$z" -eq 1 ] && tol=0
    what="--zero $z --accum 2 at 2 ranks: $( [ "$z" -eq 1 ] && echo "bit for bit" || echo "within 1e-4") of --zero 0"
    ran acc0 "$what" && ran "acc$z" "$what" || continue
    v=$(same_log acc0 "acc$z" "$tol")
    case $v in ok*) ok "$what ($v)";; *) bad "$what" "$v";; esac
done

echo "# section 3 at ${SECONDS}s"
# ---- 3. resume at another data-parallel size, as the unsharded run resumes
for cfg in "4 2 2 3" "2 3 3 1" "3 1 1 2"; do
    set -- $cfg; n1=$1; z1=$2; n2=$3; z2=$4
    what="--zero $z1 checkpoint at $n1 ranks resumed by --zero $z2 at $n2: continues as --zero 0 does"
    for mode in ref zero; do
        a=$z1; b=$z2; [ $mode = ref ] && a=0 && b=0
        run "r${n1}${n2}${mode}a" "${TINY[@]}" --steps 20 --stop-at 10 --nproc "$n1" --zero "$a" --ckpt-dir "$work/r${n1}${n2}$mode"
        run "r${n1}${n2}${mode}b" "${TINY[@]}" --steps 20 --nproc "$n2" --zero "$b" --ckpt-dir "$work/r${n1}${n2}$mode" --resume
    done
    ran "r${n1}${n2}refa" "$what" && ran "r${n1}${n2}zeroa" "$what" && ran "r${n1}${n2}refb" "$what" &&
        ran "r${n1}${n2}zerob" "$what" || continue
    if ! grep -q "resum" "$work/r${n1}${n2}zerob.out"; then bad "$what" "the second run did not say it resumed"; continue; fi
    v=$(same_log "r${n1}${n2}refb" "r${n1}${n2}zerob")
    c=$(same_ckpt "$work/r${n1}${n2}ref" "$work/r${n1}${n2}zero")
    case "$v $c" in "ok "*" ok "*) ok "$what ($v; final checkpoints $c)";; *) bad "$what" "log: $v" "checkpoint: $c";; esac
done

echo "# section 4 at ${SECONDS}s"
# Sections 4, 5 and 7 compare within loose bounds, count bytes or run the emulated GPU: no CPU
# kernel's bits decide them, so run_tests.sh's re-run under another ISA (ISA_RERUN=1) skips them.
if [ -z "${ISA_RERUN:-}" ]; then
# ---- 4. compression on all of the corpus (473 KB): validation loss within 3%, bytes cut as expected
P=(--seq 32 --d-model 32 --heads 2 --layers 3 --dense-layers 1 --ffn-hidden 64 --experts 4 --top-k 2
   --expert-hidden 32 --shared 1 --batch 8 --lr 3e-3 --warmup 5 --data "$CORPUS" --val-every 10
   --val-interval 50 --val-batches 4 --sample-len 0 --peak-tflops 0.1 --steps 150 --nproc 2)
run comp_none "${P[@]}"
for c in powersgd:4 bf16; do
    name=comp_${c%%:*}
    run "$name" "${P[@]}" --grad-compress "$c"
    ran comp_none "--grad-compress $c" && ran "$name" "--grad-compress $c" || continue
    # PowerSGD's expectation from the banner: plain passes before START, then comp of full elements
    expect=$(sed -n 's/.*zero: .* from pass \([0-9]*\): \([0-9]*\) of \([0-9]*\) elements.*/\1 \2 \3/p' "$work/$name.out")
    [ "$c" = bf16 ] && expect="0 1 2"
    verdict=$($PY - "$work/comp_none.jsonl" "$work/$name.jsonl" $expect <<'EOF'
import json, sys
def rows(p): return [json.loads(l) for l in open(p)]
a, b = rows(sys.argv[1]), rows(sys.argv[2])
if len(sys.argv) < 6: print("no expected factor in the banner"); sys.exit()
start, comp, full = int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
va = [r["val_loss"] for r in a if r["type"] == "val"][-1]
vb = [r["val_loss"] for r in b if r["type"] == "val"][-1]
problems = []
if not vb <= va * 1.03: problems.append("validation loss %.4f against %.4f uncompressed (> 3%%)" % (vb, va))
sa = [r for r in a if r["type"] == "step"]
sb = [r for r in b if r["type"] == "step"]
if len(sa) != len(sb) or not sa: problems.append("%d and %d steps" % (len(sa), len(sb)))
for r0, r in zip(sa, sb):
    if r["reduce_bytes_uncompressed"] != r0["reduce_bytes"]:
        problems.append("step %d: uncompressed %s, --grad-compress none moved %s"
                        % (r["step"], r["reduce_bytes_uncompressed"], r0["reduce_bytes"]))
        break
    want = r0["reduce_bytes"] * (comp / full if r["step"] > start else 1.0)
    if abs(r["reduce_bytes"] - want) > 1e-9 * want:
        problems.append("step %d: %s bytes, want %.0f" % (r["step"], r["reduce_bytes"], want))
        break
if not full / comp > 1.5: problems.append("expected factor %.3f" % (full / comp))
last0, last = sa[-1]["reduce_bytes"], sb[-1]["reduce_bytes"]
print("; ".join(problems) if problems else
      "ok validation loss %.4f vs %.4f uncompressed (%+.2f%%); %.0f vs %.0f bytes per step and rank (%.3fx fewer, "
      "expected %.3fx)" % (vb, va, 100 * (vb / va - 1), last, last0, last0 / last, full / comp))
EOF
)
    case $verdict in ok*) ok "--grad-compress $c, 150 steps at 2 ranks: ${verdict#ok }";; *) bad "--grad-compress $c" "$verdict";; esac
done
# FP8 (e4m3 codes, 1x128 f32 scales; stage 0: all-to-all then all-gather), with and without error
# feedback: the validation loss within 1% of uncompressed (a third of the 3% allowed above: half an
# e4m3 spacing is 2^-4 of a value, bf16's 2^-8); the bytes handed over between 3.5x and 4x fewer
# than f32 (4 / (1 + 4/128) = 3.88 for whole tiles; a unit's last tile and its chunks' padding cost
# a little); the uncompressed figure the f32 run's.
for c in fp8 fp8:ef; do
    name=comp_${c/:/_}
    run "$name" "${P[@]}" --grad-compress "$c"
    ran comp_none "--grad-compress $c" && ran "$name" "--grad-compress $c" || continue
    verdict=$($PY - "$work/comp_none.jsonl" "$work/$name.jsonl" <<'EOF'
import json, sys
def rows(p): return [json.loads(l) for l in open(p)]
a, b = rows(sys.argv[1]), rows(sys.argv[2])
va = [r["val_loss"] for r in a if r["type"] == "val"][-1]
vb = [r["val_loss"] for r in b if r["type"] == "val"][-1]
sa = [r for r in a if r["type"] == "step"]
sb = [r for r in b if r["type"] == "step"]
problems = []
if not abs(vb / va - 1) <= 0.01: problems.append("validation loss %.4f against %.4f uncompressed (> 1%%)" % (vb, va))
if len(sa) != len(sb) or not sa: problems.append("%d and %d steps" % (len(sa), len(sb)))
for r0, r in zip(sa, sb):
    f = r["reduce_bytes_uncompressed"] / r["reduce_bytes"]
    if r["reduce_bytes_uncompressed"] != r0["reduce_bytes"] or not 3.5 < f <= 4.0:
        problems.append("step %d: %s bytes, uncompressed %s (f32 run: %s)"
                        % (r["step"], r["reduce_bytes"], r["reduce_bytes_uncompressed"], r0["reduce_bytes"]))
        break
print("; ".join(problems) if problems else
      "ok validation loss %.4f vs %.4f uncompressed (%+.3f%%); %.0f vs %.0f bytes per step and rank (%.3fx fewer)"
      % (vb, va, 100 * (vb / va - 1), sb[-1]["reduce_bytes"], sa[-1]["reduce_bytes"],
         sa[-1]["reduce_bytes"] / sb[-1]["reduce_bytes"]))
EOF
)
    case $verdict in ok*) ok "--grad-compress $c, 150 steps at 2 ranks: ${verdict#ok }";; *) bad "--grad-compress $c" "$verdict";; esac
done

echo "# section 5 at ${SECONDS}s"
# ---- 5. memory per rank at start (parameters, gradients, optimizer state, activations), 4 ranks
M=(--seq 32 --d-model 32 --heads 2 --layers 8 --dense-layers 1 --ffn-hidden 64 --experts 4 --top-k 2
   --expert-hidden 32 --shared 1 --batch 12 --data "$CORPUS" --corpus-mb 0.3 --val-every 10 --val-batches 1
   --sample-len 0 --peak-tflops 0.1 --steps 1 --nproc 4)
for z in 0 1 2 3; do run "mem$z" "${M[@]}" --zero "$z"; done
if ran mem0 "memory lines" && ran mem1 "memory lines" && ran mem2 "memory lines" && ran mem3 "memory lines"; then
    verdict=$($PY - "$work"/mem0.out "$work"/mem1.out "$work"/mem2.out "$work"/mem3.out <<'EOF'
import re, sys
pat = re.compile(r"memory, rank (\d+): parameters ([\d.]+) MiB, gradients ([\d.]+) MiB, optimizer state ([\d.]+) MiB, "
                 r"compression buffers ([\d.]+) MiB, activations \(high-water mark\) ([\d.]+) MiB")
def lines(p):
    return {int(m.group(1)): [float(x) * 1048576 for x in m.groups()[1:]] for m in map(pat.search, open(p)) if m}
z = [lines(p) for p in sys.argv[1:5]]
# the model's units (f32: the dense object and the expert object), elements: V 256, D 32, F 64, 4 experts of 32,
# 1 shared expert of 32, 8 blocks (1 dense)
V, D, F, E, Fe = 256, 32, 64, 4, 32
dense_units = [V * D, 2 * D + 4 * D * D + 3 * F * D, 2 * D + 4 * D * D + E * D + 3 * Fe * D, D + V * D]
expert_unit = E * 3 * Fe * D
two_units = 2 * 4 * (max(dense_units) + expert_unit)   # two gather / gradient buffers of each object, f32
chunk = 4 * (max(dense_units) + expert_unit) // 4 + 8  # ZeRO-2/3: one chunk of the largest unit per object, the
                                                       # reduce-scatter's landing place
scratch = 4 * E * Fe * D                               # the MoE layers' stand-in gradient while theirs do not exist
pad = 4 * 4 * 3 * (len(dense_units) + 8)               # < 4 padding elements per unit, 3 f32 arrays
problems = []
if any(sorted(x) != [0, 1, 2, 3] for x in z):
    problems.append("not every rank printed its memory: %s" % [sorted(x) for x in z])
else:
    for r in range(4):
        p0, g0, o0, c0, a0 = z[0][r]
        for what, got, whole, extra in (("--zero 1 optimizer", z[1][r][2], o0, pad),
                                        ("--zero 2 gradients", z[2][r][1], g0, two_units + chunk + scratch + pad),
                                        ("--zero 3 parameters", z[3][r][0], p0, two_units)):
            if not got <= whole / 4 + extra:
                problems.append("rank %d: %s %.0f B > %.0f / 4 + %d" % (r, what, got, whole, extra))
        if not (z[3][r][0] < p0 and z[2][r][1] < g0): problems.append("rank %d: no saving" % r)
        if not (0 < z[1][r][4] == z[2][r][4] == z[3][r][4] <= a0):
            problems.append("rank %d: activations %s" % (r, [x[r][4] for x in z]))
f = lambda v: "%.3f" % (v / 1048576)
print("; ".join(problems) if problems else
      "ok rank 0, MiB: optimizer %s -> %s (--zero 1), gradients %s -> %s (--zero 2), parameters %s -> %s (--zero 3); "
      "activations %s" % (f(z[0][0][2]), f(z[1][0][2]), f(z[0][0][1]), f(z[2][0][1]), f(z[0][0][0]), f(z[3][0][0]),
                          f(z[3][0][4])))
EOF
)
    case $verdict in ok*) ok "each rank prints its memory at start (4 ranks, 8 blocks): ${verdict#ok }";; *) bad "memory lines" "$verdict";; esac
fi

echo "# section 6 at ${SECONDS}s"
fi  # ISA_RERUN

# ---- 6. errors: bad flags, a checkpoint of the other format, --grad-check, --cuda-graph
expect_fail() { # NAME TEXT ARGS...: exits non-zero with TEXT in its output
    local name=$1 text=$2; shift 2
    run "$name" "$@"
    if [ "$(rc "$name")" -ne 0 ] && grep -qF -- "$text" "$work/$name.out"; then ok "$name fails cleanly: $text"
    else bad "$name fails cleanly" "exit $(rc "$name")" "$(tail -2 "$work/$name.out")"; fi
}
expect_fail bad_zero "--zero 5: use 0, 1, 2 or 3" "${TINY[@]}" --steps 1 --zero 5
expect_fail bad_compress "--grad-compress \"powersgd:0\": use none, bf16, fp8, fp8:ef or powersgd:R[:START]" "${TINY[@]}" --steps 1 --grad-compress powersgd:0
expect_fail bad_compress2 "--grad-compress \"zip\"" "${TINY[@]}" --steps 1 --grad-compress zip
expect_fail bad_compress3 "--grad-compress \"powersgd:2:x\"" "${TINY[@]}" --steps 1 --grad-compress powersgd:2:x
expect_fail bad_compress4 "--grad-compress \"fp8:x\"" "${TINY[@]}" --steps 1 --grad-compress fp8:x
expect_fail bad_check "--grad-check needs --dtype f32, one rank, the CPU and --zero 0 --grad-compress none" "${TINY[@]}" --steps 1 --zero 2 --grad-check 2
expect_fail bad_graph "--cuda-graph runs without --zero and --grad-compress" "${TINY[@]}" --steps 1 --zero 1 --cuda-graph
# every stage saves the same names and global shapes (boxes of the full tensors), so a --zero 0
# checkpoint resumes at --zero 2 and a --zero 3 one at --zero 0, each continuing bit for bit as the
# run that did not stop (2 ranks, one micro-batch: the stages give the same bits)
run mix_s "${TINY[@]}" --steps 20 --nproc 2 --zero 0 --log "$work/mix_s.jsonl"
for pair in "0 2" "3 0"; do
    set -- $pair
    run "mix$1$2a" "${TINY[@]}" --steps 20 --stop-at 10 --nproc 2 --zero "$1" --ckpt-dir "$work/mix$1$2"
    run "mix$1$2b" "${TINY[@]}" --steps 20 --nproc 2 --zero "$2" --ckpt-dir "$work/mix$1$2" --resume --log "$work/mix$1$2b.jsonl"
    what="a --zero $1 checkpoint at step 10 resumes at --zero $2 and steps 11-20 equal the straight run bit for bit"
    ran mix_s "$what" && ran "mix$1$2a" "$what" && ran "mix$1$2b" "$what" || continue
    v=$($PY - "$work/mix_s.jsonl" "$work/mix$1$2b.jsonl" <<'EOF'
import json, sys
def steps(p): return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, open(p)) if r["type"] == "step"}
a, b = steps(sys.argv[1]), steps(sys.argv[2])
print("ok" if sorted(b) == list(range(11, 21)) and all(a[k] == b[k] for k in b) else
      "off: steps %s, first difference %s" % (sorted(b)[:3], next(((k, a.get(k), b[k]) for k in sorted(b) if a.get(k) != b[k]), None)))
EOF
)
    if [ "$v" = ok ] && grep -q "resum" "$work/mix$1$2b.out"; then ok "$what"; else bad "$what" "$v"; fi
done

echo "# section 7 at ${SECONDS}s"
if [ -z "${ISA_RERUN:-}" ]; then
# ---- 7. the CUDA path on the emulated GPU (tests/cuda_emu: kernels, nccl, streams and events on the CPU):
# 2 ranks (1 data x 2 expert), bf16: --zero 1, 2 and 3 log --zero 0's losses and norms bit for bit; the
# --zero 2 checkpoint resumed by --zero 3 on one rank continues as --zero 0's resumed by --zero 0;
# PowerSGD, CPU-only, fails with the library's message.
EMU_BIN=$BUILD/emu/examples/train_moe
if [ "${EMULATE:-1}" = 0 ]; then
    echo "skip the emulated GPU is not built (EMULATE=0)"; skipped=$((skipped + 1))
elif ! make --no-print-directory -s BUILD="$BUILD" "$EMU_BIN" >"$work/emu_build.log" 2>&1; then
    cat "$work/emu_build.log"; bad "build $EMU_BIN" "make failed"
else
    G=(--seq 16 --d-model 32 --heads 2 --layers 3 --dense-layers 1 --ffn-hidden 32 --experts 4 --top-k 2
       --expert-hidden 16 --shared 1 --batch 4 --lr 3e-3 --warmup 2 --data "$CORPUS" --corpus-mb 0.05 --val-every 10
       --val-interval 3 --val-batches 1 --sample-len 0 --peak-tflops 0.1 --device cuda --dtype bf16)
    BIN_SAVED=$BIN; BIN=$EMU_BIN
    for z in 0 1 2 3; do run "g$z" "${G[@]}" --steps 6 --nproc 2 --ep 2 --zero "$z" --ckpt-dir "$work/g$z"; done
    for z in 0 3; do
        from=$z; [ "$z" -eq 3 ] && from=2
        run "g${z}r" "${G[@]}" --steps 9 --zero "$z" --ckpt-dir "$work/g$from" --resume
    done
    expect_fail g_psgd "PowerSGD runs on CPU tensors only" "${G[@]}" --steps 1 --grad-compress powersgd:2
    BIN=$BIN_SAVED
    for z in 1 2 3; do
        what="emulated GPU, 2 ranks (1 data x 2 expert), bf16: --zero $z equals --zero 0"
        ran g0 "$what" && ran "g$z" "$what" || continue
        if ! grep -q "memory, rank 1: " "$work/g$z.out"; then bad "$what" "rank 1 printed no memory line"; continue; fi
        v=$(same_log g0 "g$z")
        case $v in ok*) ok "$what ($v)";; *) bad "$what" "$v";; esac
    done
    what="emulated GPU: the --zero 2 checkpoint of 2 ranks resumed by --zero 3 on 1 rank continues as --zero 0 does"
    if ran g0r "$what" && ran g3r "$what"; then
        v=$(same_log g0r g3r)
        case $v in ok*) ok "$what ($v)";; *) bad "$what" "$v";; esac
    fi
fi

fi  # ISA_RERUN
finish
