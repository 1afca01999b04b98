"""bench/moe_torch.py - the PyTorch peer of bench/bench_moe.c: the same MoE layer written the way
Hugging Face's DeepSeek-V2 modeling code does in training (repeat_interleave the tokens, loop over
the experts with a boolean mask, weighted sum over the top-k, add the shared experts), run on the
inputs and weights that bench_moe wrote, timed forward + backward. Prints one line:
    torch_ms=<median ms> maxrel=<max |y_torch - y_dsk| / max |y_dsk|>
Usage (bench_moe runs it): /usr/bin/python3 bench/moe_torch.py FILE T D E K F Fs SIGMOID NORM SCALE
                           N_GROUP TOPK_GROUP WARMUP REPEATS THREADS DEVICE
DEVICE cpu: f32; cuda: bf16 weights and activations, f32 router (prints torch_ms=0 without CUDA).
"""
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F


def load(path, T, D, E, F_, Fs):
    a = np.fromfile(path, dtype=np.float32)
    sizes = [("x", T * D), ("dy", T * D), ("router", E * D), ("bias", E), ("w1", E * F_ * D), ("w2", E * D * F_),
             ("w3", E * F_ * D), ("s1", Fs * D), ("s2", D * Fs), ("s3", Fs * D), ("y", T * D)]
    out, off = {}, 0
    for name, n in sizes:
        out[name] = torch.from_numpy(a[off:off + n].copy())
        off += n
    assert off == a.size, (off, a.size)
    return out


class Expert(torch.nn.Module):
    def __init__(self, w1, w2, w3):
        super().__init__()
        self.gate_proj = torch.nn.Parameter(w1)  # (F, D)
        self.down_proj = torch.nn.Parameter(w2)  # (D, F)
        self.up_proj = torch.nn.Parameter(w3)    # (F, D)

    def forward(self, x):
        return F.linear(F.silu(F.linear(x, self.gate_proj)) * F.linear(x, self.up_proj), self.down_proj)


def gate(x, router, bias, K, sigmoid, norm, scale, n_group, topk_group):
    logits = F.linear(x.float(), router.float())
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    choice = scores.detach() + bias  # selection only: the bias never enters the weights
    T, E = choice.shape
    if n_group > 1:
        g = choice.view(T, n_group, -1)
        gs = g.topk(2, dim=-1)[0].sum(-1) if sigmoid and E // n_group > 1 else g.max(-1).values
        idx = gs.topk(topk_group, dim=-1)[1]
        mask = torch.zeros_like(gs).scatter_(1, idx, 1).bool()
        choice = choice.masked_fill(~mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E), float("-inf"))
    topk_idx = choice.topk(K, dim=-1)[1]
    w = scores.gather(1, topk_idx)
    if norm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_idx, (w * scale).to(x.dtype)


def moe_forward(x, p, experts, shared, cfg):
    T, D, E, K = cfg["T"], cfg["D"], cfg["E"], cfg["K"]
    topk_idx, topk_w = gate(x, p["router"], p["bias"], K, cfg["sigmoid"], cfg["norm"], cfg["scale"], cfg["n_group"],
                            cfg["topk_group"])
    xr = x.repeat_interleave(K, dim=0)
    flat = topk_idx.view(-1)
    y = torch.empty_like(xr)
    for i, expert in enumerate(experts):
        y[flat == i] = expert(xr[flat == i])
    y = (y.view(T, K, D) * topk_w.unsqueeze(-1)).sum(dim=1)
    if shared is not None:
        y = y + shared(x)
    return y


def main():
    a = sys.argv
    path = a[1]
    T, D, E, K, F_, Fs, sig, norm = (int(v) for v in a[2:10])
    scale = float(a[10])
    n_group, topk_group, warmup, repeats, threads = (int(v) for v in a[11:16])
    dev = a[16] if len(a) > 16 else "cpu"
    if dev == "cuda" and not torch.cuda.is_available():
        print("torch_ms=0 maxrel=-1")
        return
    torch.set_num_threads(threads)
    cfg = dict(T=T, D=D, E=E, K=K, sigmoid=sig, norm=norm, scale=scale, n_group=n_group, topk_group=topk_group)
    p = load(path, T, D, E, F_, Fs)
    if dev == "cuda":  # bf16 compute, router and bias in f32 as in dsk
        p = {k: v.cuda() if k in ("router", "bias", "y") else v.cuda().bfloat16() for k, v in p.items()}
    w1, w2, w3 = p["w1"].view(E, F_, D), p["w2"].view(E, D, F_), p["w3"].view(E, F_, D)
    experts = torch.nn.ModuleList([Expert(w1[i].clone(), w2[i].clone(), w3[i].clone()) for i in range(E)])
    shared = Expert(p["s1"].view(Fs, D), p["s2"].view(D, Fs), p["s3"].view(Fs, D)) if Fs > 0 else None
    router = torch.nn.Parameter(p["router"].view(E, D))
    p["router"] = router
    x0 = p["x"].view(T, D)
    dy = p["dy"].view(T, D)
    times = []
    y = None
    for it in range(warmup + repeats):
        x = x0.clone().requires_grad_(True)
        t0 = time.perf_counter()
        y = moe_forward(x, p, experts, shared, cfg)
        y.backward(dy)
        if dev == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        if it >= warmup:
            times.append(t1 - t0)
    y_dsk = p["y"].view(T, D)
    maxrel = (y.detach().float() - y_dsk).abs().max().item() / max(y_dsk.abs().max().item(), 1e-30)
    print("torch_ms=%.3f maxrel=%.3g" % (1e3 * float(np.median(times)), maxrel))


if __name__ == "__main__":
    main()
