"""The Python side of tests/interop/test_interop.sh (huggingface `safetensors` + numpy).

    check_safetensors.py read-dsk DIR   checks the files st_tool wrote with dsk
    check_safetensors.py write-py DIR   writes files for st_tool to read with dsk
    check_safetensors.py edge-cases DIR writes header edge cases with the reference's verdicts
    check_safetensors.py hf-write-py DIR writes a DeepSeek-layout sharded model with its index
    check_safetensors.py hf-read-dsk DIR checks the sharded model st_tool exported

Prints one "ok <case>" or "FAIL <case>: <why>" line per case. numpy has no bfloat16 or fp8,
so safetensors.numpy.load_file refuses those files; they are read through the package's
own parser (safetensors.deserialize, the Rust reader with all its validation) as raw bytes
and decoded here bit by bit. Values are compared with the formula st_tool uses, computed
again here in float64, not with anything dsk computed.
"""
import json
import math
import os
import sys

import numpy as np
import safetensors
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

failures = 0


def report(ok, what, why=""):
    global failures
    if ok:
        print(f"ok   {what}")
    else:
        failures += 1
        print(f"FAIL {what}: {why}")


NUMPY = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I32": np.int32, "I64": np.int64, "U8": np.uint8}
FLOATS = {"F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F64"}
# relative rounding error of each float format (half an ulp)
RTOL = {"F32": 2**-24, "F16": 2**-11, "BF16": 2**-8, "F8_E4M3": 2**-4, "F8_E5M2": 2**-3, "F64": 0}


def formula(st, k, n):
    i = np.arange(n, dtype=np.float64)
    if st in FLOATS:
        return np.sin(0.37 * i + 0.11 * k) * 3.0
    return ((7 * np.arange(n, dtype=np.int64) + 3 * k) % 200) - (0 if st == "U8" else 100)


def decode_minifloat(b, mbits, bias):
    """fp8 bytes (OCP e4m3fn / e5m2) to float64, written from the format definitions."""
    b = b.astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    ebits = 7 - mbits
    e = (b >> mbits) & ((1 << ebits) - 1)
    m = b & ((1 << mbits) - 1)
    normal = (1.0 + m / 2.0**mbits) * np.exp2(e - bias)
    sub = (m / 2.0**mbits) * 2.0 ** (1 - bias)
    return sign * np.where(e == 0, sub, normal)


def decode(st, raw):
    if st == "BF16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if st == "F8_E4M3":
        return decode_minifloat(np.frombuffer(raw, np.uint8), 3, 7)
    if st == "F8_E5M2":
        return decode_minifloat(np.frombuffer(raw, np.uint8), 2, 15)
    return np.frombuffer(raw, NUMPY[st]).astype(np.float64)


def crc32c(data):
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    c = 0xFFFFFFFF
    for byte in data:
        c = (c >> 8) ^ table[(c ^ byte) & 0xFF]
    return c ^ 0xFFFFFFFF


def read_index(d):
    out = []
    with open(os.path.join(d, "index.txt")) as f:
        for line in f:
            p = line.split()
            out.append((p[0], p[1], int(p[2]), [int(x) for x in p[4 : 4 + int(p[3])]]))
    return out


def value_error(st, k, shape, raw):
    """"" when the bytes decode to the formula's values within the format's rounding."""
    n = int(np.prod(shape)) if shape else 1
    got = decode(st, raw)
    want = formula(st, k, n)
    if st in FLOATS:
        ok = np.allclose(got, want, rtol=RTOL[st], atol=2.0**-9 if st.startswith("F8") else 0)
    else:
        ok = np.array_equal(got, want.astype(np.float64))
    return "" if ok else f"values off, max error {np.max(np.abs(got - want))}"


