#!/usr/bin/env bash
# Production tests of examples/train_moe.c on tiny configurations: the data order is PyTorch's
# DistributedSampler (every sample once per epoch on 1, 2 and 3 ranks, padding and drop-last,
# resume in the middle of an epoch); pre-emption (SIGUSR1 saves and goes on, SIGTERM stops
# after the step with a checkpoint and exit 0, --resume auto continues bitwise, ranks agree);
# elastic restart (a rank killed at a random step: the local launcher and torchrun restart the
# job, it resumes and ends with the losses of an uninterrupted run); metrics (promtool lints
# /metrics, a real Prometheus scrapes a run and returns the step counter and loss series);
# placement (--bind core and numa from the sysfs topology, every thread moved).
# Prints `[test_prod] totals: P passed / F failed / S skipped`; exits non-zero on failure.
TEST_NAME=test_prod
source "$(dirname "$0")/train_test_lib.sh"
trap 'for w in ${watchdogs:-}; do pkill -P $w 2>/dev/null; kill $w 2>/dev/null; done; rm -rf "$work"' EXIT
need_built "$BIN"

TINY=(--seq 32 --d-model 32 --heads 2 --layers 3 --dense-layers 1 --ffn-hidden 64 --experts 4 --top-k 2
      --expert-hidden 32 --shared 1 --lr 3e-3 --warmup 5 --val-every 10 --val-interval 10 --val-batches 2
      --sample-len 0 --peak-tflops 0.1 --data "$CORPUS")

run() { # NAME ARGS...: output in $work/NAME.out, status in $work/NAME.rc
    local name=$1; shift
    timeout 120 "$BIN" "$@" >"$work/$name.out" 2>&1
    echo $? >"$work/$name.rc"
}
rc() { cat "$work/$1.rc"; }

# A real Prometheus for section 4, started now: it takes a few seconds before it scrapes.
free_ports() { # N: the first of N consecutive free TCP ports on 127.0.0.1, below the kernel's ephemeral
               # range, so no port picked meanwhile by binding port 0 can take them
    $PY - "$1" <<'EOF'
import random, socket, sys
n = int(sys.argv[1])
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for _ in range(200):
    p = random.randrange(10000, low - n)
    socks = []
    try:
        for k in range(n):
            t = socket.socket(); socks.append(t); t.bind(("127.0.0.1", p + k))
        print(p); break
    except OSError: pass
    finally:
        for t in socks: t.close()
EOF
}
prom=""
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    mport=$(free_ports 2) pport=$(free_ports 1)
    cat >"$work/prometheus.yml" <<EOF
global:
  scrape_interval: 100ms
  scrape_timeout: 100ms
scrape_configs:
  - job_name: dsk
    static_configs:
      - targets: ['127.0.0.1:$mport', '127.0.0.1:$((mport + 1))']
EOF
    prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" --web.listen-address="127.0.0.1:$pport" \
        >"$work/prometheus.log" 2>&1 &
    prom=$!
    watchdogs="${watchdogs:-} $prom"
fi

# A Python with torch, for the comparison with DistributedSampler itself (Debian's torch is
# installed for /usr/bin/python3, which may not be the python3 on PATH).
TORCH_PY=""
for p in python3 /usr/bin/python3 /usr/bin/python3.11; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import torch' >/dev/null 2>&1; then TORCH_PY=$p; break; fi
done

