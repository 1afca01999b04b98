#!/usr/bin/env bash
# ThreadSanitizer on the programs that start threads; `make tsan` builds them into BUILD
# (default build-tsan: CUDA=0, -fsanitize=thread) and runs this. Which and why:
#   test_ckpt   async saves: the writer thread, the snapshot it copies, dsk_ckpt_wait, readers
#               (dsk_ckpt_verify, dsk_ckpt_latest) checking manifests while it writes one
#   test_comm   the host backend's progress and bucket threads, the shared-memory rings
#               between ranks, the store server, an all-to-all-v begun on one thread and
#               finished on another
#   train_moe   the loader thread (--prefetch), the metrics server (--metrics-port, scraped
#               while it trains), async checkpoints (--ckpt-every), the local launcher
#               with two ranks over shared memory (--nproc 2), and the MoE layers' exchange
#               thread handing each rank's rows over as they land and sending each chunk's
#               results as the layer releases them (--ep 4 --ep-overlap chunked), and that thread
#               exchanging one micro-batch's rows while the rank computes another's
#               (--pp 2 --ep 2 --pair-micro-batches; chunked, and with --ep-overlap on on one
#               stage, where the experts' results return on the thread too)
#   bench_moe_ep  every exchange variant of the MoE layer once, 4 ranks on two emulated hosts: the
#               exchange thread beside the compute for flat, chunked, bounded, two-hop and FP8
#               dispatch exchanges
# OpenMP: the OpenMP runtime (libgomp, or clang's libomp here) is not built with TSan, so TSan
# cannot see its barriers and reports every parallel region's hand-over as a race that is not
# there. OMP_NUM_THREADS=1 runs a region on the calling thread; regions with an explicit thread
# count (a checkpoint snapshot's copy threads) still start threads, and scripts/tsan.supp drops
# the reports with a frame inside the runtime. (TSan's ignore_noninstrumented_modules=1 would
# hide those too, but it leaves the trainer's signal thread, cancelled inside sigwait, "finished
# with ignores enabled", a fatal report.)
# Any TSan report fails its program (exitcode 66). Last line: `N passed, M failed, 0 skipped`.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-tsan}
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
export TSAN_OPTIONS="exitcode=66 halt_on_error=0 second_deadlock_stack=1 history_size=4 suppressions=$PWD/scripts/tsan.supp ${TSAN_OPTIONS:-}"
passed=0 failed=0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

check() { # name, command...: passes when the command exits 0 and TSan reported nothing
  local name=$1; shift
  local start=$SECONDS
  "$@" >"$work/out" 2>&1
  local rc=$?
  local races
  races=$(grep -c 'WARNING: ThreadSanitizer' "$work/out")
  if [ "$rc" -eq 0 ] && [ "$races" -eq 0 ]; then
    echo "ok   $name ($((SECONDS - start)) s)"; passed=$((passed + 1))
  else
    echo "FAIL $name: exit $rc, $races ThreadSanitizer report(s) ($((SECONDS - start)) s)"
    grep -A40 'WARNING: ThreadSanitizer' "$work/out" | head -200
    grep -E -A8 '^FAIL' "$work/out" | head -60; grep totals "$work/out"
    [ "$races" -eq 0 ] && tail -5 "$work/out"
    failed=$((failed + 1))
  fi
}

TINY=(--seq 32 --d-model 32 --heads 2 --layers 2 --dense-layers 1 --ffn-hidden 64 --experts 4 --top-k 2
      --expert-hidden 32 --shared 1 --batch 4 --data tests/data/corpus.txt --corpus-mb 0.1 --val-every 20
      --val-batches 1 --sample-len 0 --peak-tflops 0.1)
BIN=$BUILD/examples/train_moe

# The trainer with a loader thread, a metrics server scraped twice during the run and async saves.
train_threads() {
  local port=$((20000 + RANDOM % 20000))
  "$BIN" "${TINY[@]}" --steps 40 --prefetch 2 --metrics-port "$port" --ckpt-dir "$work/ck" --ckpt-every 10 \
    >"$work/train.out" 2>&1 &
  local pid=$! scraped=0
  for _ in $(seq 600); do
    if curl -s "http://127.0.0.1:$port/metrics" 2>/dev/null | grep -q '^dsk_train_steps_total'; then
      scraped=$((scraped + 1)); [ "$scraped" -ge 2 ] && break
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  wait "$pid"
  local rc=$?
  cat "$work/train.out"
  [ "$scraped" -ge 2 ] || { echo "the metrics server was scraped $scraped time(s), want 2"; return 1; }
  return "$rc"
}

check test_ckpt "$BUILD/tests/test_ckpt"
check test_comm "$BUILD/tests/test_comm"
check "train_moe --prefetch 2 --metrics-port (scraped) --ckpt-every 10" train_threads
check "train_moe --nproc 2 (launcher, two ranks over shared memory)" "$BIN" "${TINY[@]}" --steps 10 --nproc 2
check "train_moe --nproc 4 --ep 4 --ep-overlap chunked (exchange thread, per-rank chunks both ways)" "$BIN" "${TINY[@]}" \
    --steps 6 --nproc 4 --ep 4 --ep-overlap chunked
check "train_moe --nproc 4 --pp 2 --ep 2 --pair-micro-batches (an exchange beside the other micro-batch)" "$BIN" \
    "${TINY[@]}" --steps 6 --nproc 4 --pp 2 --ep 2 --micro-batches 2 --ep-overlap chunked --pair-micro-batches
check "train_moe --nproc 2 --ep 2 --micro-batches 2 --pair-micro-batches (returns beside the other micro-batch)" \
    "$BIN" "${TINY[@]}" --steps 6 --nproc 2 --ep 2 --batch 8 --micro-batches 2 --ep-overlap on --pair-micro-batches --layers 4
check "bench_moe_ep --ranks 4 --two-hosts (every exchange variant, two-hop on the exchange thread)" \
    "$BUILD/bench/bench_moe_ep" --ranks 4 --tokens 64 --repeats 1 --two-hosts
echo "$passed passed, $failed failed, 0 skipped"
[ "$failed" -eq 0 ]
