#!/usr/bin/env python3
"""Generates the tiny Hugging Face DeepSeek fixtures under tests/hf/ (run once by hand; CI never
runs it: it needs torch and transformers, and the outputs are committed).

For each fixture (v3: DeepseekV3ForCausalLM with a query latent, sigmoid noaux_tc routing, one
dense layer then MoE with a shared expert; v2: DeepseekV2ForCausalLM with q_lora_rank null and
softmax group_limited_greedy routing) it writes, under tests/hf/<name>/:
  config.json, model-0000k-of-00002.safetensors, model.safetensors.index.json   the hub layout
  reference.safetensors   tokens (B, T + 1) i32, logits (B, T, V) f32 of transformers on
                          tokens[:, :T], loss f32 = mean cross-entropy against tokens[:, 1:]
The weights are drawn here with a fixed seed; the directory is then loaded back with
AutoModelForCausalLM.from_pretrained and its logits must equal those of the model that wrote
it (so transformers itself reads the names and layouts the fixture holds). v3_fp8/ holds the
v3 weights as FP8 e4m3 with weight_scale_inv blocks of 16x16 (quantization_config
weight_block_size [16, 16]: partial edge blocks on every matrix whose sizes are not multiples
of 16), written as the DeepSeek-V3 release lays them out.
v3 also holds one MTP layer (num_nextn_predict_layers 1, model.layers.2.*: the block with an MoE FFN,
enorm, hnorm, eh_proj, shared_head.norm, and embed_tokens / shared_head.head as copies of the model's),
drawn here: transformers skips it, so reference.safetensors adds mtp_logits (B, T - 1, V) and mtp_loss
of that layer computed in float64 from its module semantics (DeepSeek-V3 report section 2.2:
eh_proj([enorm(emb(t_{i+1})) | hnorm(h_i)]), the block over positions 0 .. T-2 with causal attention,
shared_head.norm, the head; targets t_{i+2}), h the main model's last block output.

Usage: python3 tests/hf/make_fixture.py   (from the repository root)
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
B, T = 2, 8

COMMON = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, first_k_dense_replace=1, moe_layer_freq=1,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=8, rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6,
    tie_word_embeddings=False, max_position_embeddings=64, hidden_act="silu", attention_bias=False,
    num_nextn_predict_layers=0, torch_dtype="float32", bos_token_id=0, eos_token_id=1,
)
V3 = dict(COMMON, num_nextn_predict_layers=1, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
          q_lora_rank=16, n_group=2, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
          routed_scaling_factor=2.5, rope_interleave=True)
V2 = dict(COMMON, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=None, n_group=4,
          topk_group=2, topk_method="group_limited_greedy", scoring_func="softmax", norm_topk_prob=False,
          routed_scaling_factor=1.0)


def hub_state(model, cfg):
    """The model's tensors under the hub's names: experts one by one, (out, in) layouts."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach().to(torch.float32).contiguous()
        if k.endswith("mlp.experts.gate_up_proj"):
            f = cfg["moe_intermediate_size"]
            for e in range(v.shape[0]):
                out[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :f].clone()
                out[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, f:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                out[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e].clone()
        else:
            out[k] = v
    return out


def write_sharded(d, tensors):
    """Two shards (names sorted, split in the middle) and the index."""
    os.makedirs(d, exist_ok=True)
    names = sorted(tensors)
    half = len(names) // 2
    parts = [names[:half], names[half:]]
    wm, total = {}, 0
    for i, part in enumerate(parts):
        fn = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file({n: tensors[n] for n in part}, os.path.join(d, fn), metadata={"format": "pt"})
        for n in part:
            wm[n] = fn
            total += tensors[n].numel() * tensors[n].element_size()
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wm}, f, indent=2, sort_keys=True)


def draw_weights(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k, p in sorted(model.state_dict(keep_vars=True).items()):
            if k.endswith("e_score_correction_bias"):  # small and positive: the selection it changes is exercised
                p.copy_(0.05 * torch.rand(p.shape, generator=g))
            elif p.ndim == 1:  # norm weights around 1
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def logits_and_loss(model, tokens):
    with torch.no_grad():
        out = model(input_ids=tokens[:, :T].long())
    logits = out.logits.to(torch.float32)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                             tokens[:, 1:].reshape(-1).long()).to(torch.float32)
    return logits, loss