# ---- 1. data order: DistributedSampler. 67 windows of 33 bytes, every 10th held out: 61 training
#         samples, a prime, so 2 and 3 ranks pad (1 and 2 samples) or cut with --drop-last.
#         22 steps of 6 sequences read more than two epochs on every world size.
head -c 2211 "$CORPUS" >"$work/small.txt"
DATA=("${TINY[@]}" --data "$work/small.txt" --batch 6 --steps 22 --seed 11)
run_data() { # NAME NPROC ARGS...
    local name=$1 n=$2; shift 2
    rm -f "$work/$name.samples"
    run "$name" "${DATA[@]}" --nproc "$n" --sample-log "$work/$name.samples" "$@"
}
run_data d1 1
run_data d2 2
run_data d3 3
run_data d2cut 2 --drop-last --no-shuffle
# check_epochs NAME WORLD SHUFFLE DROP_LAST: every rank's samples, epoch by epoch, against the
# sampler's definition (and against torch's DistributedSampler when torch is installed)
check_epochs() {
    $PY - "$work/$1.samples" "$2" "$3" "$4" "$TORCH_PY" <<'EOF'
import json, subprocess, sys
path, world, shuffle, drop_last, torch_py = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
N, SEED = 61, 11
per = drop_last and N // world or -(-N // world)
stream = {r: [] for r in range(world)}
for line in open(path):
    row = json.loads(line)
    stream[row["rank"]].append((row["batch"], row["samples"]))
problems = []
epochs = {}
for r in range(world):
    batches = sorted(stream[r])
    if [b for b, _ in batches] != list(range(len(batches))): problems.append("rank %d: batches %s" % (r, [b for b, _ in batches]))
    flat = [s for _, ss in batches for s in ss]
    for i, (e, s) in enumerate(flat):
        if e != i // per: problems.append("rank %d: position %d in epoch %d, want %d" % (r, i, e, i // per)); break
        epochs.setdefault(e, {}).setdefault(r, []).append(s)
full = [e for e in sorted(epochs) if all(len(epochs[e].get(r, [])) == per for r in range(world))]
if len(full) < 2: problems.append("only %d full epochs" % len(full))
for e in full:
    seen = sorted(s for r in range(world) for s in epochs[e][r])
    if drop_last:
        if len(set(seen)) != len(seen) or len(seen) != per * world: problems.append("epoch %d: repeats or wrong count with drop-last" % e)
    elif sorted(set(seen)) != list(range(N)) or len(seen) != per * world:
        problems.append("epoch %d: %d distinct of %d, %d reads" % (e, len(set(seen)), N, len(seen)))
versus = "its definition"
if torch_py:
    code = ("import json,sys\nfrom torch.utils.data.distributed import DistributedSampler as D\n"
            "print(json.dumps({e: [list(iter((lambda s: (s.set_epoch(e), s)[1])(D(range(%d), %d, r, shuffle=%s, seed=%d, drop_last=%s))))"
            " for r in range(%d)] for e in %s}))" % (N, world, bool(shuffle), SEED, bool(drop_last), world, full))
    ref = json.loads(subprocess.run([torch_py, "-c", code], capture_output=True, text=True, check=True).stdout)
    for e in full:
        for r in range(world):
            if ref[str(e)][r] != epochs[e][r]: problems.append("epoch %d rank %d: %s, torch %s" % (e, r, epochs[e][r][:6], ref[str(e)][r][:6]))
    versus = "torch's DistributedSampler"
print("; ".join(problems[:4]) if problems else "ok %d epochs x %d ranks x %d samples equal %s" % (len(full), world, per, versus))
EOF
}
for spec in "d1 1 1 0" "d2 2 1 0" "d3 3 1 0" "d2cut 2 0 1"; do
    set -- $spec
    what="$2 rank(s)$([ "$4" = 1 ] && echo ", --drop-last --no-shuffle" || echo ", padded"): every epoch reads each sample once as DistributedSampler"
    if [ "$(rc "$1")" -ne 0 ]; then bad "$what" "exit $(rc "$1")" "$(tail -3 "$work/$1.out")"; continue; fi
    verdict=$(check_epochs "$@" 2>&1)
    case $verdict in ok*) ok "$what (${verdict#ok })";; *) bad "$what" "$verdict";; esac
done
[ -n "$TORCH_PY" ] || skip "DistributedSampler comparison: no Python with torch (checked against the definition only)"

# Resume in the middle of epoch 1 (2 ranks: 31 samples per rank and epoch, 3 per step: step 13
# is in epoch 1): the resumed run reads the same samples as the straight one, batch by batch.
rm -f "$work/dres.samples"
run dres_a "${DATA[@]}" --nproc 2 --ckpt-dir "$work/ck_dres" --ckpt-every 100 --stop-at 13 --sample-log "$work/dres.samples"
run dres_b "${DATA[@]}" --nproc 2 --ckpt-dir "$work/ck_dres" --resume auto --sample-log "$work/dres.samples"
what="resume at step 13 (epoch 1, sample 8 of 31 on each rank) reads the straight run's samples"
if [ "$(rc dres_a)" -ne 0 ] || [ "$(rc dres_b)" -ne 0 ]; then
    bad "$what" "exit $(rc dres_a)/$(rc dres_b)" "$(tail -3 "$work/dres_b.out")"
elif [ "$(sort "$work/dres.samples")" = "$(sort "$work/d2.samples")" ] &&
     grep -q 'resume: step 13 .*epoch 1, sample 8 of 31' "$work/dres_b.out"; then
    ok "$what"
else
    bad "$what" "$(diff <(sort "$work/d2.samples") <(sort "$work/dres.samples") | head -4)" "$(grep 'resume:' "$work/dres_b.out")"
fi

# Changing the data order on resume is refused, naming both orders.
run dres_c "${DATA[@]}" --nproc 2 --ckpt-dir "$work/ck_dres" --resume --drop-last --steps 30
if [ "$(rc dres_c)" -ne 0 ] && grep -q 'read its data as "DistributedSampler samples=61 shuffle=1 drop_last=0 seed=11", this run as ".*drop_last=1' "$work/dres_c.out"; then
    ok "resume with another sampler setting fails naming both ($(grep -o 'read its data as.*' "$work/dres_c.out" | head -1 | cut -c1-90)...)"
else
    bad "resume with another sampler setting fails" "exit $(rc dres_c)" "$(tail -2 "$work/dres_c.out")"