def read_dsk(d):
    idx = read_index(d)
    # 1. every dtype, through the package's own parser
    path = os.path.join(d, "dsk_all.safetensors")
    blob = open(path, "rb").read()
    try:
        parsed = dict(safetensors.deserialize(blob))
        report(True, "safetensors.deserialize accepts the dsk file with every dtype")
    except Exception as e:  # the reference rejected our file
        report(False, "safetensors.deserialize accepts the dsk file with every dtype", repr(e))
        return
    report(len(parsed) == len(idx), "same tensor count", f"{len(parsed)} vs {len(idx)}")
    for name, st, k, shape in idx:
        t = parsed.get(name)
        raw = open(os.path.join(d, "expect", name + ".bin"), "rb").read()
        why = "missing" if t is None else ""
        if t is not None and (t["dtype"] != st or list(t["shape"]) != shape or bytes(t["data"]) != raw):
            why = f"file has {t['dtype']} {t['shape']}, dsk wrote {st} {shape} (or other bytes)"
        why = why or value_error(st, k, shape, raw)
        report(not why, f"deserialize {st} {name} {shape}: dtype, shape, bytes and values", why)
    # header layout as the reference writes it: padded to 8 with spaces, data aligned
    n = int.from_bytes(blob[:8], "little")
    header = blob[8 : 8 + n]
    report(n % 8 == 0 and header.rstrip(b" ").endswith(b"}"), "header padded with spaces to a multiple of 8", f"length {n}")
    meta = json.loads(header)["__metadata__"]
    report(meta.get("unicode") == "h\u00e9llo \u2713" and meta.get("purpose") == "interop", "metadata round trip", str(meta))
    for name, st, k, shape in idx:
        raw = open(os.path.join(d, "expect", name + ".bin"), "rb").read()
        if int(meta.get("dsk.crc32c." + name, "-1"), 16) != crc32c(raw):
            report(False, f"dsk.crc32c.{name} matches a Python CRC32C", meta.get("dsk.crc32c." + name))
            break
    else:
        report(True, "every dsk.crc32c matches a CRC32C computed in Python")
    # 2. safetensors.numpy.load_file on the numpy dtypes
    arrays = load_file(os.path.join(d, "dsk_numpy.safetensors"))
    native = [x for x in idx if x[1] in NUMPY]
    report(set(arrays) == {x[0] for x in native}, "safetensors.numpy.load_file reads the dsk file", str(sorted(arrays)))
    for name, st, k, shape in native:
        want = np.frombuffer(open(os.path.join(d, "expect", name + ".bin"), "rb").read(), NUMPY[st]).reshape(shape)
        a = arrays.get(name)
        report(a is not None and a.dtype == want.dtype and a.shape == tuple(shape) and np.array_equal(a, want, equal_nan=True),
               f"load_file {st} {name} {shape}")
    with safe_open(os.path.join(d, "dsk_numpy.safetensors"), framework="numpy") as f:
        report(f.metadata().get("purpose") == "interop", "safe_open reads the metadata", str(f.metadata()))
    # 3. a dsk checkpoint: its rank file is a safetensors file, its manifest is JSON
    step = os.path.join(d, "ckpt", "step_00000042")
    text = open(os.path.join(step, "manifest.json"), "rb").read()
    man = json.loads(text)
    fe = man["files"][0]
    rank0 = os.path.join(step, f"rank_{fe['rank']:05d}.{fe['attempt']}.safetensors")
    report(text.endswith(b'"}\n') and int(text[-11:-3], 16) == crc32c(text[:-22]) and int(man["crc32c"], 16) == crc32c(text[:-22]),
           "manifest: its last line holds the CRC32C of the text before it", text[-24:].decode())
    parsed = dict(safetensors.deserialize(open(rank0, "rb").read()))
    report(all(bytes(parsed[n]["data"]) == open(os.path.join(d, "expect", n + ".bin"), "rb").read() for n, _, _, _ in idx),
           "safetensors.deserialize reads the checkpoint's rank file")
    with safe_open(rank0, framework="numpy") as f:
        m = f.metadata()
        report(m.get("dsk.step") == "42" and m.get("dsk.rank") == "0" and m.get("dsk.world_size") == "1", "rank file metadata", str(m)[:200])
    whole = open(rank0, "rb").read()
    report(man["step"] == 42 and man["world_size"] == 1 and fe["size"] == len(whole) and int(fe["crc32c"], 16) == crc32c(whole),
           "manifest: step, world size, file size and whole-file CRC32C", json.dumps(fe))
    shapes_ok = all(man["tensors"][n]["shape"] == s and man["tensors"][n]["dtype"] == st for n, st, _, s in idx)
    report(shapes_ok, "manifest: every tensor's dtype and global shape")


