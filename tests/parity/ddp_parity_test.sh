#!/bin/bash
# A dtrain DDP run and the same PyTorch DDP run, bit for bit: at 2 ranks over Gloo, from the
# same initial weights on the same data, the losses, the loss scales and every final weight
# must be equal (not close) in fp32, bf16 and fp16. See tests/parity/ddp_parity.cc for what each
# side runs; bench/reference/ddp_reference.py --init trains PyTorch's side and compares.
# Usage: ddp_parity_test.sh LAUNCHER DDP_PARITY PYTHON REFERENCE [STEPS]
set -euo pipefail
launcher=$1 parity=$2 python=$3 reference=$4 steps=${5:-12}
dir=${TEST_TMPDIR:-$(mktemp -d)}
export OMP_NUM_THREADS=1
unset TEST_PREMATURE_EXIT_FILE XML_OUTPUT_FILE GTEST_OUTPUT
# dtrain's three runs first, then PyTorch's three in one launch (torch imported once).
runs=()
for precision in fp32 bf16 fp16; do
  echo "== $precision: dtrain"
  out="$dir/$precision"
  mkdir -p "$out"
  "$launcher" --nproc-per-node 2 --master-port 0 --backend gloo -- \
    "$parity" --precision "$precision" --steps "$steps" --out "$out" >"$out/dtrain.log" 2>&1 ||
    { cat "$out/dtrain.log"; exit 1; }
  runs+=("{\"init\": \"$out/init.pt\", \"precision\": \"$precision\"}")
done
list=$(printf ',%s' "${runs[@]}")
echo "[${list:1}]" >"$dir/runs.json"
echo "== PyTorch, the same runs"
status=0
"$launcher" --nproc-per-node 2 --master-port 0 -- "$python" -W ignore "$reference" \
  --runs "$dir/runs.json" --steps "$steps" >"$dir/pytorch.log" 2>&1 || status=1
cat "$dir/pytorch.log"
exit $status