def fp8_blocks(w, bs):
    """w (out, in) f32 -> (e4m3 weight, f32 scale_inv (ceil(out/bs), ceil(in/bs))): scale_inv = amax / 448
    of each block (1 for an all-zero block), weight = w / scale_inv rounded to e4m3."""
    o, i = w.shape
    so, si = (o + bs - 1) // bs, (i + bs - 1) // bs
    scale = torch.ones(so, si, dtype=torch.float32)
    q = torch.empty(o, i, dtype=torch.float8_e4m3fn)
    for r in range(so):
        for c in range(si):
            blk = w[r * bs:(r + 1) * bs, c * bs:(c + 1) * bs]
            amax = blk.abs().max().item()
            s = amax / 448.0 if amax > 0 else 1.0
            scale[r, c] = s
            q[r * bs:(r + 1) * bs, c * bs:(c + 1) * bs] = (blk / scale[r, c]).to(torch.float8_e4m3fn)
    return q, scale


def mtp_layer(cfg, tensors, seed):
    """Draws the MTP layer (layer num_hidden_layers, an MoE block) and adds its hub tensors."""
    n = cfg["num_hidden_layers"]
    config = transformers.DeepseekV3Config(**cfg)
    config._attn_implementation = "eager"
    layer = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(config, n).float()
    draw_weights(layer, seed)
    g = torch.Generator().manual_seed(seed + 1)
    D = cfg["hidden_size"]
    pre = f"model.layers.{n}."
    for k, v in hub_state(layer, cfg).items():
        tensors[pre + k] = v
    tensors[pre + "enorm.weight"] = 1.0 + 0.1 * torch.randn(D, generator=g)
    tensors[pre + "hnorm.weight"] = 1.0 + 0.1 * torch.randn(D, generator=g)
    tensors[pre + "eh_proj.weight"] = 0.15 * torch.randn(D, 2 * D, generator=g)
    tensors[pre + "shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(D, generator=g)
    tensors[pre + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[pre + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    return layer


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def mtp_reference(model, layer, cfg, tensors, tokens):
    """(mtp_logits, mtp_loss) of the MTP layer in float64."""
    n, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    pre = f"model.layers.{n}."
    t = {k: v.double() for k, v in tensors.items()}
    model, layer = model.double(), layer.double()
    for c in (model.config, layer.mlp.config if hasattr(layer.mlp, "config") else model.config):
        c._experts_implementation = "eager"  # the grouped kernel takes no float64
    got = {}
    def keep(mod, inputs, out):  # the last block's output (before the final norm)
        got["h"] = out[0] if isinstance(out, tuple) else out
    hook = model.model.layers[-1].register_forward_hook(keep)
    with torch.no_grad():
        model(input_ids=tokens[:, :T].long())
        hook.remove()
        h = got["h"][:, :T - 1]
        e = t["model.embed_tokens.weight"][tokens[:, 1:T].long()]
        x = torch.cat([rms(e, t[pre + "enorm.weight"], eps), rms(h, t[pre + "hnorm.weight"], eps)], -1)
        x = x @ t[pre + "eh_proj.weight"].T
        pos = torch.arange(T - 1).unsqueeze(0)
        pe = model.model.rotary_emb(x, pos)
        mask = torch.full((T - 1, T - 1), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        y = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        y = y[0] if isinstance(y, tuple) else y
        logits = rms(y, t[pre + "shared_head.norm.weight"], eps) @ t[pre + "shared_head.head.weight"].T
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 2:].reshape(-1).long())
    model.float()
    return logits.to(torch.float32), loss.to(torch.float32)


def make(name, cfg, seed):
    d = os.path.join(HERE, name)
    config = getattr(transformers, cfg["architectures"][0].replace("ForCausalLM", "Config"))(**cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, cfg["architectures"][0])(config).to(torch.float32).eval()
    draw_weights(model, seed)
    tensors = hub_state(model, cfg)
    layer = mtp_layer(cfg, tensors, seed + 7) if cfg.get("num_nextn_predict_layers") else None
    write_sharded(d, tensors)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg["vocab_size"], (B, T + 1), generator=g, dtype=torch.int32)
    logits, loss = logits_and_loss(model, tokens)
    back = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    logits2, _ = logits_and_loss(back, tokens)
    if not torch.equal(logits, logits2):
        sys.exit(f"{name}: from_pretrained of the written directory gives other logits")
    ref = {"tokens": tokens, "logits": logits.contiguous(), "loss": loss.reshape(())}
    if layer is not None:
        ml, mloss = mtp_reference(model, layer, cfg, tensors, tokens)
        ref.update(mtp_logits=ml.contiguous(), mtp_loss=mloss.reshape(()))
        print(f"{name}: MTP loss {mloss.item():.6f}")
    save_file(ref, os.path.join(d, "reference.safetensors"))
    print(f"{name}: {len(tensors)} tensors, loss {loss.item():.6f}")
    return cfg, tensors


def make_fp8(cfg, tensors, bs):
    """The v3 weights as the V3 release stores them: every 2-D projection of attention and FFN in e4m3 with
    weight_scale_inv; embedding, head, norms and router stay as they are."""
    d = os.path.join(HERE, "v3_fp8")
    out = {}
    for n, w in tensors.items():
        if w.ndim == 2 and ("self_attn" in n or "mlp." in n) and not n.endswith("mlp.gate.weight"):
            q, s = fp8_blocks(w, bs)
            out[n] = q
            out[n + "_scale_inv"] = s
        else:
            out[n] = w
    write_sharded(d, out)
    c = dict(cfg, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [bs, bs],
                                       "activation_scheme": "dynamic"})
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
    print(f"v3_fp8: {sum(1 for n in out if n.endswith('_scale_inv'))} FP8 tensors")