fi
run prefetch_bad "${DATA[@]}" --prefetch -1
if [ "$(rc prefetch_bad)" -eq 1 ] && grep -q -- '--prefetch -1: must be >= 0' "$work/prefetch_bad.out"; then ok "--prefetch -1 fails cleanly"
else bad "--prefetch -1 fails cleanly" "exit $(rc prefetch_bad)" "$(tail -2 "$work/prefetch_bad.out")"; fi

# ---- 2. pre-emption. One rank: SIGUSR1 after step 6 saves and goes on, SIGTERM 8 steps later
#         (the run is frozen by SIGSTOP while it is sent) stops after that step with a checkpoint
#         and exit 0; --resume auto continues bitwise. A tiny step takes a few ms, so the signalled
#         runs are scheduled for 3000 steps (they cannot end before the signals land however slow
#         the test's polling is under load), and the reference runs stop at step 200 (--stop-at).
PRE=("${TINY[@]}" --corpus-mb 0.3 --batch 8 --steps 3000)
REF_STEPS=200
field() { # LOG FIELD [TYPE]: "step value" lines of a JSONL log
    $PY - "$1" "$2" "${3:-step}" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["type"] == sys.argv[3]:
        print(r["step"], repr(r[sys.argv[2]]))
EOF
}
# A resumed run logs its checkpoint step's validation again (a log that continues after a stop
# holds it twice, with the same bits): equal lines of one step count once; differing ones stay.
trace() { (field "$1" loss; field "$1" grad_norm; field "$1" val_loss val) | sort -n -s -k1,1 | uniq; }
wait_for() { # FILE REGEX PID: waits until FILE has a line matching REGEX (20 s at most, or until PID exits)
    local i
    for i in $(seq 4000); do
        grep -qE -e "$2" "$1" 2>/dev/null && return 0
        kill -0 "$3" 2>/dev/null || return 1
        sleep 0.005
    done
    return 1
}
start_bg() { # NAME ARGS...: starts the trainer in the background (not under timeout(1), which would take the
       # signals meant for it); pid in $pid, output in $work/NAME.out; a watchdog kills it after 120 s
    local name=$1; shift
    "$BIN" "$@" >"$work/$name.out" 2>&1 &
    pid=$!
    (sleep 120; kill -9 $pid 2>/dev/null) >/dev/null 2>&1 &
    watchdogs="${watchdogs:-} $!"
}
last_step() { $PY -c "import json,sys; print([r['step'] for r in map(json.loads, open(sys.argv[1])) if r['type']=='step'][-1])" "$1"; }
complete() { [ -f "$1/$(printf 'step_%08d' "$2")/manifest.json" ]; }

run straight "${PRE[@]}" --stop-at $REF_STEPS --log "$work/straight.jsonl"
start_bg pre "${PRE[@]}" --ckpt-dir "$work/ck_pre" --log "$work/pre.jsonl"
usr1_step=none term_step=none
if wait_for "$work/pre.jsonl" '"step":6,' $pid; then
    kill -USR1 $pid
    if wait_for "$work/pre.out" '^SIGUSR1: checkpoint of step [0-9]+ saved; training goes on' $pid; then
        usr1_step=$(grep -oE '^SIGUSR1: checkpoint of step [0-9]+' "$work/pre.out" | grep -oE '[0-9]+$')
        if wait_for "$work/pre.jsonl" "\"step\":$((usr1_step + 8))," $pid; then
            kill -STOP $pid; kill -TERM $pid; kill -CONT $pid
        fi
    fi
fi
wait $pid
pre_rc=$?
[ -s "$work/pre.jsonl" ] && term_step=$(last_step "$work/pre.jsonl")
what="SIGUSR1 saves (step $usr1_step) and goes on; SIGTERM stops after the step (step $term_step), saves it, exits 0"
if [ $pre_rc -eq 0 ] && [ "$usr1_step" != none ] && [ "$term_step" != none ] && [ "$term_step" -lt $REF_STEPS ] &&
   grep -qE "^pre-empted: SIGTERM, stopped after step $term_step, checkpoint of step $term_step saved in .*; exiting with status 0, [0-9.]+ s after the signal" "$work/pre.out" &&
   complete "$work/ck_pre" "$usr1_step" && complete "$work/ck_pre" "$term_step"; then
    ok "$what ($(grep -oE '[0-9.]+ s after the signal' "$work/pre.out"))"
else
    bad "$what" "exit $pre_rc" "$(grep -E 'SIGUSR1|pre-empted|rank' "$work/pre.out" | head -3)" "$(ls "$work/ck_pre" 2>&1 | tr '\n' ' ')"
fi
run pre_resumed "${PRE[@]}" --stop-at $REF_STEPS --ckpt-dir "$work/ck_pre" --resume auto --log "$work/pre.jsonl"
what="--resume auto after the SIGTERM: steps 1-$REF_STEPS bitwise equal to an uninterrupted run (loss, norm, validation)"
if [ "$(rc straight)" -eq 0 ] && [ "$(rc pre_resumed)" -eq 0 ] && grep -q "^resume: step $term_step " "$work/pre_resumed.out" &&
   [ "$(trace "$work/straight.jsonl")" = "$(trace "$work/pre.jsonl")" ] && [ "$(field "$work/pre.jsonl" loss | wc -l)" -eq $REF_STEPS ]; then
    ok "$what"
