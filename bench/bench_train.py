"""bench/bench_train.py - `make run`'s model trained by dsk (build/examples/train_moe) and by PyTorch
(bench/train_torch.py, the same model) side by side: alternating runs, medians of the step times
after a warm-up, at 1 and 2 threads, PyTorch in each split of its threads between intra-op
(OpenMP) and BLAS (OpenBLAS pthreads). Prints tokens/s of each, the ratio dsk / PyTorch's best
split (by the median step over all rounds, by the least disturbed round, and by CPU time per step,
which other programs on a shared machine disturb least), peak RSS, the BLAS kernel family PyTorch
ran and the load average around each run.

Usage: python3 bench/bench_train.py [--dsk build/examples/train_moe] [--rounds 3] [--steps 40]
           [--warmup 10] [--threads 1,2] [--python PYTHON] [--keep-openblas-env]
           [--peer-default-spin] [--variants eager,sdpa,grouped,compile] [--model-args "--d-model 256 ..."]
PyTorch runs in each of --variants: eager (materialised attention, as written for 1.13), sdpa (fused
causal attention), grouped (sdpa, and the routed experts through torch._grouped_mm, which 2.15 has)
and compile (sdpa under torch.compile; its compilation steps are excluded and reported apart by
train_torch.py); dsk is compared with the best variant and split. --python picks
the interpreter (default: the one running this script): PyTorch 2.x from PyPI (MKL) or Debian's
/usr/bin/python3 with python3-torch (1.13: --variants eager) on the libblas alternative (OpenBLAS). This machine
sets OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE for old OpenBLAS builds; they force OpenBLAS's AVX2 kernels
on an AVX-512 CPU, so the peer runs without them (its fastest kernels) unless --keep-openblas-env.
PyTorch's intra-op OpenMP threads get the short spin train_moe gives itself (GOMP_SPINCOUNT=1000)
unless --peer-default-spin or the environment sets a wait policy.
Never part of `make test`. """
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd, env):
    """Runs cmd; returns (stdout, peak RSS in MB, load average before, after)."""
    load0 = os.getloadavg()[0]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.exit("bench_train: %s failed (%d):\n%s" % (" ".join(cmd), p.returncode, out[-3000:]))
    return out, ru.ru_maxrss / 1024.0, load0, os.getloadavg()[0]


def run_dsk(a, threads, log):
    cmd = [a.dsk, "--steps", str(a.steps), "--threads", str(threads), "--sample-len", "0", "--val-interval", "1000000",
           "--val-batches", "1", "--log-every", "1000000", "--peak-tflops", "1", "--log", log]
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    out, rss, l0, l1 = run(cmd + a.model_args.split(), env)
    ms, cpu = {}, {}
    with open(log) as f:
        for line in f:
            r = json.loads(line)
            if r.get("type") == "step":
                ms[r["step"]] = r["ms"]
                cpu[r["step"]] = r["cpu_ms"]
    kernel = re.search(r"cpu gemm: ([^\n,;]+)", out)
    steps = [s for s in sorted(ms) if s > a.warmup]
    return [ms[s] for s in steps], [cpu[s] for s in steps], rss, l0, l1, kernel.group(1) if kernel else "?"