def make_variant(cfg, tensors, name, **changes):
    """v3's weights under another config (changes): only config.json and reference.safetensors; the test
    reads the weights from v3/."""
    d = os.path.join(HERE, name)
    c = dict(cfg, **changes)
    config = transformers.DeepseekV3Config(**c)
    config._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    state = model.state_dict()
    with torch.no_grad():  # the hub tensors back into transformers' layout (experts fused)
        for k in state:
            if k.endswith("mlp.experts.gate_up_proj"):
                p = k[: -len("gate_up_proj")]
                state[k].copy_(torch.stack([torch.cat([tensors[f"{p}{e}.gate_proj.weight"],
                                                       tensors[f"{p}{e}.up_proj.weight"]]) for e in range(8)]))
            elif k.endswith("mlp.experts.down_proj"):
                p = k[: -len("down_proj")]
                state[k].copy_(torch.stack([tensors[f"{p}{e}.down_proj.weight"] for e in range(8)]))
            else:
                state[k].copy_(tensors[k])  # (the MTP layer's tensors have no place in transformers' model)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
    g = torch.Generator().manual_seed(2026 + 1)
    tokens = torch.randint(0, cfg["vocab_size"], (B, T + 1), generator=g, dtype=torch.int32)
    logits, loss = logits_and_loss(model, tokens)
    save_file({"tokens": tokens, "logits": logits.contiguous(), "loss": loss.reshape(())},
              os.path.join(d, "reference.safetensors"))
    print(f"{name}: loss {loss.item():.6f}")


if __name__ == "__main__":
    cfg, tensors = make("v3", V3, 2026)
    make_fp8(cfg, tensors, 16)
    # YaRN: a ramp between rope pairs 0 and 2 of the 4, mscale applied
    make_variant(cfg, tensors, "v3_yarn", rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 8.0,
                 "beta_slow": 0.5, "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 0.707})
    # rms_norm_eps for the layer and final norms only: transformers keeps the latents' norms at 1e-6
    make_variant(cfg, tensors, "v3_eps", rms_norm_eps=0.05)
    make("v2", V2, 2027)
