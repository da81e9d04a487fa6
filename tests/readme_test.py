"""The README agrees with the main job: what its first-run section quotes is what scripts/run
prints on this machine, where that does not depend on the CPU.

  - the quoted "memory:" and "run:" lines equal dtrain-train's for configs/default.yaml at 2
    ranks (timestamps aside), and its model's size and step count are the config's;
  - nothing that differs from CPU to CPU is quoted as if it were fixed: no parameter hash
    (PyTorch's kernels round differently on each instruction set, and so the trained weights),
    and the sample is marked as one run's;
  - every command in the README's sh blocks names a script or binary that exists.
Usage: readme_test.py --launcher PATH --trainer PATH
"""
import argparse
import os
import re
import subprocess
import sys

p = argparse.ArgumentParser()
p.add_argument("--launcher", required=True)
p.add_argument("--trainer", required=True)
a = p.parse_args()
failures = []


def check(ok, what, detail=""):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)
        print(detail[-3000:])


readme = open("README.md").read()
first_run = readme.split("## The first run", 1)[1].split("\n## ", 1)[0]
block = first_run.split("```text", 1)[1].split("```", 1)[0]
stamp = re.compile(r"^\[rank (\d)\] \S+ \S+ ")


def lines_with(text, word):
    return [stamp.sub(r"[rank \1] ", l) for l in text.splitlines() if f" info {word}" in l]


r = subprocess.run([a.launcher, "--nproc-per-node", "2", "--master-port", "0", "--", a.trainer,
                    "--config", "configs/default.yaml", "--set", "train.steps=2",
                    "--set", "logging.metrics_file=", "--set", "logging.progress_bar=false"],
                   capture_output=True, text=True, timeout=300,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
out = r.stdout + r.stderr
check(r.returncode == 0, "the main job's config trains", out)
for word in ("memory:", "run:"):
    quoted, printed = lines_with(block, word), lines_with(out, word)
    check(len(quoted) == 1 and quoted == printed,
          f"the README's '{word}' line is the one dtrain-train prints", f"{quoted}\n{printed}")
m = re.search(r"([0-9.]+)M parameters\)", out)
steps = re.search(r"steps: (\d+)", open("configs/default.yaml").read()).group(1)
check(m and f"{float(m.group(1)):.1f}M-parameter" in first_run and f"for {steps} steps" in first_run,
      f"the README's model size and step count are the config's ({m.group(1) if m else '?'}M, "
      f"{steps} steps)")
check(not re.search(r"xxh64 [0-9a-f]{16}", readme),
      "no parameter hash is quoted (it depends on the CPU's kernels)")
sample = [l for l in block.splitlines() if "info sample:" in l]
check(not sample or "one run's" in first_run,
      "a quoted sample is marked as one run's")
for cmd in re.findall(r"^(scripts/[\w-]+|bazel-bin/[\w/-]+)", readme, re.M):
    if cmd.startswith("scripts/"):
        check(os.path.exists(cmd), f"the README's {cmd} exists")
print(f"{len(failures)} failure(s)" if failures else "PASS")
sys.exit(1 if failures else 0)
