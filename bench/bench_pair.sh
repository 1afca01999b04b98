#!/usr/bin/env bash
# --pair-micro-batches figures of examples/train_moe.c (issue 31's overlap across micro-batches): for expert-parallel
# layouts, in alternating rounds (the machine's load falls on all alike), the step with the expert exchanges serial
# (--ep-overlap off: the peer, and the communication alone: the time inside the expert-parallel communicator's calls,
# the step log's ep_comm_ms), overlapped in the layer (--ep-overlap on: the shared expert beside the dispatch),
# chunked (--ep-overlap chunked: the routed experts on this rank's own rows, then on each rank's as they land),
# paired (--pair-micro-batches: one micro-batch's exchanges in flight while the other computes) and
# paired and chunked. The hidden share of each is (serial step - its step) / the serial exchanges' time, as
# bench_moe_ep reports it for the layer alone. CPU ranks over the host backend: shared memory on one host, or TCP
# between two emulated hosts (DSK_HOST_ID per process, launched as torchrun would).
# LINK_GBPS=G: every communicator on an emulated link of G GB/s (dsk_comm_opts.link_gbps, DSK_LINK_GBPS: a call
# lasts at least its bytes over G, the rest slept on the calling thread, as a NIC moves bytes without the CPU; across
# emulated hosts only the bytes between them take it, and the TCP layout puts each rank on a host of its own).
# Usage: bash bench/bench_pair.sh [STEPS] [ROUNDS]   (default 12 steps, the first 2 warm-up; 3 rounds).
# BENCH_ARGS="..." replaces the model flags (default: the trainer's default model); ONLY=REGEX keeps the layouts
# whose name matches (e.g. ONLY=pp2 the pipeline schedules). Not part of `make test`.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
BIN=$BUILD/examples/train_moe
STEPS=${1:-12}
ROUNDS=${2:-3}
make --no-print-directory -s BUILD="$BUILD" "$BIN" || exit 1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
read -r -a MODEL <<<"${BENCH_ARGS:-}"
COMMON=(--steps "$STEPS" --sample-len 0 --val-interval 100000 --dtype f32 --device cpu --peak-tflops 0.1)
flags=$(grep -m1 '^flags' /proc/cpuinfo)
isa=$(for f in avx2 avx512f; do case " $flags " in *" $f "*) printf '%s ' "$f" ;; esac; done)
echo "machine: $(getconf _NPROCESSORS_ONLN) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); ${isa:-no avx2}), load average" \
     "$(cut -d' ' -f1-3 /proc/loadavg), $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "model: ${MODEL[*]:-the default model}; 1 thread a rank; $STEPS steps, median of steps 3..$STEPS, median of $ROUNDS rounds"

