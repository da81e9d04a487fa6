#!/bin/bash
# dtrain's pipeline against PyTorch 2.13's torch.distributed.pipelining (ScheduleGPipe,
# Schedule1F1B, ScheduleInterleaved1F1B, and ScheduleInterleavedZeroBubble with one stage per
# rank for zero_bubble), both over Gloo on this machine, on one Hugging Face Llama checkpoint
# (8 layers) written here by transformers, with the same split, micro-batches and data: every
# micro-batch's loss within 1e-5 (relative), at 2 and 4 ranks.
# Usage: pipeline_parity_test.sh LAUNCHER PIPELINE_PARITY PYTHON REFERENCE
set -euo pipefail
launcher=$1 parity=$2 python=$3 reference=$4
dir=${TEST_TMPDIR:-$(mktemp -d)}
export OMP_NUM_THREADS=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
unset TEST_PREMATURE_EXIT_FILE XML_OUTPUT_FILE GTEST_OUTPUT
"$python" -W ignore "$reference" init "$dir/hf"
status=0
for np in 2 4; do
  # PyTorch's 1F1B needs as many micro-batches as stages (dtrain's does not).
  cases="gpipe:1:1,gpipe:4:1,1f1b:$np:1,1f1b:8:1,interleaved_1f1b:$np:2,interleaved_1f1b:$((2 * np)):2"
  cases+=",zero_bubble:$np:1,zero_bubble:8:1"
  "$launcher" --nproc-per-node "$np" --master-port 0 --backend gloo -- \
    "$parity" --hf "$dir/hf" --cases "$cases" --out "$dir/dtrain_np$np.json" \
    >"$dir/dtrain_np$np.log" 2>&1 || { cat "$dir/dtrain_np$np.log"; exit 1; }
  "$launcher" --nproc-per-node "$np" --master-port 0 --backend gloo -- \
    "$python" -W ignore "$reference" run --hf "$dir/hf" --cases "$cases" \
    --out "$dir/pytorch_np$np.json" >"$dir/pytorch_np$np.log" 2>&1 ||
    { cat "$dir/pytorch_np$np.log"; exit 1; }
  "$python" - "$dir/dtrain_np$np.json" "$dir/pytorch_np$np.json" "$np" <<'EOF' || status=1
import json, sys
mine, theirs = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
bad = 0
assert sorted(mine) == sorted(theirs), (sorted(mine), sorted(theirs))
for case in theirs:
    a, b = mine[case], theirs[case]
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")
    ok = worst <= 1e-5
    bad += not ok
    print(f"pp={sys.argv[3]} {case:24s} {len(b)} losses, first {b[0]:.6f}: "
          f"max relative difference {worst:.2e} {'ok' if ok else 'FAIL'}")
sys.exit(1 if bad else 0)
EOF
done
exit $status
