"""The attention kernel rule of framework/models/attention.h and the PyTorch reference model's
copy of it (bench/reference/model.py: attention_kernel) pick the same kernel on every shape and
dtype of a grid, on this machine: the parity tests compare dtrain with that reference bitwise,
so the two must run the same kernel. Also: the reference's explicit attention is the C++ one's
op sequence (equal to the fused kernel within rounding, here as in models_test).
Usage: attention_rule_test.py --bench=attention_bench --reference=bench/reference/model.py"""
import argparse
import os
import subprocess
import sys

p = argparse.ArgumentParser()
p.add_argument("--bench", required=True)
p.add_argument("--reference", required=True)
a = p.parse_args()
sys.path.insert(0, os.path.dirname(os.path.abspath(a.reference)))
import torch  # noqa: E402
from model import attention_kernel, causal_attention  # noqa: E402

dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
out = subprocess.run([a.bench, "--rule"], capture_output=True, text=True, check=True).stdout
rows = [line.split() for line in out.splitlines() if line.strip()]
failures = []
for name, t, d, kernel in rows:
    want = attention_kernel("cpu", dtypes[name], int(t), int(d))
    if want != kernel:
        failures.append(f"{name} T {t} D {d}: dtrain picks {kernel}, the reference {want}")
print(f"{len(rows)} shapes compared; {sum(r[3] == 'explicit' for r in rows)} explicit on this CPU")
if len(rows) < 200:
    failures.append(f"attention_bench --rule printed {len(rows)} rows, expected the whole grid")

torch.manual_seed(0)
q, k, v = (torch.randn(2, 3, 40, 16) for _ in range(3))
fused, plain = causal_attention(q, k, v, "fused"), causal_attention(q, k, v, "explicit")
err = (fused - plain).abs().max().item()
if not err < 1e-5:
    failures.append(f"the reference's explicit attention differs from the fused one by {err}")
for f in failures:
    print("FAIL:", f)
print("PASS" if not failures else f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