def write_py(d):
    os.makedirs(os.path.join(d, "py_expect"), exist_ok=True)
    rng = np.random.default_rng(int(os.environ.get("DSK_TEST_SEED", "20261129")))
    index = []
    np_tensors = {
        "f32.mat": rng.standard_normal((3, 4)).astype(np.float32),
        "f16.vec": rng.standard_normal(7).astype(np.float16),
        "f64.scalar": np.array(rng.standard_normal(), dtype=np.float64),
        "i32.grid": rng.integers(-1000, 1000, (2, 2)).astype(np.int32),
        "i64.vec": rng.integers(-(2**40), 2**40, 5).astype(np.int64),
        "u8.long": rng.integers(0, 256, 129).astype(np.uint8),
        "f32.empty": np.zeros((0, 3), np.float32),
        "i16.vec": rng.integers(-300, 300, 3).astype(np.int16),
    }
    st_of = {np.float32: "F32", np.float16: "F16", np.float64: "F64", np.int32: "I32", np.int64: "I64", np.uint8: "U8", np.int16: "I16"}
    save_file(np_tensors, os.path.join(d, "py_numpy.safetensors"), metadata={"framework": "numpy-interop"})
    for name, a in np_tensors.items():
        open(os.path.join(d, "py_expect", name + ".bin"), "wb").write(np.ascontiguousarray(a).tobytes())
        index.append(("py_numpy.safetensors", name, st_of[a.dtype.type], list(a.shape)))
    # dtypes numpy lacks, written through the package's raw-buffer API
    raw = {
        "bf16.mat": ("bfloat16", "BF16", [5, 3], rng.integers(0, 2**16, 15).astype(np.uint16)),
        "e4m3.vec": ("float8_e4m3fn", "F8_E4M3", [9], rng.integers(0, 256, 9).astype(np.uint8)),
        "e5m2.vec": ("float8_e5m2", "F8_E5M2", [4], rng.integers(0, 256, 4).astype(np.uint8)),
        "bool.vec": ("bool", "BOOL", [6], rng.integers(0, 2, 6).astype(np.uint8)),
    }
    specs = {n: safetensors.TensorSpec(dtype=t, shape=s, data_ptr=a.ctypes.data, data_len=a.nbytes) for n, (t, _, s, a) in raw.items()}
    safetensors.serialize_file(specs, os.path.join(d, "py_raw.safetensors"), metadata={"framework": "raw"})
    for name, (_, st, shape, a) in raw.items():
        open(os.path.join(d, "py_expect", name + ".bin"), "wb").write(a.tobytes())
        index.append(("py_raw.safetensors", name, st, shape))
    with open(os.path.join(d, "py_index.txt"), "w") as f:
        for file, name, st, shape in index:
            f.write(f"{file} {name} {st} {len(shape)} {' '.join(str(x) for x in shape)}\n")
    report(True, "python writes safetensors files for dsk")


def raw_file(header, data=b""):
    """A safetensors file from a header string, padded with spaces as the reference pads."""
    hb = header.encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    return len(hb).to_bytes(8, "little") + hb + data