else
    bad "$what" "exit $(rc straight)/$(rc pre_resumed)" "$(diff <(trace "$work/straight.jsonl") <(trace "$work/pre.jsonl") | head -4)"
fi
run auto_fresh "${PRE[@]}" --steps 2 --ckpt-dir "$work/ck_fresh" --resume auto
if [ "$(rc auto_fresh)" -eq 0 ] && grep -q 'resume: no complete checkpoint in .*ck_fresh yet, starting at step 0' "$work/auto_fresh.out" &&
   complete "$work/ck_fresh" 2; then
    ok "--resume auto on an empty directory starts at step 0"
else
    bad "--resume auto on an empty directory starts at step 0" "exit $(rc auto_fresh)" "$(tail -2 "$work/auto_fresh.out")"
fi

# Two ranks, SIGTERM to rank 1 alone: the ranks agree at the end of the step, both stop after the
# same step, the checkpoint of that step is complete, the job exits 0.
start_bg pre2 "${PRE[@]}" --nproc 2 --ckpt-dir "$work/ck_pre2" --log "$work/pre2.jsonl"
if wait_for "$work/pre2.jsonl" '"step":5,' $pid; then
    rank1=$(cut -d' ' -f2 "/proc/$pid/task/$pid/children" 2>/dev/null)
    [ -n "$rank1" ] && { kill -STOP "$rank1"; kill -TERM "$rank1"; kill -CONT "$rank1"; }
fi
wait $pid
pre2_rc=$?
s2=$( [ -s "$work/pre2.jsonl" ] && last_step "$work/pre2.jsonl")
what="2 ranks, SIGTERM to rank 1 alone: both stop after step ${s2:-?} with its checkpoint, exit 0"
if [ $pre2_rc -eq 0 ] && [ -n "$s2" ] && [ "$s2" -lt 3000 ] && complete "$work/ck_pre2" "$s2" &&
   grep -q "^\[rank 0\] pre-empted: SIGTERM, stopped after step $s2, checkpoint of step $s2 saved" "$work/pre2.out"; then
    ok "$what"
else
    bad "$what" "exit $pre2_rc" "$(grep -E 'pre-empted|rank 1|error' "$work/pre2.out" | head -3)"
fi

# ---- 3. elastic restart. Two ranks, 50 steps, a checkpoint every 5: a random rank is killed with
#         SIGKILL at a random step; its peer fails naming it, the launcher (--max-restarts 2) and
#         torchrun (--max_restarts 1) run the job again, it resumes from the newest checkpoint, and
#         every step it logs has the loss of an uninterrupted run, to the last bit.
KILL=("${TINY[@]}" --corpus-mb 0.3 --batch 8 --steps 50 --ckpt-every 5)
run straight2 "${KILL[@]}" --nproc 2 --log "$work/straight2.jsonl" --metrics "$work/straight2.prom"
# The metrics files of both ranks agree with the log: steps, tokens, the step-time histogram's
# count and sum, the data-wait and gradient-sync seconds (the log's per-step times summed).
verdict=$($PY - "$work/straight2.jsonl" "$work/straight2.prom" "$work/straight2.rank1.prom" <<'EOF'
import json, re, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if r["type"] == "step"]
problems = []
for rank, path in ((0, sys.argv[2]), (1, sys.argv[3])):
    try: text = open(path).read()
    except OSError as e: problems.append(str(e)); continue
    val = {m: float(v) for m, v in re.findall(r'^(dsk_train_\w+)\{rank="%d"\} (\S+)$' % rank, text, re.M)}
    want = {"dsk_train_steps_total": 50, "dsk_train_tokens_total": 50 * 4 * 32, "dsk_train_step_seconds_count": 50,
            "dsk_train_checkpoints_total": 0}
    for k, w in want.items():
        if val.get(k) != w: problems.append("rank %d %s = %s, want %s" % (rank, k, val.get(k), w))
    if rank == 0:
        for k, f in (("dsk_train_step_seconds_sum", "ms"), ("dsk_train_data_wait_seconds_total", "data_wait_ms"),
                     ("dsk_train_grad_sync_seconds_total", "grad_sync_ms")):
            logged = sum(r[f] for r in rows) / 1e3
            if k not in val or abs(val[k] - logged) > 1e-5 * len(rows) + 1e-6 * logged: problems.append("%s = %s, log %s" % (k, val.get(k), logged))
        if not all(0 <= r["grad_sync_ms"] <= r["ms"] and 0 <= r["data_wait_ms"] <= r["ms"] for r in rows): problems.append("a wait longer than its step")
        if not sum(r["grad_sync_ms"] for r in rows) > 0: problems.append("no gradient-sync time with 2 ranks")
