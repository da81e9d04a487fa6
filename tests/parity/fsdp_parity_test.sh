#!/bin/bash
# dtrain's FSDP against PyTorch's fully_shard, both over Gloo on this machine, from the same
# initial weights on the same data (see tests/parity/fsdp_parity.cc), with ATen's fused
# AdamW on both sides: every one of 20 steps' losses bitwise equal, at 2 and at 3 ranks, in
# fp32 and bf16 (clipped to 0.05) and fp16 (the ShardedGradScaler's scale trajectory
# identical too: it starts at 2^24 and grows every 4 steps, so it overflows and backs off).
# What makes 3 ranks bitwise: the per_parameter layout (each element owned, and so summed by
# the reduce-scatter, as fully_shard's is), gradients summed then divided, and the norm of
# each parameter reduced across ranks before clipping. parallel.shard_layout=flat is
# checked against the same run within 1e-6: its elements have other owners, and three
# addends round by the order they are summed in.
# Per world size, dtrain's runs go first, each into a folder of its own; then one PyTorch
# launch trains every one of them from its initial weights (fsdp_reference.py parity --runs),
# so torch is imported once per world size, not once per run.
# Usage: fsdp_parity_test.sh LAUNCHER FSDP_PARITY PYTHON REFERENCE COMPARE
set -euo pipefail
launcher=$1 parity=$2 python=$3 reference=$4 compare=$5
dir=${TEST_TMPDIR:-$(mktemp -d)}
export OMP_NUM_THREADS=1
unset TEST_PREMATURE_EXIT_FILE XML_OUTPUT_FILE GTEST_OUTPUT
status=0
runs=() names=()
# dtrain_run NP PRECISION RTOL NAME [parity args...]: dtrain's run into $dir/NAME, and the
# PyTorch run to compare it with, queued for the world size's launch.
dtrain_run() {
  local np=$1 precision=$2 rtol=$3 name=$4
  shift 4
  echo "== $name: $precision at $np ranks $*, rtol $rtol"
  mkdir -p "$dir/$name"
  "$launcher" --nproc-per-node "$np" --master-port 0 --backend gloo -- \
    "$parity" --precision "$precision" --fused "$@" --out "$dir/$name" \
    >"$dir/$name/dtrain.log" 2>&1 || { cat "$dir/$name/dtrain.log"; exit 1; }
  local clip=0
  while [ $# -gt 0 ]; do
    [ "$1" = --clip ] && clip=$2
    shift
  done
  runs+=("{\"precision\": \"$precision\", \"clip\": $clip, \"init\": \"$dir/$name/init.pt\",
    \"out\": \"$dir/$name/pytorch.json\"}")
  names+=("$name:$precision:$rtol")
}
# pytorch_runs NP: PyTorch's runs queued for NP ranks, in one launch, then each comparison.
pytorch_runs() {
  local np=$1 list
  list=$(printf ',%s' "${runs[@]}")
  echo "[${list:1}]" >"$dir/runs_np$np.json"
  "$launcher" --nproc-per-node "$np" --master-port 0 -- "$python" -W ignore "$reference" parity \
    --fused --runs "$dir/runs_np$np.json" >"$dir/pytorch_np$np.log" 2>&1 ||
    { cat "$dir/pytorch_np$np.log"; exit 1; }
  local entry name precision rtol extra
  for entry in "${names[@]}"; do
    IFS=: read -r name precision rtol <<<"$entry"
    extra=()
    [ "$precision" = fp16 ] && extra=(--same-scales)
    echo "-- $name"
    "$python" "$compare" "$dir/$name/dtrain.json" "$dir/$name/pytorch.json" --rtol "$rtol" \
      "${extra[@]}" || status=1
  done
  runs=() names=()
}
for np in 2 3; do
  dtrain_run "$np" fp32 0 "fp32_np$np" --clip 0.05
  dtrain_run "$np" bf16 0 "bf16_np$np" --clip 0.05
  dtrain_run "$np" fp16 0 "fp16_np$np"
  [ "$np" = 3 ] && dtrain_run 3 fp32 1e-6 flat_np3 --clip 0.05 --flat
  pytorch_runs "$np"
done
exit $status
