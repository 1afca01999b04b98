#!/usr/bin/env python3
"""Checks an export of train_moe / examples/train_hf.h against a fixture (tests/test_hf.sh runs it).

  check_export.py tensors EXPORT FIXTURE [fp8]
      Python's safetensors reads every tensor of EXPORT's index; the names and shapes are the
      fixture's (its MTP layers' only when EXPORT's config has num_nextn_predict_layers; with fp8:
      plus a <name>_scale_inv (f32, ceil(rows/b), ceil(cols/b)) for each F8_E4M3 tensor, b from
      quantization_config); config.json holds every key of the fixture's.
  check_export.py transformers EXPORT LOGITS TOKENS_FROM
      AutoModelForCausalLM.from_pretrained(EXPORT) reports no missing or unexpected keys (but the
      MTP layers' of num_nextn_predict_layers, which transformers skips), and its
      logits of the reference tokens of TOKENS_FROM/reference.safetensors are within 1e-5 (of the
      largest) of LOGITS (dsk's, "logits" in a safetensors file). Exit 3 when torch or
      transformers is not installed (the caller skips).
  check_export.py keys EXPORT
      from_pretrained(EXPORT) reports no missing or unexpected keys and runs a forward (exit 3 as above).
Prints one line per failure and exits 1 on any.
"""
import json
import math
import os
import sys

from safetensors import safe_open


def tensors(d):
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        wm = json.load(f)["weight_map"]
    out = {}
    for shard in sorted(set(wm.values())):
        with safe_open(os.path.join(d, shard), framework="numpy") as f:
            for k in f.keys():
                if wm.get(k) != shard:
                    print(f"{shard}: tensor {k} is not indexed to this shard")
                    sys.exit(1)
                sl = f.get_slice(k)
                out[k] = (tuple(sl.get_shape()), sl.get_dtype())
    missing = set(wm) - set(out)
    if missing:
        print(f"the index names tensors no shard holds: {sorted(missing)[:5]}")
        sys.exit(1)
    return out


def mtp_prefixes(c):
    """The name prefixes of config c's MTP layers (model.layers.{num_hidden_layers + k}.)."""
    n = c["num_hidden_layers"]
    return tuple(f"model.layers.{n + k}." for k in range(c.get("num_nextn_predict_layers") or 0))


def check_tensors(exp, fix, fp8):
    bad = 0
    e, f = tensors(exp), tensors(fix)
    with open(os.path.join(exp, "config.json")) as fh:
        ec = json.load(fh)
    with open(os.path.join(fix, "config.json")) as fh:
        fc = json.load(fh)
    block = ec.get("quantization_config", {}).get("weight_block_size", [128, 128])
    if not ec.get("num_nextn_predict_layers"):  # an export without MTP layers: the fixture's are not expected
        f = {k: v for k, v in f.items() if not k.startswith(mtp_prefixes(fc))}
    for k, (shape, _) in f.items():
        if k not in e:
            print(f"missing tensor {k}")
            bad += 1
        elif e[k][0] != shape:
            print(f"tensor {k}: shape {e[k][0]}, the fixture's {shape}")
            bad += 1
    for k, (shape, dtype) in e.items():
        if k in f:
            continue
        base = k[: -len("_scale_inv")] if k.endswith("_scale_inv") else None
        if not fp8 or base is None or base not in e or e[base][1] != "F8_E4M3":
            print(f"unexpected tensor {k}")
            bad += 1
            continue
        rows, cols = e[base][0]
        want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
        if shape != want or dtype != "F32":
            print(f"{k}: {dtype} {shape}, want F32 {want}")
            bad += 1
    if fp8 and not any(v[1] == "F8_E4M3" for v in e.values()):
        print("no F8_E4M3 tensor in an fp8 export")
        bad += 1
    for key in fc:
        if key not in ec:
            print(f"config.json lacks key {key}")
            bad += 1
    print(f"{len(e)} tensors read, {len(fc)} config keys checked")
    return bad


def load_transformers(exp):
    """(model, number of loading problems printed)"""
    try:
        import torch
        import transformers
    except ImportError as err:
        print(f"not installed: {err}")
        sys.exit(3)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        exp, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    bad = 0
    with open(os.path.join(exp, "config.json")) as fh:
        c = json.load(fh)
    # transformers skips the MTP layers (its ignore pattern names DeepSeek-V3's layer 61 only)
    mtp = mtp_prefixes(c)
    skipped = [k for k in info.get("unexpected_keys", []) if mtp and k.startswith(mtp)]
    info["unexpected_keys"] = [k for k in info.get("unexpected_keys", []) if not (mtp and k.startswith(mtp))]
    if skipped:
        print(f"from_pretrained skipped the {len(skipped)} tensors of the MTP layer(s)")
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(kind):
            print(f"from_pretrained: {kind}: {sorted(info[kind])[:5]}")
            bad += 1
    return model.eval(), bad


def check_keys(exp):
    model, bad = load_transformers(exp)  # first: it exits 3 when torch or transformers is missing
    import torch
    with torch.no_grad():
        out = model(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits
    print(f"{type(model).__name__}: logits {tuple(out.shape)}, finite {bool(torch.isfinite(out).all())}")
    return bad + (not bool(torch.isfinite(out).all()))


def check_transformers(exp, logits_file, fixture):
    model, bad = load_transformers(exp)
    import torch
    from safetensors.torch import load_file
    ref = load_file(os.path.join(fixture, "reference.safetensors"))
    tokens = ref["tokens"]
    want = load_file(logits_file)["logits"].double()
    with torch.no_grad():
        got = model.eval()(input_ids=tokens[:, :-1].long()).logits.double()
    err = (got - want).abs().max().item() / want.abs().max().item()
    print(f"transformers' logits of the export against dsk's: max error {err:.3g} of the largest")
    if not err <= 1e-5:
        bad += 1
    return bad


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "tensors":
        n = check_tensors(sys.argv[2], sys.argv[3], len(sys.argv) > 4 and sys.argv[4] == "fp8")
    elif mode == "keys":
        n = check_keys(sys.argv[2])
    else:
        n = check_transformers(sys.argv[2], sys.argv[3], sys.argv[4])
    sys.exit(1 if n else 0)