print("; ".join(problems[:4]) if problems else "ok")
EOF
)
what="--metrics files of 2 ranks agree with the log (steps, tokens, step-time histogram, data-wait and gradient-sync seconds)"
if [ "$(rc straight2)" -eq 0 ] && [ "$verdict" = ok ]; then ok "$what"; else bad "$what" "exit $(rc straight2): $verdict"; fi
same_losses() { # LOG: every step line has the straight 2-rank loss of its step, and all 50 steps are there
    $PY - "$work/straight2.jsonl" "$1" <<'EOF'
import json, sys
def steps(p): return [(r["step"], r["loss"]) for r in map(json.loads, open(p)) if r["type"] == "step"]
ref = dict(steps(sys.argv[1]))
got = steps(sys.argv[2])
off = [(s, l, ref.get(s)) for s, l in got if ref.get(s) != l]
missing = sorted(set(ref) - set(s for s, _ in got))
print("ok %d step lines (%d repeated after the restart), final loss %r" % (len(got), len(got) - len(set(s for s, _ in got)), got[-1][1])
      if got and not off and not missing and got[-1][0] == 50 else "off %s missing %s" % (off[:3], missing[:5]))
EOF
}
kill_at=$((3 + RANDOM % 35)) victim=$((RANDOM % 2))
other=$((1 - victim))
start_bg kill "${KILL[@]}" --nproc 2 --max-restarts 2 --ckpt-dir "$work/ck_kill" --log "$work/kill.jsonl"
if wait_for "$work/kill.jsonl" "\"step\":$kill_at," $pid; then
    ranks=($(cat "/proc/$pid/task/$pid/children" 2>/dev/null))
    [ ${#ranks[@]} -eq 2 ] && kill -9 "${ranks[$victim]}"
fi
wait $pid
kill_rc=$?
verdict=$(same_losses "$work/kill.jsonl" 2>&1)
what="rank $victim SIGKILLed at step $kill_at of 50 (--nproc 2 --max-restarts 2): its peer fails naming it, the job restarts, resumes, completes, every logged loss bitwise equal to an uninterrupted run"
if [ $kill_rc -eq 0 ] && grep -qE "^\[rank $other\] train_moe: rank $other: .*rank $victim\b" "$work/kill.out" &&
   grep -q "restart 1 of 2 from the newest checkpoint" "$work/kill.out" && grep -q "^\[rank 0\] restart 1: resuming from the newest complete checkpoint" "$work/kill.out" &&
   [ "${verdict%% *}" = ok ]; then
    ok "$what (${verdict#ok })"
else
    bad "$what" "exit $kill_rc: $verdict" "$(grep -E 'train_moe: |restart' "$work/kill.out" | head -4)"
fi
run norestart "${KILL[@]}" --nproc 2 --ckpt-dir "$work/ck_nor" --max-restarts -1
if [ "$(rc norestart)" -eq 2 ] && grep -q -- '--max-restarts -1: must be >= 0' "$work/norestart.out"; then ok "--max-restarts -1 fails cleanly"
else bad "--max-restarts -1 fails cleanly" "exit $(rc norestart)" "$(tail -2 "$work/norestart.out")"; fi

# SIGTERM to the launcher: it forwards it to the ranks, they stop together and save; no restart.
start_bg fwd "${KILL[@]}" --steps 3000 --nproc 2 --max-restarts 1 --ckpt-dir "$work/ck_fwd" --log "$work/fwd.jsonl"
if wait_for "$work/fwd.jsonl" '"step":5,' $pid; then kill -STOP $pid; kill -TERM $pid; kill -CONT $pid; fi
wait $pid
fwd_rc=$?
s3=$( [ -s "$work/fwd.jsonl" ] && last_step "$work/fwd.jsonl")
what="SIGTERM to the --nproc launcher reaches the ranks: they stop after step ${s3:-?} with its checkpoint, exit 0, no restart"
if [ $fwd_rc -eq 0 ] && [ -n "$s3" ] && [ "$s3" -lt 3000 ] && complete "$work/ck_fwd" "$s3" && ! grep -q 'restart' "$work/fwd.out" &&
   grep -q "^\[rank 0\] pre-empted: SIGTERM, stopped after step $s3" "$work/fwd.out"; then
    ok "$what"
else
    bad "$what" "exit $fwd_rc" "$(grep -E 'pre-empted|restart|train_moe: ' "$work/fwd.out" | head -3)"
fi

# The same under torchrun (its agent restarts every worker; TORCHELASTIC_RESTART_COUNT makes them resume).
if command -v torchrun >/dev/null 2>&1 && [ -n "$TORCH_PY" ]; then
    # two free ports in a row: torchrun's agent store takes MASTER_PORT, dsk's store the next one;
    # below the ephemeral range, so no test beside this one (run_tests.sh's LANE) binding port 0
    # can take the second meanwhile
    port=$(free_ports 2)
    kill_at=$((3 + RANDOM % 20)) # well before the last of the 50 steps, even on a loaded machine
    # the worker is a script without arguments: torchrun 2.x's parser takes a trainer flag such as
    # --log after the program's name for an abbreviation of its own --log-dir and stops
    printf '#!/usr/bin/env bash\nexec %q' "$BIN" >"$work/tr_worker.sh"
    printf ' %q' "${KILL[@]}" --ckpt-dir "$work/ck_tr" --log "$work/tr.jsonl" >>"$work/tr_worker.sh"
    chmod +x "$work/tr_worker.sh"
    torchrun -r 1 -t 1 --nproc_per_node 2 --master_port "$port" --no_python --max_restarts 1 --monitor_interval 0.2 \
        "$work/tr_worker.sh" >"$work/tr.out" 2>&1 &
    pid=$!
    (sleep 120; kill -9 $pid 2>/dev/null) >/dev/null 2>&1 &
    watchdogs="${watchdogs:-} $!"
    if wait_for "$work/tr.jsonl" "\"step\":$kill_at," $pid; then
        worker=$(ps -o pid= --ppid $pid | tail -1)
        [ -n "$worker" ] && kill -9 $worker
    fi
    wait $pid
    tr_rc=$?
    verdict=$(same_losses "$work/tr.jsonl" 2>&1)
    what="torchrun --max_restarts 1: a worker SIGKILLed at step $kill_at, the workers restart and resume, every logged loss bitwise equal"
    if [ $tr_rc -eq 0 ] && grep -q 'restart 1: resuming from the newest complete checkpoint' "$work/tr.out" && [ "${verdict%% *}" = ok ]; then
        ok "$what (${verdict#ok })"
    else
        bad "$what" "exit $tr_rc: $verdict" "$(grep -E 'train_moe: |restart|ERROR' "$work/tr.out" | head -4)"
    fi
else
    skip "torchrun --max_restarts: torchrun (Debian's python3-torch) is not installed"
fi

# ---- 4. metrics. Two ranks serve /metrics (PORT, PORT + 1); promtool lints what they serve; a real
#         Prometheus scrapes the run every 100 ms and its HTTP API returns the step counter and the
#         loss series, each loss equal to the log's loss of the step scraped with it; every metric
#         the Grafana dashboard asks for is served.
if [ -n "$prom" ]; then
    # Prometheus was started at the top: its discovery hands the targets to the scraper about 5 s later
    for i in $(seq 400); do
        curl -s "http://127.0.0.1:$pport/api/v1/targets" 2>/dev/null | grep -q "127.0.0.1:$((mport + 1))" && break
        sleep 0.05
    done
    start_bg prom "${TINY[@]}" --corpus-mb 0.3 --batch 8 --steps 1500 --nproc 2 --metrics-port "$mport" --log "$work/prom.jsonl"
    if wait_for "$work/prom.jsonl" '"step":20,' $pid; then
        curl -s "http://127.0.0.1:$mport/metrics" >"$work/scrape0.txt"
        curl -s "http://127.0.0.1:$((mport + 1))/metrics" >"$work/scrape1.txt"
        curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$mport/other" >"$work/scrape404.txt"
    fi
    wait $pid
    prom_rc=$?
    sleep 0.3
    lint=$(promtool check metrics <"$work/scrape0.txt" 2>&1 && promtool check metrics <"$work/scrape1.txt" 2>&1)
    lint_rc=$?
    [ -s "$work/scrape0.txt" ] && [ -s "$work/scrape1.txt" ] || lint_rc=1
    what="/metrics of both ranks passes promtool check metrics (counters _total, histogram, units, rank labels)"
    if [ $prom_rc -eq 0 ] && [ $lint_rc -eq 0 ] && [ -z "$lint" ] && grep -q '^dsk_train_steps_total{rank="0"} ' "$work/scrape0.txt" &&
       grep -q '^dsk_train_steps_total{rank="1"} ' "$work/scrape1.txt" && grep -q '^# TYPE dsk_train_step_seconds histogram$' "$work/scrape0.txt" &&
       [ "$(cat "$work/scrape404.txt")" = 404 ]; then
        ok "$what"
    else
        bad "$what" "exit $prom_rc, promtool $lint_rc: $(echo "$lint" | head -3)" "$(head -c 300 "$work/scrape0.txt")"
    fi
    verdict=$($PY - "http://127.0.0.1:$pport" "$work/prom.jsonl" scripts/grafana_dashboard.json "$work/scrape0.txt" <<'EOF'
import json, re, struct, sys, urllib.parse, urllib.request
api, log, dash, scrape = sys.argv[1:5]
def query(q):
    url = api + "/api/v1/query?" + urllib.parse.urlencode({"query": q})
    r = json.load(urllib.request.urlopen(url, timeout=10))
    assert r["status"] == "success", r
    return {m["metric"].get("rank"): m["values"] for m in r["data"]["result"]}
f32 = lambda x: struct.unpack("f", struct.pack("f", float(x)))[0]
steps = query('dsk_train_steps_total{job="dsk"}[10m]')
loss = query('dsk_train_loss{job="dsk"}[10m]')
logged = {r["step"]: r["loss"] for r in map(json.loads, open(log)) if r["type"] == "step"}
problems, matched = [], 0
for rank in ("0", "1"):
    if rank not in steps or rank not in loss: problems.append("rank %s: no series (%s)" % (rank, sorted(steps))); continue
    at = {t: int(float(v)) for t, v in steps[rank]}
    pairs = [(at[t], float(v)) for t, v in loss[rank] if t in at]
    if len(set(s for s, _ in pairs)) < 3: problems.append("rank %s: only %d scraped steps" % (rank, len(pairs)))
    for s, v in pairs:
        if s not in logged or f32(logged[s]) != f32(v): problems.append("rank %s step %d: Prometheus %r, log %r" % (rank, s, v, logged.get(s)))
        else: matched += 1
    by_time = [at[t] for t in sorted(at)]
    if by_time != sorted(by_time): problems.append("rank %s: the step counter went down: %s" % (rank, by_time[:8]))
served = set(re.findall(r"^# TYPE (\S+)", open(scrape).read(), re.M))
served |= {n + "_bucket" for n in served} | {n + "_sum" for n in served} | {n + "_count" for n in served}
wanted = set(re.findall(r"\b(dsk_train_[a-z_]+)", json.dumps(json.load(open(dash)))))
gpu_only = {m for m in wanted if "gpu_" in m or "device_memory" in m}
missing = sorted(wanted - served - gpu_only)
if missing: problems.append("dashboard asks for metrics not served: %s" % missing)
seen = sorted(set(int(float(v)) for _, v in steps.get("0", []))) or [0]
print("; ".join(problems[:4]) if problems else "ok %d scrapes of 2 ranks matched the log (steps %d..%d), the dashboard's %d metrics are served" % (
    matched, seen[0], seen[-1], len(wanted)))
EOF
)
    what="a real Prometheus scrapes the run: its HTTP API returns the step counter and the loss series of both ranks, equal to the log"
    case $verdict in ok*) ok "$what (${verdict#ok })";; *) bad "$what" "$verdict" "$(tail -3 "$work/prometheus.log")";; esac
    run port_taken "${TINY[@]}" --corpus-mb 0.3 --batch 8 --steps 2 --metrics-port "$pport"
    if [ "$(rc port_taken)" -eq 1 ] && grep -q "metrics server: cannot listen on 127.0.0.1:$pport: Address already in use" "$work/port_taken.out"; then
        ok "--metrics-port on a port in use fails cleanly, naming it"
    else
        bad "--metrics-port on a port in use fails cleanly" "exit $(rc port_taken)" "$(tail -2 "$work/port_taken.out")"
    fi
    kill $prom 2>/dev/null
    wait $prom 2>/dev/null
