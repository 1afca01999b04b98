#!/usr/bin/env python3
"""Compares the newest checkpoints of two train_moe runs tensor by tensor (used by
tests/test_par_train.sh): every rank file's pieces are assembled into the full tensors
(a piece carries "dsk.box.<key>" = "o0,o1,..;g0,g1,.." in its metadata; one without it is
the whole tensor; a file holding several boxes of one name keys them "<name>@<offset>" with
"dsk.name.<key>" = the name). Prints the worst relative difference max|a - b| / max|b| over the tensors
(the weights, and with --moments the AdamW moments), and the tensor it is in; then the worst
relative L2 difference |a - b|_2 / |b|_2 and its tensor. Exits 1 when a tensor is missing on
either side, its shape differs or a piece is missing.
Why two measures: AdamW divides by sqrt(v), so an element whose gradient is near zero moves by
up to the learning rate whichever way rounding tips it; the max over elements shows that, the
L2 measure weighs each tensor as a whole."""
import glob, json, os, struct, sys
import numpy as np

def load(ckdir):
    steps = sorted(d for d in glob.glob(os.path.join(ckdir, "step_*")) if os.path.exists(os.path.join(d, "manifest.json")))
    if not steps: sys.exit("no complete checkpoint in %s" % ckdir)
    full, seen = {}, {}
    for f in sorted(glob.glob(os.path.join(steps[-1], "rank_*.safetensors"))):
        b = open(f, "rb").read()
        n = struct.unpack("<Q", b[:8])[0]
        h = json.loads(b[8:8 + n])
        md = h.pop("__metadata__", {})
        for key, info in h.items():
            name = md.get("dsk.name." + key, key)
            assert info["dtype"] == "F32", (name, info["dtype"])
            s, e = info["data_offsets"]
            a = np.frombuffer(b[8 + n + s:8 + n + e], dtype=np.float32).reshape(info["shape"])
            box = md.get("dsk.box." + key)
            if box is None: off, g = [0] * a.ndim, list(a.shape)
            else:
                o, gs = box.split(";")
                off, g = [int(x) for x in o.split(",")], [int(x) for x in gs.split(",")]
            if name not in full:
                full[name] = np.full(g, np.nan, dtype=np.float32)
                seen[name] = np.zeros(g, dtype=bool)
            sl = tuple(slice(o, o + k) for o, k in zip(off, a.shape))
            full[name][sl] = a
            seen[name][sl] = True
    for name in full:
        if not seen[name].all(): sys.exit("%s: tensor %s has elements no piece holds" % (ckdir, name))
    return full

a, b = load(sys.argv[1]), load(sys.argv[2])
moments = "--moments" in sys.argv
if set(a) != set(b): sys.exit("tensor names differ: %s" % sorted(set(a) ^ set(b)))
worst, where, worst2, where2 = 0.0, "", 0.0, ""
for name in sorted(a):
    if not moments and name.endswith((".adam_m", ".adam_v")): continue
    if a[name].shape != b[name].shape: sys.exit("%s: shape %s vs %s" % (name, a[name].shape, b[name].shape))
    scale = float(np.abs(b[name]).max()) or 1.0
    d = float(np.abs(a[name].astype(np.float64) - b[name]).max()) / scale
    if d > worst: worst, where = d, name
    x, y = a[name].astype(np.float64), b[name].astype(np.float64)
    d2 = float(np.linalg.norm(x - y)) / (float(np.linalg.norm(y)) or 1.0)
    if d2 > worst2: worst2, where2 = d2, name
print("%.3g %s %.3g %s %d" % (worst, where or "-", worst2, where2 or "-", len(a)))
