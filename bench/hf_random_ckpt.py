#!/usr/bin/env python3
"""A random DeepSeek-V2-Lite-shaped Hugging Face checkpoint for timing `train_moe --init-from-hf`
(bench/RESULTS.md): V2-Lite's widths (hidden 2048, 16 heads, no query latent, kv_lora 512, nope
128, rope 64, v 128, dense FFN 10944, expert FFN 1408, 2 shared experts, top-6 softmax) with
fewer layers, experts and vocabulary so that the training state fits this machine.

  python3 bench/hf_random_ckpt.py DIR [--layers 2] [--experts 16] [--vocab 16384] [--fp8]

Writes config.json, shards of at most 400 MB in bf16 (or, with --fp8, the attention and FFN
matrices in e4m3 with 128x128 weight_scale_inv blocks) and model.safetensors.index.json, with
numpy only (bf16 and e4m3 bits written by hand). Not a test: the weights are noise.
"""
import argparse
import json
import os
import struct

import numpy as np


def bf16_bits(x):
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even (no NaN here)


def e4m3_bits(x):
    """float32 (|x| <= 448) -> e4m3fn bits, round to nearest even, via a table of the 127 positive codes."""
    codes = np.arange(0, 127, dtype=np.uint8)
    e, m = (codes >> 3).astype(np.int32), (codes & 7).astype(np.float64)
    vals = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    a = np.abs(x).astype(np.float64)
    i = np.clip(np.searchsorted(vals, a), 1, 126)
    lo, hi = vals[i - 1], vals[i]
    pick_hi = (a - lo > hi - a) | ((a - lo == hi - a) & (i % 2 == 0))
    q = np.where(pick_hi, i, i - 1).astype(np.uint8)
    return q | (np.signbit(x).astype(np.uint8) << 7)


def fp8_blocks(w):
    r, c = w.shape
    sr, sc = -(-r // 128), -(-c // 128)
    scale = np.ones((sr, sc), np.float32)
    q = np.empty((r, c), np.uint8)
    for i in range(sr):
        for j in range(sc):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            amax = float(np.abs(blk).max())
            s = np.float32(amax / 448.0 if amax > 0 else 1.0)
            scale[i, j] = s
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = e4m3_bits(blk / s)
    return q, scale


def write_shard(path, items):
    header, off, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name, dtype, shape, data in items:
        b = data.tobytes()
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def tensors(cfg, fp8, rng):
    D, H, V = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
    qk, R, dv = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["kv_lora_rank"], cfg["v_head_dim"]
    F, Fe, E = cfg["intermediate_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    Fs = Fe * cfg["n_shared_experts"]

    def mat(name, r, c, quant=True):
        w = (rng.standard_normal((r, c), dtype=np.float32) * 0.02).astype(np.float32)
        if fp8 and quant:
            q, s = fp8_blocks(w)
            return [(name, "F8_E4M3", (r, c), q), (name + "_scale_inv", "F32", s.shape, s)]
        return [(name, "BF16", (r, c), bf16_bits(w))]

    def norm(name, n):
        return [(name, "BF16", (n,), bf16_bits(np.ones(n, np.float32)))]

    yield mat("model.embed_tokens.weight", V, D, False)
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        yield norm(p + "input_layernorm.weight", D) + norm(p + "post_attention_layernorm.weight", D)
        yield mat(p + "self_attn.q_proj.weight", H * qk, D) + mat(p + "self_attn.kv_a_proj_with_mqa.weight",
                                                                  R + cfg["qk_rope_head_dim"], D)
        yield norm(p + "self_attn.kv_a_layernorm.weight", R) + mat(p + "self_attn.kv_b_proj.weight",
                                                                   H * (cfg["qk_nope_head_dim"] + dv), R)
        yield mat(p + "self_attn.o_proj.weight", D, H * dv)
        if l < cfg["first_k_dense_replace"]:
            for n, r, c in (("gate_proj", F, D), ("up_proj", F, D), ("down_proj", D, F)):
                yield mat(p + f"mlp.{n}.weight", r, c)
            continue
        yield mat(p + "mlp.gate.weight", E, D, False)
        for e in range(E):
            for n, r, c in (("gate_proj", Fe, D), ("up_proj", Fe, D), ("down_proj", D, Fe)):
                yield mat(p + f"mlp.experts.{e}.{n}.weight", r, c)
        for n, r, c in (("gate_proj", Fs, D), ("up_proj", Fs, D), ("down_proj", D, Fs)):
            yield mat(p + f"mlp.shared_experts.{n}.weight", r, c)
    yield norm("model.norm.weight", D) + mat("lm_head.weight", V, D, False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--fp8", action="store_true")
    a = ap.parse_args()
    cfg = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=a.vocab, hidden_size=2048,
               intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=a.layers, first_k_dense_replace=1,
               moe_layer_freq=1, n_routed_experts=a.experts, n_shared_experts=2, num_experts_per_tok=6, n_group=1,
               topk_group=1, topk_method="greedy", scoring_func="softmax", norm_topk_prob=False,
               routed_scaling_factor=1.0, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128, num_attention_heads=16, num_key_value_heads=16,
               rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=False,
               max_position_embeddings=4096, hidden_act="silu", attention_bias=False, torch_dtype="bfloat16")
    if a.fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                      "activation_scheme": "dynamic"}
    os.makedirs(a.dir, exist_ok=True)
    rng = np.random.default_rng(0)
    shards, cur, size, wm, total = [], [], 0, {}, 0
    for group in tensors(cfg, a.fp8, rng):
        for t in group:
            n = t[3].nbytes
            if cur and size + n > 400e6:
                shards.append(cur)
                cur, size = [], 0
            cur.append(t)
            size += n
            total += n
    shards.append(cur)
    for i, items in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_shard(os.path.join(a.dir, fn), items)
        wm.update({t[0]: fn for t in items})
    with open(os.path.join(a.dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wm}, f, indent=1)
    with open(os.path.join(a.dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    print(f"{a.dir}: {len(wm)} tensors, {total / 1e6:.0f} MB in {len(shards)} shards")


if __name__ == "__main__":
    main()