else
    skip "Prometheus scrape and promtool lint: prometheus is not installed (apt-get install prometheus; .ci/run does)"
fi
# bad_input NAME REGEX ARGS...: exit 1 with a message matching REGEX
bad_input() {
    local name=$1 msg=$2; shift 2
    run "$name" "${TINY[@]}" --corpus-mb 0.3 --batch 8 --steps 2 "$@"
    if [ "$(rc "$name")" -eq 1 ] && grep -qE -e "$msg" "$work/$name.out"; then ok "bad input fails cleanly: $name"
    else bad "bad input fails cleanly: $name" "exit $(rc "$name")" "$(tail -2 "$work/$name.out")"; fi
}
bad_input port_big '--metrics-port 70000: want an IPv4 address and a port in 1..65535' --metrics-port 70000
bad_input port_negative '--metrics-port -1: must be in 1..65535' --metrics-port -1
bad_input metrics_addr '--metrics-addr localhost --metrics-port 9: want an IPv4 address' --metrics-port 9 --metrics-addr localhost
bad_input sample_log_dir '--sample-log: cannot open .*/nodir/s.jsonl: No such file or directory' --sample-log "$work/nodir/s.jsonl"
bad_input metrics_file_dir '--metrics: cannot write .*/nodir/m.prom.tmp: No such file or directory' --metrics "$work/nodir/m.prom"

