#!/usr/bin/env bash
# Operations figures of examples/train_moe.c at its default configuration (what `make run` trains):
#   1. the share of step time spent waiting for data, with the loader thread (--prefetch 4, the
#      default) against reading in the step (--prefetch 0, the peer), on 1 rank and on 2 ranks;
#   2. the time from SIGTERM to the exit of a pre-empted run, against its step time;
#   3. the time from a SIGKILLed rank to the first step of the restarted job (--nproc 2
#      --max-restarts 1), against a cold start of the same job.
# Usage: bash bench/bench_ops.sh [STEPS]   (STEPS per run, default 12; BENCH_ARGS="..." adds trainer
# flags, e.g. a smaller model). Not part of `make test`.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
BIN=$BUILD/examples/train_moe
STEPS=${1:-12}
make --no-print-directory -s BUILD="$BUILD" "$BIN" || exit 1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_WAIT_POLICY=passive
# Two ranks share the machine's cores: --bind core gives each its own (and sets its threads).
COMMON=(--steps "$STEPS" --sample-len 0 --val-interval 100000 ${BENCH_ARGS:-})
echo "machine: $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg), $(date -u '+%Y-%m-%d %H:%M UTC')"

now() { date +%s.%N; }
# wait_line FILE REGEX: polls every 10 ms until FILE has a matching line; prints the time it saw it
wait_line() {
    while ! grep -qE -e "$2" "$1" 2>/dev/null; do sleep 0.01; done
    now
}
# data wait share and mean wait per step from the JSONL log (steps after the first, which warms up)
data_share() {
    python3 - "$1" <<'EOF'
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if r["type"] == "step"][1:]
ms = sum(r["ms"] for r in rows); wait = sum(r["data_wait_ms"] for r in rows)
print("%.4f%% %.4f %.1f" % (100 * wait / ms, wait / len(rows), ms / len(rows)))
EOF
}

echo "== 1. data wait (share of step time, mean wait per step, mean step time)"
for ranks in 1 2; do
    extra=()
    [ "$ranks" -gt 1 ] && extra=(--nproc "$ranks" --bind core)
    for depth in 4 0; do
        "$BIN" "${COMMON[@]}" "${extra[@]}" --prefetch $depth --log "$work/d$ranks$depth.jsonl" >"$work/d$ranks$depth.out" 2>&1 ||
            { echo "run failed:"; tail -3 "$work/d$ranks$depth.out"; exit 1; }
        read -r share wait step < <(data_share "$work/d$ranks$depth.jsonl")
        eval "w$depth=$wait"
        printf "  %d rank(s) --prefetch %d: data wait %s of step time, %s ms per step (step %s ms)\n" "$ranks" $depth "$share" "$wait" "$step"
    done
    python3 -c "import sys; a, b = map(float, sys.argv[1:3]); print('  wait with the loader thread / wait reading in the step: %.2f' % (a / b))" "$w4" "$w0"
done

echo "== 2. SIGTERM to exit (one rank, checkpoint to local disk)"
"$BIN" "${COMMON[@]}" --steps 100000 --ckpt-dir "$work/ck_term" --log "$work/term.jsonl" >"$work/term.out" 2>&1 &
pid=$!
wait_line "$work/term.jsonl" '"step":3,' >/dev/null
t0=$(now)
kill -TERM $pid
wait $pid
code=$?
t1=$(now)
step_ms=$(python3 -c "import json,sys; r=[x['ms'] for x in map(json.loads, open(sys.argv[1])) if x['type']=='step'][1:]; print('%.1f' % (sum(r)/len(r)))" "$work/term.jsonl")
python3 -c "import sys; t=float(sys.argv[2])-float(sys.argv[1]); s=float(sys.argv[3]); print('  exit %s: %.2f s from SIGTERM to exit, a step takes %.2f s: %.2f steps' % (sys.argv[4], t, s/1e3, t/(s/1e3)))" "$t0" "$t1" "$step_ms" "$code"
grep -E '^pre-empted' "$work/term.out" | sed 's/^/  /'

echo "== 3. restart after a SIGKILLed rank (--nproc 2 --bind core --max-restarts 1, checkpoint every 2 steps)"
t0=$(now)
"$BIN" "${COMMON[@]}" --nproc 2 --bind core --max-restarts 1 --ckpt-dir "$work/ck_kill" --ckpt-every 2 \
    --log "$work/kill.jsonl" >"$work/kill.out" 2>&1 &
pid=$!
t1=$(wait_line "$work/kill.jsonl" '"step":1,')
wait_line "$work/kill.jsonl" '"step":5,' >/dev/null
rank1=$(cut -d' ' -f2 "/proc/$pid/task/$pid/children")
tk=$(now)
kill -9 "$rank1"
wait_line "$work/kill.out" '^\[rank 0\] resume: step' >/dev/null
resumed_step=$(grep -oE '^\[rank 0\] resume: step [0-9]+' "$work/kill.out" | grep -oE '[0-9]+$')
tr=$(wait_line "$work/kill.out" "^\\[rank 0\\] step +$((resumed_step + 1))/")
wait $pid
code=$?
python3 -c "
import sys
t0, t1, tk, tr = map(float, sys.argv[1:5])
print('  exit %s: cold start to the first step %.2f s; SIGKILL to the first step after the restart %.2f s (resumed at step %s): ratio %.2f'
      % (sys.argv[5], t1 - t0, tr - tk, sys.argv[6], (tr - tk) / (t1 - t0)))" "$t0" "$t1" "$tk" "$tr" "$code" "$resumed_step"
grep -E 'the job failed' "$work/kill.out" | sed 's/^/  /'
