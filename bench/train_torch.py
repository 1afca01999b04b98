"""bench/train_torch.py - the PyTorch peer of `make run`: the model of examples/train_moe.c's default
configuration written the way a PyTorch user would, trained on the same corpus, one timed step per
line. bench/bench_train.py runs it next to build/examples/train_moe.

The model (examples/train_model.h and dsk_moe.h): byte vocabulary 256, 4 blocks, d_model 128,
4 heads, RoPE (interleaved pairs, theta 1e4), RMSNorm (eps 1e-5), causal attention; block 0 has a
dense SwiGLU FFN (hidden 384), blocks 1-3 a DeepSeek MoE: 8 routed experts (sigmoid scores,
top-2 selected by score + bias, weights normalised), 1 shared expert, expert hidden 128,
auxiliary-loss-free bias update (rate 1e-2). Untied LM head. AdamW (betas 0.9/0.95, weight decay
0.1 on matrices), global-norm clipping at 1.0, linear warm-up then cosine learning rate.
The MoE is the idiomatic sort-by-expert form: argsort the (token, slot) pairs by expert, one
batched SwiGLU per expert over its contiguous rows, index_add_ the weighted rows back.

Variants a PyTorch 2.x user would run: --sdpa computes attention with
F.scaled_dot_product_attention(is_causal=True) (fused, no (T, T) probabilities kept); --grouped runs
the routed experts as three grouped GEMMs (torch._grouped_mm over the sorted rows, its offsets the
experts' cumulative counts: PyTorch's own grouped GEMM, CPU and f32 included in 2.15) instead of the
loop; --compile wraps the model in torch.compile (inductor's C++/OpenMP code on the CPU): its first
--compile-steps steps (compilation and recompilation) print as `# compile step` lines, apart from
the timed ones, and `# compile_s` sums them.

Usage: /usr/bin/python3 bench/train_torch.py --steps 40 --threads 1 [--sdpa] [--grouped] [--compile] [--seq 128 ...]
Prints a header line (`# torch ..., openblas-<core>/<threads>, ...`), then one line per step:
`step <i> ms <wall> cpu_ms <CPU time of every thread> loss <l>`.
Thread split: --threads sets torch.set_num_threads (intra-op OpenMP); the BLAS pool (OpenBLAS
pthreads) is set by OPENBLAS_NUM_THREADS in the environment (bench_train.py does that). """
import argparse
import ctypes
import math
import os
import resource
import sys
import time

import torch
import torch.nn.functional as F


def header_corpus(root, cap):
    """The default corpus of examples/train_data.h: *.h files under root, files before
    directories, names sorted, depth-first, capped at `cap` bytes."""
    buf = bytearray()

    def walk(d, depth):
        try:
            names = sorted(n for n in os.listdir(d) if not n.startswith("."))
        except OSError:
            return
        for n in names:
            if len(buf) >= cap:
                return
            p = os.path.join(d, n)
            if n.endswith(".h") and os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as f:
                    buf.extend(f.read(cap - len(buf)))
        for n in names:
            if len(buf) >= cap:
                return
            p = os.path.join(d, n)
            if os.path.isdir(p) and not os.path.islink(p) and depth < 16:
                walk(p, depth + 1)

    walk(root, 0)
    return torch.frombuffer(buf, dtype=torch.uint8).long()