# ---- 5. placement. --bind core gives the two local ranks disjoint cores of the CPUs this process
#         may use, and moves every thread of each rank there; --bind numa gives each rank its
#         node's CPUs (from sysfs); a CPU set from taskset is respected; a bad mode fails cleanly.
allowed=$(awk '/^Cpus_allowed_list/ {print $2}' /proc/self/status)
start_bg bind_core "${TINY[@]}" --corpus-mb 0.3 --batch 8 --steps 200 --nproc 2 --bind core --log "$work/bind.jsonl"
threads_ok=none
if wait_for "$work/bind.jsonl" '"step":20,' $pid; then
    threads_ok=yes
    for r in 0 1; do
        rpid=$(cut -d' ' -f$((r + 1)) "/proc/$pid/task/$pid/children" 2>/dev/null)
        want=$(grep -oE "^\[rank $r\] bind core: local rank $r of 2 on CPUs [0-9,-]+" "$work/bind_core.out" | awk '{print $NF}')
        for st in /proc/"$rpid"/task/*/status; do
            got=$(awk '/^Cpus_allowed_list/ {print $2}' "$st" 2>/dev/null)
            [ -z "$got" ] || [ "$got" = "$want" ] || threads_ok="no: rank $r thread ${st%/status} on $got, want $want"
        done
    done
fi
wait $pid
bind_rc=$?
verdict=$($PY - "$work/bind_core.out" "$allowed" <<'EOF'
import re, sys
def cpus(s):
    out = set()
    for part in s.split(","):
        a, _, b = part.partition("-")
        out |= set(range(int(a), int(b or a) + 1))
    return out
text, allowed = open(sys.argv[1]).read(), cpus(sys.argv[2])
got = {int(r): cpus(c) for r, c in re.findall(r"^\[rank (\d)\] bind core: local rank \d of 2 on CPUs ([0-9,-]+)", text, re.M)}
problems = []
if sorted(got) != [0, 1]: problems.append("lines for ranks %s" % sorted(got))
elif len(allowed) >= 2 and (got[0] & got[1] or not got[0] or not got[1]): problems.append("overlap or empty: %s" % got)
elif not (got[0] | got[1]) <= allowed: problems.append("%s outside the allowed %s" % (got, allowed))
print("; ".join(problems) if problems else "ok rank 0 on %s, rank 1 on %s of %s" % (sorted(got[0]), sorted(got[1]), sorted(allowed)))
EOF
)
what="--nproc 2 --bind core: disjoint cores per rank, printed at start, every thread of each rank on them"
if [ $bind_rc -eq 0 ] && [ "${verdict%% *}" = ok ] && [ "$threads_ok" = yes ]; then ok "$what (${verdict#ok })"
else bad "$what" "exit $bind_rc: $verdict; threads: $threads_ok" "$(grep bind "$work/bind_core.out" | head -2)"; fi

run bind_numa "${TINY[@]}" --corpus-mb 0.3 --batch 8 --steps 2 --nproc 2 --bind numa
verdict=$($PY - "$work/bind_numa.out" "$allowed" <<'EOF'
import glob, re, sys
def cpus(s):
    out = set()
    for part in s.strip().split(","):
        a, _, b = part.partition("-")
        out |= set(range(int(a), int(b or a) + 1))
    return out
allowed = cpus(sys.argv[2])
nodes = sorted((int(re.search(r"node(\d+)/", p).group(1)), cpus(open(p).read()) & allowed) for p in glob.glob("/sys/devices/system/node/node*/cpulist"))
nodes = [(n, c) for n, c in nodes if c] or [(0, allowed)]
text = open(sys.argv[1]).read()
problems = []
for r in (0, 1):
    m = re.search(r"^\[rank %d\] bind numa: local rank %d of 2 on CPUs ([0-9,-]+) \(NUMA node (\d+)" % (r, r), text, re.M)
    want_node, want = nodes[r * len(nodes) // 2]
    if not m: problems.append("no line for rank %d" % r)
    elif cpus(m.group(1)) != want or int(m.group(2)) != want_node:
        problems.append("rank %d on %s (node %s), want node %d %s" % (r, m.group(1), m.group(2), want_node, sorted(want)))
print("; ".join(problems) if problems else "ok %d node(s): %s" % (len(nodes), [(n, sorted(c)) for n, c in nodes]))
EOF
)
what="--nproc 2 --bind numa: each rank on the CPUs sysfs lists for its node"
if [ "$(rc bind_numa)" -eq 0 ] && [ "${verdict%% *}" = ok ]; then ok "$what (${verdict#ok })"
else bad "$what" "exit $(rc bind_numa): $verdict" "$(grep bind "$work/bind_numa.out" | head -2)"; fi

