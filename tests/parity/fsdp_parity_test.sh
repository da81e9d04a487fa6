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
# Usage: fsdp_parity_test.sh LAUNCHER FSDP_PARITY PYTHON REFERENCE COMPARE
set -euo pipefail
launcher=$1 parity=$2 python=$3 reference=$4 compare=$5
dir=${TEST_TMPDIR:-$(mktemp -d)}
export OMP_NUM_THREADS=1
unset TEST_PREMATURE_EXIT_FILE XML_OUTPUT_FILE GTEST_OUTPUT
status=0
# run NP PRECISION RTOL NAME [parity args...]: dtrain's run, PyTorch's, and the comparison.
run() {
  local np=$1 precision=$2 rtol=$3 name=$4
  shift 4
  local extra=()
  [ "$precision" = fp16 ] && extra=(--same-scales)
  echo "== $name: $precision at $np ranks $*, rtol $rtol"
  "$launcher" --nproc-per-node "$np" --master-port 0 --backend gloo -- \
    "$parity" --precision "$precision" --fused "$@" --out "$dir" >"$dir/dtrain_$name.log" 2>&1 ||
    { cat "$dir/dtrain_$name.log"; exit 1; }
  local flags=()
  for a in "$@"; do [ "$a" = --flat ] || flags+=("$a"); done
  "$launcher" --nproc-per-node "$np" --master-port 0 -- "$python" -W ignore "$reference" parity \
    --precision "$precision" --fused "${flags[@]}" --init "$dir/init.pt" \
    --out "$dir/pytorch_$name.json" >"$dir/pytorch_$name.log" 2>&1 ||
    { cat "$dir/pytorch_$name.log"; exit 1; }
  "$python" "$compare" "$dir/dtrain.json" "$dir/pytorch_$name.json" --rtol "$rtol" \
    "${extra[@]}" || status=1
}
for np in 2 3; do
  run "$np" fp32 0 "fp32_np$np" --clip 0.05
  run "$np" bf16 0 "bf16_np$np" --clip 0.05
  run "$np" fp16 0 "fp16_np$np"
done
run 3 fp32 1e-6 flat_np3 --clip 0.05 --flat
exit $status