# name | ranks | hosts | unpaired flags | paired flags
LAYOUTS=(
    "dp2 x ep2, 2 micro-batches|2|1|--ep 2 --accum 2 --batch 8|--ep 2 --micro-batches 2 --batch 16 --pair-micro-batches"
    "dp2 x ep2, 8 micro-batches|2|1|--ep 2 --accum 8 --batch 2|--ep 2 --micro-batches 8 --batch 16 --pair-micro-batches"
    "dp2 x ep2, 2 micro-batches, TCP|2|2|--ep 2 --accum 2 --batch 8|--ep 2 --micro-batches 2 --batch 16 --pair-micro-batches"
    "pp2 x ep2, 1f1b, m 4|4|1|--pp 2 --ep 2 --micro-batches 4|--pp 2 --ep 2 --micro-batches 4 --pair-micro-batches"
    "pp2 x ep2, interleaved v2, m 4|4|1|--pp 2 --ep 2 --micro-batches 4 --pp-schedule interleaved --virtual-stages 2|--pp 2 --ep 2 --micro-batches 4 --pp-schedule interleaved --virtual-stages 2 --pair-micro-batches"
    "pp2 x ep2, dualpipev, m 4|4|1|--pp 2 --ep 2 --micro-batches 4 --pp-schedule dualpipev|--pp 2 --ep 2 --micro-batches 4 --pp-schedule dualpipev --pair-micro-batches"
    "pp2 x ep2, interleaved v2, m 8|4|1|--pp 2 --ep 2 --micro-batches 8 --pp-schedule interleaved --virtual-stages 2|--pp 2 --ep 2 --micro-batches 8 --pp-schedule interleaved --virtual-stages 2 --pair-micro-batches"
    "pp2 x ep2, dualpipev, m 8|4|1|--pp 2 --ep 2 --micro-batches 8 --pp-schedule dualpipev|--pp 2 --ep 2 --micro-batches 8 --pp-schedule dualpipev --pair-micro-batches"
)
launch() { # RANKS HOSTS LOG ARGS...: one run; on HOSTS > 1 the ranks split over emulated hosts, rank 0's log
    local n=$1 hosts=$2 log=$3 port=$((29500 + RANDOM % 2000)) r rc=0; shift 3
    if [ "$hosts" = 1 ]; then timeout 900 "$BIN" "$@" --nproc "$n" --log "$log"; return; fi
    for r in $(seq 0 $((n - 1))); do
        RANK=$r WORLD_SIZE=$n LOCAL_RANK=$((r % (n / hosts))) LOCAL_WORLD_SIZE=$((n / hosts)) MASTER_ADDR=127.0.0.1 \
            MASTER_PORT=$port DSK_HOST_ID=host$((r / (n / hosts))) timeout 900 "$BIN" "$@" --log "$log.$r" &
    done
    for r in $(seq 0 $((n - 1))); do wait -n || rc=$?; done
    mv "$log.0" "$log"
    return $rc
}
median() { python3 -c "import statistics, sys; print('%.1f' % statistics.median(map(float, sys.argv[1:])))" "$@"; }
step_ms() { # JSONL: the median step ms and expert-parallel communicator ms of steps 3..
    python3 - "$1" <<'EOF'
import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if r["type"] == "step"][2:]
print("%.2f %.2f" % (statistics.median(r["ms"] for r in rows), statistics.median(r["ep_comm_ms"] for r in rows)))
EOF
}
unset DSK_LINK_GBPS
if [ -n "${LINK_GBPS:-}" ]; then
    export DSK_LINK_GBPS=$LINK_GBPS
    echo "emulated link: $LINK_GBPS GB/s on every communicator (DSK_LINK_GBPS)"
fi
hidden() { # SERIAL_MS SERIAL_EXCHANGES_MS STEP_MS: the share of the serial exchanges' time the step hid
    python3 -c "import sys; s, c, x = map(float, sys.argv[1:]); print('%.0f%%' % (100 * (s - x) / c) if c > 0 else 'n/a')" "$@"
}
echo
echo "| layout | serial step ms | serial exchanges ms | step ms: overlapped / chunked / paired / paired, chunked |" \
     "hidden: overlapped / chunked / paired / paired, chunked |"
echo "| --- | --- | --- | --- | --- |"
i=0
for spec in "${LAYOUTS[@]}"; do
    IFS='|' read -r name n hosts plain pair <<<"$spec"
    i=$((i + 1))
    [[ $name =~ ${ONLY:-.} ]] || continue
    modes=("$plain --ep-overlap off" "$plain --ep-overlap on" "$plain --ep-overlap chunked" "$pair --ep-overlap on"
           "$pair --ep-overlap chunked")
    ms=("" "" "" "" "") c0="" fail=""
    for r in $(seq "$ROUNDS"); do
        for k in 0 1 2 3 4; do
            f=${modes[k]}
            # shellcheck disable=SC2086
            launch "$n" "$hosts" "$work/$i.$r.$k.jsonl" "${MODEL[@]}" "${COMMON[@]}" $f >"$work/$i.$r.$k.out" 2>&1 ||
                fail="exit $?: $(grep -m1 -E 'rank .*: ' "$work/$i.$r.$k.out" | cut -c1-100)"
            [ -n "$fail" ] && break 2
            read -r m cs < <(step_ms "$work/$i.$r.$k.jsonl")
            ms[k]+=" $m"
            [ "$k" = 0 ] && c0+=" $cs"
        done
    done
    if [ -n "$fail" ]; then echo "| $name | failed ($fail) | | | |"; continue; fi
    # shellcheck disable=SC2086
    a=$(median ${ms[0]}) c=$(median $c0) steps=() shares=()
    for k in 1 2 3 4; do
        # shellcheck disable=SC2086
        steps+=("$(median ${ms[k]})")
        shares+=("$(hidden "$a" "$c" "${steps[k - 1]}")")
    done
    echo "| $name | $a | $c | ${steps[0]} / ${steps[1]} / ${steps[2]} / ${steps[3]} |" \
         "${shares[0]} / ${shares[1]} / ${shares[2]} / ${shares[3]} |"
done
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
