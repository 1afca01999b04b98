#!/usr/bin/env bash
# --pair-micro-batches figures of examples/train_moe.c (issue 31's overlap across micro-batches): the
# step time and communication share of expert-parallel layouts with each steady forward paired with
# the backward after it (one micro-batch's expert exchange on the layer's thread while the other
# computes), against the same layout unpaired (the peer, measured in the same run, alternating
# rounds so that the machine's load falls on both alike). CPU ranks over the host backend: shared memory
# on one host, or TCP between two emulated hosts (DSK_HOST_ID per process, launched as torchrun would).
# comm share = seconds inside dsk_comm calls / step time on rank 0.
# LINK_GBPS=G: every communicator on an emulated link of G GB/s (dsk_comm_opts.link_gbps, DSK_LINK_GBPS: a call
# lasts at least its bytes over G, the rest slept on the calling thread, as a NIC moves bytes without the CPU),
# and each round also runs the unpaired layout without it: the link's time in the unpaired step (unpaired with
# the link - without) is the communication alone, and hidden = (unpaired - paired, both with the link) / that.
# Usage: bash bench/bench_pair.sh [STEPS] [ROUNDS]   (default 12 steps, the first 2 warm-up; 3 rounds).
# BENCH_ARGS="..." replaces the model flags (default: the trainer's default model). Not part of `make test`.
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
COMMON=(--steps "$STEPS" --sample-len 0 --val-interval 100000 --dtype f32 --device cpu --peak-tflops 0.1
        --ep-overlap on)
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
step_ms() { # JSONL: the median step ms and mean comm share (%) of steps 3..
    python3 - "$1" <<'EOF'
import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if r["type"] == "step"][2:]
print("%.2f %.2f" % (statistics.median(r["ms"] for r in rows), 100 * statistics.mean(r["comm_share"] for r in rows)))
EOF
}
LINK=${LINK_GBPS:-}
KS="0 1"
[ -n "$LINK" ] && KS="0 1 2" && echo "emulated link: $LINK GB/s on every communicator (DSK_LINK_GBPS)"
echo
echo "| layout | unpaired step ms | paired step ms | comm share % unpaired / paired | paired / unpaired |${LINK:+ unpaired without the link ms | hidden |}"
echo "| --- | --- | --- | --- | --- |${LINK:+ --- | --- |}"
i=0
for spec in "${LAYOUTS[@]}"; do
    IFS='|' read -r name n hosts plain pair <<<"$spec"
    i=$((i + 1))
    ms0=() ms1=() ms2=() c0=() c1=() fail=""
    for r in $(seq "$ROUNDS"); do
        for k in $KS; do
            f=$plain; [ $k = 1 ] && f=$pair
            # shellcheck disable=SC2086
            DSK_LINK_GBPS=$([ $k = 2 ] || echo "$LINK") launch "$n" "$hosts" "$work/$i.$r.$k.jsonl" "${MODEL[@]}" \
                "${COMMON[@]}" $f >"$work/$i.$r.$k.out" 2>&1 ||
                fail="exit $?: $(grep -m1 -E 'rank .*: ' "$work/$i.$r.$k.out" | cut -c1-100)"
            [ -n "$fail" ] && break 2
            read -r ms cs < <(step_ms "$work/$i.$r.$k.jsonl")
            case $k in 0) ms0+=("$ms"); c0+=("$cs") ;; 1) ms1+=("$ms"); c1+=("$cs") ;; 2) ms2+=("$ms") ;; esac
        done
    done
    if [ -n "$fail" ]; then echo "| $name | failed ($fail) | | | |"; continue; fi
    a=$(median "${ms0[@]}"); b=$(median "${ms1[@]}")
    extra=""
    if [ -n "$LINK" ]; then
        z=$(median "${ms2[@]}")
        extra=" $z | $(python3 -c "print('%.0f%%' % (100 * ($a - $b) / ($a - $z)) if $a > $z else 'n/a')") |"
    fi
    echo "| $name | $a | $b | $(median "${c0[@]}") / $(median "${c1[@]}") | $(python3 -c "print('%.3f' % ($b / $a))") |$extra"
done
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
