#!/usr/bin/env bash
# How large a model trains at 2 ranks on this machine (24 GiB, 2 cores), side by side:
#   1. building: configs/capacity_1b.yaml (1.0B parameters) with model.deferred_init true and
#      false: each rank's peak RSS once the model is built, initialized and sharded (the same
#      first loss both ways);
#   2. DDP on the 1.0B model: the trainer estimates each rank's need before allocating, sets it
#      against the memory available and refuses with the estimate and the fix (it never
#      provokes the kernel's OOM killer);
#   3. dtrain FSDP on configs/capacity_1_3b.yaml (1.31B parameters: deferred init, every block
#      recomputed, one unit gathered at a time): 5 steps, each rank's peak beside the estimate;
#   4. PyTorch's fully_shard with the same recipe (meta-device build, checkpoint_wrapper,
#      fused AdamW, clipping) at the same size, then one size down if it did not train;
#   5. without clipping: dtrain with the optimizer in backward (train.optimizer_in_backward,
#      12 bytes per parameter) at 33 layers (1.66B), and PyTorch at 27 layers, then 26.
# Needs ~22 GiB free and about 50 minutes on 2 cores. Not part of CI.
#   bench/capacity_demo.sh [SKIP_PYTORCH=1]
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap >/dev/null
bazel build --config=ci //framework:dtrain-train //launcher:dtrain-launch >/dev/null 2>&1 ||
  { echo "build failed" >&2; exit 1; }
export OMP_NUM_THREADS=1
launch=(bazel-bin/launcher/dtrain-launch --nproc-per-node 2 --master-port 0 --)
train=bazel-bin/framework/dtrain-train

echo "== 1. building the 1.0B model (one step each)"
for deferred in true false; do
  "${launch[@]}" $train --config configs/capacity_1b.yaml --set train.steps=1 \
    --set model.deferred_init=$deferred 2>&1 |
    sed -n "s/.*model ready: process peak RSS so far \([0-9]*\) MB.*/  deferred_init $deferred: built at \1 MB per rank (rank 0)/p; s/.*step 1\/1 loss \([0-9.]*\).*/  first loss \1/p"
done
echo
echo "== 2. DDP, 1.0B (refused before allocating)"
"${launch[@]}" $train --config configs/capacity_1b.yaml --set parallel.strategy=ddp 2>&1 | tail -2
echo
echo "== 3. dtrain FSDP, 1.31B"
"${launch[@]}" $train --config configs/capacity_1_3b.yaml 2>&1 |
  grep -E "memory: about|model ready|step [0-9]/|RSS|done|Killed|killed|error"
echo "(exit code ${PIPESTATUS[0]})"
[ "${SKIP_PYTORCH:-0}" = 1 ] && exit 0
echo
echo "== 4. PyTorch $(.venv/bin/python -c 'import torch; print(torch.__version__)') fully_shard, the same recipe"
for layers in 26 24 22; do
  echo "-- $layers layers"
  "${launch[@]}" .venv/bin/python -W ignore bench/reference/fsdp_reference.py capacity \
    --layers $layers 2>&1 | grep -E "pytorch step|\"capacity\"|killed|Killed|Error" | tail -7
  code=${PIPESTATUS[0]}
  echo "(exit code $code)"
  [ "$code" = 0 ] && break
done
echo
echo "== 5. without clipping: dtrain with the optimizer in backward, 1.66B; PyTorch from 1.36B down"
"${launch[@]}" $train --config configs/capacity_1_3b.yaml --set model.n_layers=33 \
  --set train.clip_grad_norm=0 --set train.optimizer_in_backward=true 2>&1 |
  grep -E "memory: about|model ready|step [0-9]/|RSS|done|Killed|killed|error"
echo "(exit code ${PIPESTATUS[0]})"
for layers in 27 26; do
  echo "-- PyTorch, $layers layers, no clipping"
  "${launch[@]}" .venv/bin/python -W ignore bench/reference/fsdp_reference.py capacity \
    --layers $layers --clip 0 2>&1 | grep -E "pytorch step|\"capacity\"|killed|Killed|Error" | tail -7
  code=${PIPESTATUS[0]}
  echo "(exit code $code)"
  [ "$code" = 0 ] && break
done
