#!/usr/bin/env bash
# bench/train_graph_step.sh - the trainer's step time with and without --cuda-graph (issue 13): the
# same examples/train_moe run twice on one GPU, eager and with the whole step captured once and
# replayed; prints the median step time of each (steps after the first 3: warm-up and the
# capture), their ratio, and whether the two runs logged the same losses, norms and loss scales
# bit for bit. scripts/device_check.sh runs it; on the emulated GPU (build/emu) it smoke-runs
# with small arguments (its times mean nothing there).
# Usage: bash bench/train_graph_step.sh TRAIN_MOE [train_moe arguments]
#        default arguments: the default model (4 blocks, 8 experts top-2 + 1 shared, d_model 128),
#        batch 16 x 128 tokens, bf16, 40 steps, no validation or sample.
set -u
cd "$(dirname "$0")/.."
BIN=${1:?usage: bash bench/train_graph_step.sh TRAIN_MOE [train_moe arguments]}
shift
ARGS=("$@")
if [ ${#ARGS[@]} -eq 0 ]; then
    ARGS=(--steps 40 --warmup 5 --corpus-mb 1 --val-interval 1000000 --sample-len 0 --device cuda --dtype bf16)
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for mode in eager graph; do
    extra=()
    [ "$mode" = graph ] && extra=(--cuda-graph)
    if ! "$BIN" "${ARGS[@]}" "${extra[@]}" --log "$work/$mode.jsonl" >"$work/$mode.out" 2>&1; then
        echo "train_moe ($mode) failed:"; tail -5 "$work/$mode.out"; exit 1
    fi
done
python3 - "$work" "${ARGS[*]}" <<'PYEOF'
import json, statistics, sys
work, args = sys.argv[1], sys.argv[2]
runs = {}
for mode in ("eager", "graph"):
    steps = [json.loads(l) for l in open("%s/%s.jsonl" % (work, mode))]
    runs[mode] = [r for r in steps if r["type"] == "step"]
ms = {m: statistics.median([r["ms"] for r in s[3:]] or [r["ms"] for r in s]) for m, s in runs.items()}
key = lambda s: [(r["step"], repr(r["loss"]), repr(r["grad_norm"]), repr(r["loss_scale"]), r["skipped"]) for r in s]
same = key(runs["eager"]) == key(runs["graph"])
print("train_moe %s" % args)
print("step time: eager %.3f ms, --cuda-graph %.3f ms (%.0f%% of eager), median of steps 4..%d; "
      "logged steps bitwise equal: %s"
      % (ms["eager"], ms["graph"], 100.0 * ms["graph"] / ms["eager"], len(runs["eager"]), "yes" if same else "NO"))
print("summary: train_moe step eager %.3f ms, --cuda-graph %.3f ms (%.0f%%), replay = eager bitwise: %s"
      % (ms["eager"], ms["graph"], 100.0 * ms["graph"] / ms["eager"], "yes" if same else "NO"))
sys.exit(0 if same else 1)
PYEOF