# Edge cases of the header format: the reference parser's verdict is taken from the package at
# run time; the last column is what dsk must answer: "same" (accept what it accepts, refuse
# with DSK_ERR_CORRUPT what it refuses) or a documented difference (dsk_ckpt.h, dsk_safetensors_file).
EDGE_CASES = [
    ("minus_zero_dim", '{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}', b"", "same"),
    ("minus_zero_offset", '{"a":{"dtype":"U8","shape":[0],"data_offsets":[-0,0]}}', b"", "same"),
    ("metadata_null", '{"__metadata__":null,"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x", "same"),
    ("float_dim", '{"a":{"dtype":"U8","shape":[1.0],"data_offsets":[0,1]}}', b"x", "same"),
    ("exponent_dim", '{"a":{"dtype":"U8","shape":[1e0],"data_offsets":[0,1]}}', b"x", "same"),
    ("bool_dim", '{"a":{"dtype":"U8","shape":[true],"data_offsets":[0,1]}}', b"x", "same"),
    ("dim_beyond_u64", '{"a":{"dtype":"U8","shape":[18446744073709551616],"data_offsets":[0,1]}}', b"x", "same"),
    ("metadata_twice", '{"__metadata__":{},"__metadata__":{}}', b"", "same"),
    ("metadata_number", '{"__metadata__":{"k":1}}', b"", "same"),
    ("leading_space", ' {"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x", "same"),
    ("empty_name", '{"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x", "same"),
    ("scalar", '{"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}', b"abcd", "same"),
    ("gap", '{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"xx", "same"),
    ("trailing_bytes", '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"xy", "same"),
    ("unknown_dtype", '{"a":{"dtype":"F7","shape":[1],"data_offsets":[0,1]}}', b"x", "same"),
    ("nul_in_name", '{"a\\u0000b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x", "UNSUPPORTED"),
    ("nul_in_metadata", '{"__metadata__":{"k":"a\\u0000b"}}', b"", "UNSUPPORTED"),
    ("nine_dims", '{"a":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,1]}}', b"x", "UNSUPPORTED"),
    ("duplicate_name", '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
     b"x", "CORRUPT"),
    ("unknown_field", '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}}', b"x", "CORRUPT"),
    ("duplicate_metadata_key", '{"__metadata__":{"k":"a","k":"b"}}', b"", "CORRUPT"),
]


def edge_cases(d):
    """Writes each edge case, asks the reference parser for its verdict, and lists both for st_tool."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "edge_cases.txt"), "w") as out:
        for name, header, data, dsk_answer in EDGE_CASES:
            blob = raw_file(header, data)
            open(os.path.join(d, f"edge_{name}.safetensors"), "wb").write(blob)
            try:
                safetensors.deserialize(blob)
                verdict = "ACCEPT"
            except Exception:  # the reference refuses the file
                verdict = "REJECT"
            if dsk_answer != "same":  # a documented difference: the reference must accept it
                report(verdict == "ACCEPT", f"reference accepts edge case {name} (dsk answers {dsk_answer})", verdict)
            out.write(f"edge_{name}.safetensors {verdict} {dsk_answer}\n")
    report(True, f"python wrote {len(EDGE_CASES)} header edge cases with the reference's verdicts")


# A DeepSeek-V3-style model, as transformers lays its weights out: layer 0 dense, layers 1-2
# MoE with 4 routed experts (one tensor per expert and projection) and one shared expert.
HF_E, HF_D, HF_F, HF_V = 4, 8, 6, 16


def hf_tensors():
    """(name, safetensors dtype, shape) of the model, in transformers' order."""
    out = [("model.embed_tokens.weight", "F32", [HF_V, HF_D])]
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp"
        out += [(f"{p}.gate.weight", "F32", [HF_E, HF_D]), (f"{p}.gate.e_score_correction_bias", "F32", [HF_E])]
        for e in range(HF_E):
            out += [(f"{p}.experts.{e}.gate_proj.weight", "BF16", [HF_F, HF_D]), (f"{p}.experts.{e}.up_proj.weight", "BF16", [HF_F, HF_D]),
                    (f"{p}.experts.{e}.down_proj.weight", "BF16", [HF_D, HF_F])]
        out += [(f"{p}.shared_experts.gate_proj.weight", "BF16", [HF_F, HF_D]), (f"{p}.shared_experts.up_proj.weight", "BF16", [HF_F, HF_D]),
                (f"{p}.shared_experts.down_proj.weight", "BF16", [HF_D, HF_F])]
    return out


def hf_write_py(d):
    """Writes the model as 3 shards and model.safetensors.index.json, as save_pretrained does,
    with the raw bytes of every tensor in hf_expect/ for st_tool to compare."""
    os.makedirs(os.path.join(d, "hf_expect"), exist_ok=True)
    rng = np.random.default_rng(int(os.environ.get("DSK_TEST_SEED", "20261129")) + 17)
    tensors = hf_tensors()
    n_shards = 3
    weight_map, total = {}, 0
    for k in range(n_shards):
        part = tensors[k::n_shards]
        arrays = {}
        for name, st, shape in part:
            if st == "F32":
                a = rng.standard_normal(shape).astype(np.float32)
                arrays[name] = ("float32", a)
            else:  # bf16: random bit patterns of finite values (numpy has no bfloat16)
                a = (rng.integers(0, 2**15, shape, dtype=np.int64) | (rng.integers(0, 2, shape) << 15)).astype(np.uint16)
                a[(a & 0x7F80) == 0x7F80] &= 0xBFFF
                arrays[name] = ("bfloat16", a)
            open(os.path.join(d, "hf_expect", name + ".bin"), "wb").write(np.ascontiguousarray(arrays[name][1]).tobytes())
            total += arrays[name][1].nbytes
        shard = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        specs = {n: safetensors.TensorSpec(dtype=t, shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes) for n, (t, a) in arrays.items()}
        safetensors.serialize_file(specs, os.path.join(d, shard), metadata={"format": "pt"})
        for name in arrays:
            weight_map[name] = shard
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    report(True, f"python writes a DeepSeek-layout model: {len(tensors)} tensors in {n_shards} shards with an index")


def hf_read_dsk(d):
    """Checks dsk's export as transformers would read it: the index, every shard through the
    package's parser, names, dtypes, shapes and bytes against what st_tool says it wrote."""
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    wm = index["weight_map"]
    expect = {}
    with open(os.path.join(d, "hf_list.txt")) as f:
        for line in f:
            p = line.split()
            expect[p[0]] = (p[1], [int(x) for x in p[3 : 3 + int(p[2])]])
    report(set(wm) == set(expect), "index weight_map names every tensor dsk wrote, no more", f"{len(wm)} vs {len(expect)}")
    seen, total = {}, 0
    for shard in sorted(set(wm.values())):
        path = os.path.join(d, shard)
        try:
            parsed = dict(safetensors.deserialize(open(path, "rb").read()))
        except Exception as e:  # the reference refused dsk's shard
            report(False, f"safetensors.deserialize reads {shard}", repr(e))
            continue
        with safe_open(path, framework="numpy") as f:
            report(f.metadata().get("format") == "pt", f"{shard} has the metadata format=pt transformers asks for", str(f.metadata())[:120])
        for name, t in parsed.items():
            seen[name] = shard
            total += len(bytes(t["data"]))
            st, shape = expect.get(name, ("?", []))
            raw = open(os.path.join(d, "hf_expect", name + ".bin"), "rb").read() if name in expect else b""
            ok = t["dtype"] == st and list(t["shape"]) == shape and bytes(t["data"]) == raw
            report(ok, f"{shard}: {name} {st} {shape}", f"file has {t['dtype']} {t['shape']}")
    report(seen == wm, "every tensor sits in the shard the index names", "")
    report(index["metadata"]["total_size"] == total, "index total_size is the tensors' bytes", f"{index['metadata']['total_size']} vs {total}")


if __name__ == "__main__":
    {"read-dsk": read_dsk, "write-py": write_py, "edge-cases": edge_cases, "hf-write-py": hf_write_py,
     "hf-read-dsk": hf_read_dsk}[sys.argv[1]](sys.argv[2])
    sys.exit(1 if failures else 0)
