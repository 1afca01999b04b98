"""Peer for bench/bench_ckpt.c: Python safetensors saving the same tensors.

    python3 bench/ckpt_peer.py N_TENSORS REPEATS DIR [WARMUP=1]

N tensors of 16 MiB alternating f32 (2048, 2048) and bf16 (2048, 4096), as bench_ckpt
makes them, written with safetensors.serialize_file (what safetensors.numpy.save_file
calls; the raw-buffer API also carries bf16, which numpy lacks). WARMUP runs, then the
median of REPEATS; prints "peer save_file <s> fsync <s>": the time of serialize_file alone
(safetensors never fsyncs) and of serialize_file followed by an fsync of the file.
"""
import os
import statistics
import sys
import time

import numpy as np
import safetensors


def main():
    n, reps, d = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    warmup = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    rng = np.random.default_rng(7)
    arrays = {}
    for i in range(n):
        if i % 2:
            a = rng.integers(0, 2**16, (2048, 4096), dtype=np.uint16)
            arrays[f"layer.{i:03d}.w_bf16"] = ("bfloat16", a)
        else:
            arrays[f"layer.{i:03d}.w_f32"] = ("float32", rng.standard_normal((2048, 2048), dtype=np.float32))
    specs = {k: safetensors.TensorSpec(dtype=t, shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes) for k, (t, a) in arrays.items()}
    path = os.path.join(d, "peer.safetensors")
    plain, synced = [], []
    for r in range(reps + warmup):
        for want_sync, out in ((False, plain), (True, synced)):
            if os.path.exists(path):
                os.unlink(path)
            t0 = time.perf_counter()
            safetensors.serialize_file(specs, path)
            if want_sync:
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            dt = time.perf_counter() - t0
            if r >= warmup:
                out.append(dt)
            if not want_sync:  # let the unsynced write reach the disk outside the timed region
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
    os.unlink(path)
    print(f"peer save_file {statistics.median(plain):.6f} fsync {statistics.median(synced):.6f}")


if __name__ == "__main__":
    main()
