#!/bin/bash
# A dtrain DDP run and the same PyTorch DDP run, bit for bit: over Gloo, from the same initial
# weights on the same data, the losses, the loss scales and every final weight must be equal
# (not close). At 2 ranks in fp32, bf16 and fp16; at 3 and 4 ranks, where the order of the
# sums matters (c10d Gloo's ring adds each element in an order set by its place in the
# bucket, so the buckets must be PyTorch's, before and after they are rebuilt), in fp32 and
# bf16 (3 ranks: the world size does not divide exactly; 4: it does), also with small
# buckets (many per step, as a large model has them) and with find_unused_parameters (whose
# buckets are never rebuilt). At 2 and 3 ranks also "buffers": a net with BatchNorm and a bf16
# buffer accumulating under no_sync, with a no_grad forward after each step, a frozen bias, a
# parameter whose custom Function gives it no gradient, SGD with weight decay, and with
# find_unused_parameters a layer used only under no_sync: every rank's buffers equal to
# PyTorch's after every forward (DDP broadcasts rank 0's only in a forward after one that
# synchronized), and the final weights. See tests/parity/ddp_parity.cc for what each side runs;
# bench/reference/ddp_reference.py --runs trains PyTorch's side and compares.
# Usage: ddp_parity_test.sh LAUNCHER DDP_PARITY PYTHON REFERENCE [STEPS]
set -euo pipefail
launcher=$1 parity=$2 python=$3 reference=$4 steps=${5:-12}
dir=${TEST_TMPDIR:-$(mktemp -d)}
export OMP_NUM_THREADS=1
unset TEST_PREMATURE_EXIT_FILE XML_OUTPUT_FILE GTEST_OUTPUT
status=0
# Per world size: dtrain's runs first, then PyTorch's in one launch (torch imported once).
# Each run: "precision [bucket_mb [find_unused]]", or "buffers [- unused]".
compare() {
  local np=$1 runs_steps=$2
  shift 2
  local runs=() n=0
  for run in "$@"; do
    read -r precision bucket_mb find_unused <<<"$run"
    local out="$dir/np$np/$n" extra=() json=""
    if [ "$precision" = buffers ]; then
      precision=fp32
      extra+=(--buffers)
      json+=", \"buffers\": true"
      bucket_mb=""
    fi
    n=$((n + 1))
    mkdir -p "$out"
    if [ -n "${bucket_mb:-}" ]; then
      extra+=(--bucket-mb "$bucket_mb")
      json+=", \"bucket_mb\": $bucket_mb"
    fi
    if [ -n "${find_unused:-}" ]; then
      extra+=(--find-unused)
      json+=", \"find_unused\": true"
    fi
    echo "== $np ranks, $run: dtrain"
    "$launcher" --nproc-per-node "$np" --master-port 0 --backend gloo -- \
      "$parity" --precision "$precision" --steps "$runs_steps" --out "$out" "${extra[@]}" \
      >"$out/dtrain.log" 2>&1 || { cat "$out/dtrain.log"; exit 1; }
    runs+=("{\"init\": \"$out/init.pt\", \"precision\": \"$precision\"$json}")
  done
  local list
  list=$(printf ',%s' "${runs[@]}")
  echo "[${list:1}]" >"$dir/np$np/runs.json"
  echo "== $np ranks: PyTorch, the same runs"
  "$launcher" --nproc-per-node "$np" --master-port 0 -- "$python" -W ignore "$reference" \
    --runs "$dir/np$np/runs.json" --steps "$runs_steps" >"$dir/np$np/pytorch.log" 2>&1 || status=1
  cat "$dir/np$np/pytorch.log"
}
compare 2 "$steps" fp32 bf16 fp16 buffers "buffers - unused"
compare 3 6 fp32 bf16 "fp32 0.02" "bf16 0.02 unused" buffers "buffers - unused"
compare 4 6 fp32 bf16 "fp32 0.02 unused" "bf16 0.02"
exit $status
