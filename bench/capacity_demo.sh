#!/usr/bin/env bash
# Why FSDP exists, on this machine: a ~1.0B-parameter TransformerLM (configs/capacity_1b.yaml,
# ~16 GB of fp32 parameters, gradients and AdamW state unsharded) at 2 ranks.
#   1. DDP: the trainer estimates each rank's need before allocating anything, sets it against
#      the memory available, and refuses with the estimate and the fix (it never provokes
#      the kernel's OOM killer).
#   2. FSDP FULL_SHARD: trains a few steps, loss falling, and prints each rank's peak beside
#      the estimate.
# Needs ~20 GiB free and a few minutes on 2 cores. Not part of CI.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap >/dev/null
bazel build --config=ci //framework:dtrain-train //launcher:dtrain-launch >/dev/null 2>bazel build //framework:dtrain-train //launcher:dtrain-launch >/dev/null 2>&11
export OMP_NUM_THREADS=1
launch=(bazel-bin/launcher/dtrain-launch --nproc-per-node 2 --master-port 0 --)
echo "== 1. DDP (refused before allocating)"
"${launch[@]}" bazel-bin/framework/dtrain-train --config configs/capacity_1b.yaml \
  --set parallel.strategy=ddp
echo "(exit code $?)"
echo
echo "== 2. FSDP FULL_SHARD"
/usr/bin/time -v "${launch[@]}" bazel-bin/framework/dtrain-train --config configs/capacity_1b.yaml \
  2>&1 | grep -E "memory|step |done|Maximum resident|Elapsed"
