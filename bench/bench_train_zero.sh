#!/usr/bin/env bash
# examples/train_moe.c under --zero 0, 1, 2 and 3 at N ranks (host backend, one thread each):
# median step time and CPU time (process CPU time of rank 0, all its threads: what a loaded
# machine disturbs least), steps after the warm-up, and each stage's per-rank memory as
# the trainer prints it at start (the allocator's figures), with ZeRO-0 (every rank holds and
# steps everything) as the peer in the same run. The stages run in rounds (0 1 2 3, then
# 3 2 1 0, ...) so a load change on a shared machine touches every stage alike.
#   bench/bench_train_zero.sh [NPROC [STEPS [ROUNDS]]]     (defaults 4, 30, 2)
# Extra trainer flags go in TRAIN_ARGS (they override the model below).
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
BIN=$BUILD/examples/train_moe
N=${1:-4} STEPS=${2:-30} ROUNDS=${3:-2}
make --no-print-directory -s BUILD="$BUILD" "$BIN" || exit 1
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
MODEL=(--seq 64 --d-model 128 --heads 4 --layers 8 --dense-layers 1 --ffn-hidden 512 --experts 8 --top-k 2
       --expert-hidden 128 --shared 1 --batch 16 --corpus-mb 1 --val-interval 100000 --val-batches 1
       --sample-len 0 --peak-tflops 0.1 --warmup 5)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "# $(date -u '+%F %H:%M UTC'), $(getconf _NPROCESSORS_ONLN) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg); $N ranks, $STEPS steps x $ROUNDS rounds"
echo "# $BIN ${MODEL[*]} --steps $STEPS --nproc $N --zero Z ${TRAIN_ARGS:-}"
for r in $(seq 1 "$ROUNDS"); do
    order="0 1 2 3"; [ $((r % 2)) -eq 0 ] && order="3 2 1 0"
    for z in $order; do
        "$BIN" "${MODEL[@]}" --steps "$STEPS" --nproc "$N" --zero "$z" ${TRAIN_ARGS:-} --log "$work/z$z.r$r.jsonl" \
            >"$work/z$z.r$r.out" 2>&1 || { echo "--zero $z failed:"; tail -5 "$work/z$z.r$r.out"; exit 1; }
    done
done
python3 - "$work" "$ROUNDS" <<'EOF'
import json, re, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
pat = re.compile(r"memory, rank 0: parameters ([\d.]+) MiB, gradients ([\d.]+) MiB, optimizer state ([\d.]+) MiB, "
                 r"compression buffers ([\d.]+) MiB, activations \(high-water mark\) ([\d.]+) MiB")
rows = {}
for z in range(4):
    ms, cpu = [], []
    for r in range(1, rounds + 1):
        steps = [json.loads(l) for l in open("%s/z%d.r%d.jsonl" % (work, z, r))]
        ms += [s["ms"] for s in steps if s["type"] == "step"][5:]   # after the warm-up
        cpu += [s["cpu_ms"] for s in steps if s["type"] == "step"][5:]
        mem = [list(map(float, m.groups())) for m in map(pat.search, open("%s/z%d.r%d.out" % (work, z, r))) if m][0]
    rows[z] = (statistics.median(ms), statistics.median(cpu), mem)
print("| stage | step ms (median) | vs ZeRO-0 | CPU ms/step, rank 0 | vs ZeRO-0 | parameters MiB | gradients MiB | "
      "optimizer MiB | activations MiB | total MiB |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for z in range(4):
    ms, cpu, m = rows[z]
    print("| ZeRO-%d | %.1f | %.2fx | %.1f | %.2fx | %.3f | %.3f | %.3f | %.3f | %.3f |"
          % (z, ms, ms / rows[0][0], cpu, cpu / rows[0][1], m[0], m[1], m[2], m[4], m[0] + m[1] + m[2] + m[3] + m[4]))
EOF