class RMSNorm(torch.nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, cos, sin):
    """x (B, T, H, Dh); pairs (2i, 2i+1) rotated by pos * theta^(-2i/Dh)."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class SwiGLU(torch.nn.Module):
    def __init__(self, d, f, std, out_std):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(f, d) * std)
        self.w3 = torch.nn.Parameter(torch.randn(f, d) * std)
        self.w2 = torch.nn.Parameter(torch.randn(d, f) * out_std)

    def forward(self, x):
        return F.linear(F.silu(F.linear(x, self.w1)) * F.linear(x, self.w3), self.w2)


class MoE(torch.nn.Module):
    def __init__(self, d, n_experts, top_k, f, n_shared, std, grouped):
        super().__init__()
        self.E, self.K, self.grouped = n_experts, top_k, grouped
        self.router = torch.nn.Parameter(torch.randn(n_experts, d) * std)
        self.register_buffer("bias", torch.zeros(n_experts))
        self.register_buffer("load", torch.zeros(n_experts))
        self.w1 = torch.nn.Parameter(torch.randn(n_experts, f, d) * std)
        self.w3 = torch.nn.Parameter(torch.randn(n_experts, f, d) * std)
        self.w2 = torch.nn.Parameter(torch.randn(n_experts, d, f) * std)
        self.shared = SwiGLU(d, f * n_shared, std, std) if n_shared else None

    def forward(self, x):
        T, D = x.shape
        scores = F.linear(x, self.router).sigmoid()                      # (T, E)
        idx = (scores.detach() + self.bias).topk(self.K, dim=-1).indices  # selection only
        w = scores.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        flat = idx.flatten()
        counts = torch.bincount(flat, minlength=self.E)
        if self.training:
            self.load += counts
        order = flat.argsort(stable=True)
        tok = order // self.K
        xs = x[tok]
        if self.grouped:
            offs = counts.cumsum(0).to(torch.int32)
            h = F.silu(torch._grouped_mm(xs, self.w1.transpose(-2, -1), offs=offs))
            h = h * torch._grouped_mm(xs, self.w3.transpose(-2, -1), offs=offs)
            ys = torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)
        else:
            outs = []
            for e, chunk in enumerate(xs.split(counts.tolist())):
                if chunk.shape[0]:
                    outs.append(F.linear(F.silu(F.linear(chunk, self.w1[e])) * F.linear(chunk, self.w3[e]), self.w2[e]))
            ys = torch.cat(outs)
        ys = ys * w.flatten()[order].unsqueeze(1)
        y = torch.zeros_like(x).index_add_(0, tok, ys)
        if self.shared is not None:
            y = y + self.shared(x)
        return y

    @torch.no_grad()
    def update_bias(self, rate):
        mean = self.load.mean()
        self.bias += rate * torch.sign(mean - self.load)
        self.load.zero_()


class Block(torch.nn.Module):
    def __init__(self, a, moe, out_std):
        super().__init__()
        D = a.d_model
        self.H, self.sdpa = a.heads, a.sdpa
        self.ln1, self.ln2 = RMSNorm(D, 1e-5), RMSNorm(D, 1e-5)
        self.wq, self.wk, self.wv = (torch.nn.Parameter(torch.randn(D, D) * a.init_std) for _ in range(3))
        self.wo = torch.nn.Parameter(torch.randn(D, D) * out_std)
        if moe:
            self.ffn = MoE(D, a.experts, a.top_k, a.expert_hidden, a.shared, a.init_std, a.grouped)
        else:
            self.ffn = SwiGLU(D, a.ffn_hidden, a.init_std, out_std)

    def forward(self, x, cos, sin, mask):
        B, T, D = x.shape
        H, Dh = self.H, D // self.H
        h = self.ln1(x)
        q = rope(F.linear(h, self.wq).view(B, T, H, Dh), cos, sin).transpose(1, 2)
        k = rope(F.linear(h, self.wk).view(B, T, H, Dh), cos, sin).transpose(1, 2)
        v = F.linear(h, self.wv).view(B, T, H, Dh).transpose(1, 2)
        if self.sdpa:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(Dh))
            o = att.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
        o = o.transpose(1, 2).reshape(B, T, D)
        x = x + F.linear(o, self.wo)
        h = self.ln2(x)
        if isinstance(self.ffn, MoE):
            return x + self.ffn(h.reshape(B * T, D)).view(B, T, D)
        return x + self.ffn(h)


class Model(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        D, V = a.d_model, 256
        out_std = a.init_std / math.sqrt(2.0 * a.layers)
        self.embed = torch.nn.Parameter(torch.randn(V, D) * a.init_std)
        self.blocks = torch.nn.ModuleList(Block(a, l >= a.dense_layers, out_std) for l in range(a.layers))
        self.ln_f = RMSNorm(D, 1e-5)
        self.lm_head = torch.nn.Parameter(torch.randn(V, D) * a.init_std)
        Dh, T = D // a.heads, a.seq
        inv = 10000.0 ** (-2.0 * torch.arange(Dh // 2, dtype=torch.float32) / Dh)
        ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None, :]  # (T, Dh/2)
        self.register_buffer("cos", ang.cos()[None, :, None, :])
        self.register_buffer("sin", ang.sin()[None, :, None, :])
        self.register_buffer("mask", torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1))

    def forward(self, ids, targets):
        x = F.embedding(ids, self.embed)
        for b in self.blocks:
            x = b(x, self.cos, self.sin, self.mask)
        logits = F.linear(self.ln_f(x), self.lm_head)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def blas_core():
    """torch's BLAS: MKL (PyPI's torch 2.x) or the kernel family OpenBLAS picked (Debian's 1.13 on the
    libblas alternative)."""
    if torch.backends.mkl.is_available():
        return "mkl/%d" % torch.get_num_threads()
    try:
        lib = ctypes.CDLL("libopenblas.so.0")
        lib.openblas_get_corename.restype = ctypes.c_char_p
        lib.openblas_get_num_threads.restype = ctypes.c_int
        return "openblas-%s/%d" % (lib.openblas_get_corename().decode(), lib.openblas_get_num_threads())
    except OSError:
        return "unknown"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (intra-op)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--d-model", dest="d_model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dense-layers", dest="dense_layers", type=int, default=1)
    p.add_argument("--ffn-hidden", dest="ffn_hidden", type=int, default=384)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--shared", type=int, default=1)
    p.add_argument("--top-k", dest="top_k", type=int, default=2)
    p.add_argument("--expert-hidden", dest="expert_hidden", type=int, default=128)
    p.add_argument("--init-std", dest="init_std", type=float, default=0.02)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", dest="min_lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--total-steps", dest="total_steps", type=int, default=500, help="length of the lr schedule")
    p.add_argument("--bias-rate", dest="bias_rate", type=float, default=1e-2)
    p.add_argument("--corpus", default="/usr/include")
    p.add_argument("--corpus-mb", dest="corpus_mb", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--sdpa", action="store_true", help="fused causal attention (F.scaled_dot_product_attention)")
    p.add_argument("--grouped", action="store_true", help="the routed experts through torch._grouped_mm")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    p.add_argument("--compile-steps", dest="compile_steps", type=int, default=3,
                   help="first steps of a compiled model reported apart (compilation)")
    a = p.parse_args()
    if a.sdpa and not hasattr(F, "scaled_dot_product_attention"):
        sys.exit("train_torch: --sdpa needs torch 2.x (this is %s)" % torch.__version__)
    if a.grouped and not hasattr(torch, "_grouped_mm"):
        sys.exit("train_torch: --grouped needs torch._grouped_mm (torch 2.15 has it; this is %s)" % torch.__version__)
    if a.compile and not hasattr(torch, "compile"):
        sys.exit("train_torch: --compile needs torch 2.x (this is %s)" % torch.__version__)

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    data = header_corpus(a.corpus, int(a.corpus_mb * 1e6))
    model = Model(a)
    n_params = sum(q.numel() for q in model.parameters())
    decay = [q for q in model.parameters() if q.dim() >= 2]
    plain = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    moes = [b.ffn for b in model.blocks if isinstance(b.ffn, MoE)]
    run_model = torch.compile(model) if a.compile else model
    print("# torch %s, %s, intra-op threads %d, interop %d, %.2fM parameters, %d tokens/step, corpus %.2f MB, "
          "attention %s%s%s" % (torch.__version__, blas_core(), torch.get_num_threads(), torch.get_num_interop_threads(),
                              n_params / 1e6, a.batch * a.seq, data.numel() / 1e6, "sdpa" if a.sdpa else "materialised",
                              ", grouped experts" if a.grouped else "", ", torch.compile" if a.compile else ""),
          flush=True)
    compile_s = 0.0
    gen = torch.Generator().manual_seed(a.seed)
    for step in range(1, a.steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        if a.warmup > 0 and step <= a.warmup:
            lr = a.lr * step / a.warmup
        else:
            x = min(1.0, (step - a.warmup) / max(1, a.total_steps - a.warmup))
            lr = a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * x))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, data.numel() - a.seq - 1, (a.batch,), generator=gen)
        win = torch.stack([data[s:s + a.seq + 1] for s in starts.tolist()])
        ids, targets = win[:, :-1], win[:, 1:]
        loss = run_model(ids, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for m in moes:
            m.update_bias(a.bias_rate)
        ms, cpu_ms = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
        if a.compile and step <= a.compile_steps:
            compile_s += ms * 1e-3
            print("# compile step %d ms %.3f loss %.4f" % (step, ms, loss.item()), flush=True)
            continue
        print("step %d ms %.3f cpu_ms %.3f loss %.4f" % (step, ms, cpu_ms, loss.item()), flush=True)
    if a.compile:
        print("# compile_s %.2f (the first %d steps)" % (compile_s, a.compile_steps), flush=True)
    print("# peak_rss_mb %.1f" % (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0), flush=True)


if __name__ == "__main__":
    sys.exit(main())
