#!/usr/bin/env python3
"""dtrain's safetensors reader and writer (framework/checkpoint/safetensors.h) against the
safetensors package: files the package writes (every dtype, 0-dim and empty tensors, metadata,
a sharded checkpoint with its index as save_pretrained leaves it) are read by dtrain and
written back, and the package reads dtrain's files bit for bit. Broken files are refused,
naming the file and the tensor."""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

ap = argparse.ArgumentParser()
ap.add_argument("--tool", required=True)
args = ap.parse_args()
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


def tool(*argv):
    return subprocess.run([args.tool, *argv], capture_output=True, text=True, timeout=120)


def same(a, b):
    """Bitwise equality (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


g = torch.Generator().manual_seed(7)
tensors = {
    "model.embed_tokens.weight": torch.randn(37, 16, generator=g),
    "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
    "model.layers.0.mlp.up_proj.weight": torch.randn(24, 16, generator=g).to(torch.float16),
    "model.norm.weight": torch.randn(16, generator=g).double(),
    "steps": torch.tensor(12345678901, dtype=torch.int64),
    "ids": torch.randint(-2**31, 2**31 - 1, (5,), dtype=torch.int32, generator=g),
    "short": torch.randint(-2**15, 2**15 - 1, (3, 2), dtype=torch.int16, generator=g),
    "i8": torch.randint(-128, 127, (7,), dtype=torch.int8, generator=g),
    "u8": torch.randint(0, 255, (9,), dtype=torch.uint8, generator=g),
    "mask": torch.rand(4, 3, generator=g) > 0.5,
    "empty": torch.empty(0, 4),
    "odd_bf16": torch.randn(3, generator=g).to(torch.bfloat16),
}
tensors["nan"] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45])

with tempfile.TemporaryDirectory() as tmp:
    # 1. A file the package writes: dtrain lists it and copies it; the package reads the copy.
    src = os.path.join(tmp, "model.safetensors")
    save_file(tensors, src, metadata={"format": "pt", "note": "caf\u00e9 \"quoted\""})
    r = tool("list", src)
    check(r.returncode == 0, f"list: {r.stderr}")
    listed = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()}
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
             torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
    for k, t in tensors.items():
        want = [names[t.dtype]] + [str(d) for d in t.shape]
        check(listed.get(k) == want, f"list {k}: {listed.get(k)} != {want}")
    out = os.path.join(tmp, "copy.safetensors")
    r = tool("copy", src, out)
    check(r.returncode == 0, f"copy: {r.stderr}")
    back = load_file(out)
    check(set(back) == set(tensors), f"copied names {sorted(back)}")
    for k, t in tensors.items():
        check(k in back and same(back[k], t), f"copy of {k} differs")
    with open(out, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    check((8 + n) % 8 == 0, f"header of {n} bytes leaves the data unaligned")
    check(header.get("__metadata__") == {"format": "pt", "note": "caf\u00e9 \"quoted\""},
          f"metadata {header.get('__metadata__')}")
    for k, v in header.items():
        if k == "__metadata__":
            continue
        size = tensors[k].element_size()
        check(v["data_offsets"][0] % size == 0, f"{k} at {v['data_offsets'][0]} is unaligned")

    # 2. A sharded checkpoint as save_pretrained writes it: two shards and the index.
    shard_dir = os.path.join(tmp, "sharded")
    os.makedirs(shard_dir)
    keys = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": keys[:6],
             "model-00002-of-00002.safetensors": keys[6:]}
    weight_map = {}
    for shard, ks in parts.items():
        save_file({k: tensors[k] for k in ks}, os.path.join(shard_dir, shard),
                  metadata={"format": "pt"})
        weight_map.update({k: shard for k in ks})
    with open(os.path.join(shard_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 1234}, "weight_map": weight_map}, f)
    out = os.path.join(tmp, "merged.safetensors")
    r = tool("copy", shard_dir, out)
    check(r.returncode == 0, f"copy sharded: {r.stderr}")
    if r.returncode == 0:
        back = load_file(out)
        for k, t in tensors.items():
            check(k in back and same(back[k], t), f"sharded copy of {k} differs")
    # An index naming a tensor that no shard holds.
    with open(os.path.join(shard_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": dict(weight_map, extra="model-00001-of-00002.safetensors")}, f)
    r = tool("list", shard_dir)
    check(r.returncode == 2 and "'extra'" in r.stderr, f"missing tensor: {r.returncode} {r.stderr}")

    # 3. Broken files: refused with exit code 2, naming the file (and tensor).
    good = open(src, "rb").read()
    n = struct.unpack("<Q", good[:8])[0]
    hdr = json.loads(good[8:8 + n])

    def broken(name, data, expect):
        path = os.path.join(tmp, name)
        with open(path, "wb") as f:
            f.write(data)
        r = tool("list", path)
        ok = r.returncode == 2 and path in r.stderr and all(e in r.stderr for e in expect)
        check(ok, f"{name}: exit {r.returncode}, stderr {r.stderr.strip()!r}, wanted {expect}")

    def with_header(h, tail):
        text = json.dumps(h).encode()
        return struct.pack("<Q", len(text)) + text + tail

    data = good[8 + n:]
    broken("truncated.safetensors", good[:-3], ["outside"])
    broken("short.safetensors", good[:5], ["shorter than"])
    broken("long_header.safetensors", struct.pack("<Q", 1 << 40) + good[8:], ["header claims"])
    broken("not_json.safetensors", struct.pack("<Q", 5) + b"{[}]x" + data, ["not valid JSON"])
    h = json.loads(json.dumps(hdr))
    h["model.norm.weight"]["dtype"] = "F128"
    broken("dtype.safetensors", with_header(h, data), ["model.norm.weight", "F128"])
    h = json.loads(json.dumps(hdr))
    h["model.norm.weight"]["shape"] = [17]
    broken("shape.safetensors", with_header(h, data), ["model.norm.weight", "bytes for shape"])
    h = json.loads(json.dumps(hdr))
    first = min((v["data_offsets"][0], k) for k, v in h.items() if k != "__metadata__")[1]
    h[first]["data_offsets"] = [h[first]["data_offsets"][0] + 8, h[first]["data_offsets"][1] + 8]
    broken("overlap.safetensors", with_header(h, data), [first])
    broken("trailing.safetensors", good + b"\0" * 8, ["after the last tensor"])

print("safetensors_test:", "FAILED" if failures else "passed", f"({len(failures)} failures)")
sys.exit(1 if failures else 0)