if command -v taskset >/dev/null 2>&1; then
    last=$(echo "$allowed" | tr ',' '\n' | tail -1 | sed 's/.*-//')
    taskset -c "$last" "$BIN" "${TINY[@]}" --corpus-mb 0.3 --batch 8 --steps 2 --bind core >"$work/bind_set.out" 2>&1
    code=$?
    if [ $code -eq 0 ] && grep -q "^bind core: local rank 0 of 1 on CPUs $last (1 core of 1; 1 core, 1 NUMA node allowed)" "$work/bind_set.out"; then
        ok "--bind core under taskset -c $last stays on CPU $last"
    else
        bad "--bind core under taskset -c $last stays on CPU $last" "exit $code" "$(grep -E 'bind|rank' "$work/bind_set.out" | head -2)"
    fi
else
    skip "--bind under taskset: taskset (util-linux) is not installed"
fi
run bind_bad "${TINY[@]}" --corpus-mb 0.3 --batch 8 --steps 2 --bind socket
if [ "$(rc bind_bad)" -eq 1 ] && grep -q -- '--bind "socket": use none, core or numa' "$work/bind_bad.out"; then ok "--bind socket fails cleanly"
else bad "--bind socket fails cleanly" "exit $(rc bind_bad)" "$(tail -2 "$work/bind_bad.out")"; fi

finish