def run_torch(a, intra, blas, variant):
    env = dict(os.environ)
    if not a.keep_openblas_env:
        env.pop("OPENBLAS_CORETYPE", None)
        env.pop("OPENBLAS_L2_SIZE", None)
    env["OPENBLAS_NUM_THREADS"] = str(blas)
    env["OMP_NUM_THREADS"] = str(intra)
    if not a.peer_default_spin and not any(k in env for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")):
        env["GOMP_SPINCOUNT"] = "1000"  # the short spin train_moe gives itself: on a loaded machine 2 intra-op threads collapse without it
    cmd = [a.python, os.path.join(HERE, "train_torch.py"), "--steps", str(a.steps), "--threads", str(intra)]
    cmd += {"eager": [], "sdpa": ["--sdpa"], "grouped": ["--sdpa", "--grouped"],
            "compile": ["--sdpa", "--compile"]}[variant] + a.model_args.split()
    out, rss, l0, l1 = run(cmd, env)
    comp = re.search(r"^# compile_s ([0-9.]+)", out, re.M)
    if comp:
        print("# torch %s %dx%d: compile %s s (steps excluded)" % (variant, intra, blas, comp.group(1)), flush=True)
    rows = [m for m in re.finditer(r"^step (\d+) ms ([0-9.]+) cpu_ms ([0-9.]+)", out, re.M) if int(m.group(1)) > a.warmup]
    core = re.search(r"(openblas-[A-Za-z0-9]+|mkl)", out)
    return [float(m.group(2)) for m in rows], [float(m.group(3)) for m in rows], rss, l0, l1, core.group(1) if core else "?"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dsk", default=os.path.join(HERE, "..", "build", "examples", "train_moe"))
    p.add_argument("--python", default=sys.executable, help="PyTorch's interpreter (default: this one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--keep-openblas-env", action="store_true")
    p.add_argument("--peer-default-spin", action="store_true", help="run PyTorch with libgomp's default spin")
    p.add_argument("--variants", default="eager,sdpa,grouped,compile",
                   help="PyTorch variants: eager, sdpa, grouped, compile")
    p.add_argument("--model-args", dest="model_args", default="", help="model flags passed to both, e.g. --d-model 256")
    a = p.parse_args()
    variants = a.variants.split(",")
    if any(v not in ("eager", "sdpa", "grouped", "compile") for v in variants):
        sys.exit("bench_train: --variants takes eager, sdpa, grouped, compile")
    if a.steps <= a.warmup:
        sys.exit("bench_train: --steps must exceed --warmup")
    tokens = 16 * 128
    threads = [int(t) for t in a.threads.split(",")]
    # configurations: (label, threads, kind, intra, blas)
    configs = []
    for n in threads:
        configs.append(("dsk", n, "dsk", n, 0, ""))
        splits = [(1, 1)] if n == 1 else [(1, n), (n, 1)]
        for intra, blas in splits:
            for v in variants:
                configs.append(("torch %dx%d %s" % (intra, blas, v), n, "torch", intra, blas, v))
    res = {c: {"ms": [], "cpu": [], "rounds": [], "rss": 0.0, "load": [], "info": ""} for c in configs}
    print("# bench_train: %d rounds x %d steps (first %d dropped), %d tokens/step, started %s, load %.2f %.2f %.2f"
          % ((a.rounds, a.steps, a.warmup, tokens, time.strftime("%Y-%m-%d %H:%M:%S %Z")) + os.getloadavg()), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "dsk.jsonl")
        for r in range(a.rounds):
            order = configs if r % 2 == 0 else list(reversed(configs))
            for c in order:
                if c[2] == "dsk":
                    ms, cpu, rss, l0, l1, info = run_dsk(a, c[1], log)
                else:
                    ms, cpu, rss, l0, l1, info = run_torch(a, c[3], c[4], c[5])
                e = res[c]
                e["ms"] += ms
                e["cpu"] += cpu
                e["rounds"].append(statistics.median(ms))
                e["rss"] = max(e["rss"], rss)
                e["load"] += [l0, l1]
                e["info"] = info
                print("# round %d %-12s %d thr: median %.1f ms/step (load %.2f -> %.2f)"
                      % (r + 1, c[0], c[1], statistics.median(ms), l0, l1), flush=True)
    print()
    print("| threads | run | median ms/step | tokens/s | best round ms/step | CPU ms/step | peak RSS MB | load avg | kernel |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in configs:
        e = res[c]
        med = statistics.median(e["ms"])
        print("| %d | %s | %.1f | %.0f | %.1f | %.1f | %.0f | %.2f-%.2f | %s |"
              % (c[1], c[0], med, tokens / (med * 1e-3), min(e["rounds"]), statistics.median(e["cpu"]), e["rss"],
                 min(e["load"]), max(e["load"]), e["info"]))
    print()
    print("# columns: median ms/step = wall time per step over every timed step of every round; best round = the")
    print("# least disturbed round's median; CPU ms/step = process CPU time per step (all threads), which other")
    print("# programs on the cores disturb least (on a quiet machine at 1 thread it equals the wall time); load avg =")
    print("# the 1-minute load average before and after each run; kernel = dsk's GEMM micro-kernel, PyTorch's BLAS (MKL or OpenBLAS's core).")
    verdicts = []
    for n in threads:
        for what, key, pick in (("median step", "ms", statistics.median), ("best round", "rounds", min),
                                ("CPU time per step", "cpu", statistics.median)):
            d = pick(res[("dsk", n, "dsk", n, 0, "")][key])
            best = min((pick(res[c][key]), c[0]) for c in configs if c[1] == n and c[2] == "torch")
            print("ratio %d thread%s, %s: dsk %.0f tokens/s / PyTorch best (%s) %.0f tokens/s = %.2fx"
                  % (n, "s" if n > 1 else "", what, tokens / (d * 1e-3), best[1], tokens / (best[0] * 1e-3), best[0] / d))
            verdicts.append("%d thr %s %.2fx %s" % (n, what, best[0] / d, "met" if best[0] / d >= 1.5 else "NOT met"))
    print("# goal (issue 20): dsk at 1.5x or better of PyTorch's best split at each thread count: " + "; ".join(verdicts))
    print("# finished %s, load %.2f %.2f %.2f" % ((time.strftime("%Y-%m-%d %H:%M:%S %Z"),) + os.getloadavg()))


if __name__ == "__main__":
    main()
