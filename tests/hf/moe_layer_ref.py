"""A DeepSeek-V2/V3 MoE layer of a Hugging Face checkpoint in float64, in plain Python (no numpy,
no safetensors package), to check examples/hf_moe_layer.c (tests/test_teach.sh).

usage: moe_layer_ref.py MODEL_DIR OUT.safetensors
OUT holds x (T, D) and y (T, D) as hf_moe_layer wrote them and the layer in its __metadata__.
Reads the layer's tensors from MODEL_DIR (F32, or F8_E4M3 with weight_scale_inv blocks), runs
transformers' routing (V3: sigmoid + e_score_correction_bias, groups by their two best scores;
V2: softmax, groups by their best) and SwiGLU experts in float64 on x, and compares with y.
Prints the largest error and the smallest routing margin; exits 1 when an element of y is off by
more than 1e-5 (1 + |reference|). A token whose routing is within 1e-5 of a tie (its k-th and
(k+1)-th scores, or its last kept and first dropped group) may route otherwise in float32: it is
left out and counted, and more than a quarter of the tokens left out fails too."""
import json
import math
import os
import struct
import sys


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


def read(path, name):
    h, base = header(path)
    e = h[name]
    with open(path, "rb") as f:
        f.seek(base + e["data_offsets"][0])
        raw = f.read(e["data_offsets"][1] - e["data_offsets"][0])
    if e["dtype"] == "F32":
        vals = list(struct.unpack("<%df" % (len(raw) // 4), raw))
    elif e["dtype"] == "F8_E4M3":
        vals = [e4m3(b) for b in raw]
    else:
        raise SystemExit("%s: %s is %s, not F32 or F8_E4M3" % (path, name, e["dtype"]))
    return vals, e["shape"], e["dtype"]


def e4m3(b):
    s, e, m = -1.0 if b & 0x80 else 1.0, (b >> 3) & 15, b & 7
    if e == 15 and m == 7:
        return math.nan
    return s * (m / 8.0 * 2.0 ** -6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7))


class Model:
    def __init__(self, d):
        self.dir = d
        self.cfg = json.load(open(os.path.join(d, "config.json")))
        self.map = json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]
        q = self.cfg.get("quantization_config") or {}
        self.block = q.get("weight_block_size", [128, 128])

    def matrix(self, name):
        """name as a list of rows of float64, FP8 dequantised by its scale_inv blocks."""
        v, (r, c), dt = read(os.path.join(self.dir, self.map[name]), name)
        rows = [v[i * c:(i + 1) * c] for i in range(r)]
        if dt == "F8_E4M3":
            s, (_, sc), _ = read(os.path.join(self.dir, self.map[name + "_scale_inv"]), name + "_scale_inv")
            br, bc = self.block
            rows = [[rows[i][j] * s[(i // br) * sc + j // bc] for j in range(c)] for i in range(r)]
        return rows

    def vector(self, name):
        return read(os.path.join(self.dir, self.map[name]), name)[0]


def matvec(w, x):
    return [math.fsum(a * b for a, b in zip(row, x)) for row in w]


def silu(v):
    return v / (1.0 + math.exp(-v))


def mlp(w1, w3, w2, x):
    h = [silu(a) * b for a, b in zip(matvec(w1, x), matvec(w3, x))]
    return matvec(w2, h)


def top(vals, k):
    """Indices of the k largest (ties: lower index), and the gap from the k-th to the next."""
    order = sorted(range(len(vals)), key=lambda i: (-vals[i], i))
    gap = vals[order[k - 1]] - vals[order[k]] if k < len(vals) else math.inf
    return order[:k], gap


def route(cfg, logits, bias):
    """(experts, weights, margin) of one token, as transformers' DeepseekV2/V3 MoE gates do."""
    E, K = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    v3 = cfg["scoring_func"] == "sigmoid"
    if v3:
        p = [1.0 / (1.0 + math.exp(-u)) for u in logits]
    else:
        mx = max(logits)
        ex = [math.exp(u - mx) for u in logits]
        p = [a / math.fsum(ex) for a in ex]
    c = [a + b for a, b in zip(p, bias)] if bias else list(p)
    margin = math.inf
    if cfg["topk_method"] != "greedy" and cfg["n_group"] > 1:
        G, keep = cfg["n_group"], cfg["topk_group"]
        gs = E // G
        width = 2 if v3 else 1
        gscore = [math.fsum(sorted(c[g * gs:(g + 1) * gs], reverse=True)[:width]) for g in range(G)]
        kept, margin = top(gscore, keep)
        c = [c[j] if j // gs in kept else -math.inf for j in range(E)]
    sel, gap = top(c, K)
    margin = min(margin, gap)
    w = [p[j] for j in sel]
    if cfg["norm_topk_prob"] and K > 1:
        s = math.fsum(w) + 1e-20
        w = [a / s for a in w]
    return sel, [a * cfg["routed_scaling_factor"] for a in w], margin


def main():
    mdir, out = sys.argv[1], sys.argv[2]
    m = Model(mdir)
    h, _ = header(out)
    layer = int(h["__metadata__"]["layer"])
    x, (T, D), _ = read(out, "x")
    y, _, _ = read(out, "y")
    pre = "model.layers.%d.mlp." % layer
    gate = m.matrix(pre + "gate.weight")
    bias = m.vector(pre + "gate.e_score_correction_bias") if m.cfg["scoring_func"] == "sigmoid" else None
    experts = {}
    shared = [m.matrix(pre + "shared_experts.%s_proj.weight" % n) for n in ("gate", "up", "down")]
    worst, margin, ties = 0.0, math.inf, 0
    for t in range(T):
        xt = x[t * D:(t + 1) * D]
        sel, w, mg = route(m.cfg, matvec(gate, xt), bias)
        margin = min(margin, mg)
        if mg < 1e-5:
            ties += 1
            continue
        want = mlp(*shared, xt)
        for e, g in zip(sel, w):
            if e not in experts:
                experts[e] = [m.matrix(pre + "experts.%d.%s_proj.weight" % (e, n)) for n in ("gate", "up", "down")]
            want = [a + g * b for a, b in zip(want, mlp(*experts[e], xt))]
        for j in range(D):
            worst = max(worst, abs(y[t * D + j] - want[j]) / (1.0 + abs(want[j])))
    print("layer %d of %s, %d tokens: largest error %.3g (bound 1e-5), smallest routing margin %.3g, %d near ties"
          " left out" % (layer, mdir, T, worst, margin, ties))
    sys.exit(0 if worst <= 1e-5 and 4 * ties <= T else 1)


main()
