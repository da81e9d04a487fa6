#!/usr/bin/env bash
# Pipeline parallelism: dtrain's schedules beside PyTorch 2.13's torch.distributed.pipelining
# (bench/reference/pipeline_reference.py bench) on the same Llama (8 layers, hidden 256,
# 2 x 128 tokens per micro-batch, 8 micro-batches), split and schedule, at 2 ranks over Gloo,
# one thread per rank; rounds alternate the two sides (a noisy machine) and the table gives
# the medians. dtrain's side also prints the measured bubble (1 - time in forwards and
# backwards / (ranks x step)) beside the theory and the schedule simulated with the costs
# measured in the run, the micro-batches each rank held against the schedule's promise, and
# each rank's peak of tensor memory during the step. zero_bubble's simulation takes each half
# of a backward (I, W) as half its measured cost.
#   bench/run_pipeline_bench.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
scripts/bootstrap >/dev/null
bazel build --config=ci //bench:pipeline_bench //launcher:dtrain-launch >/dev/null 2>&1
export OMP_NUM_THREADS=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
launch() { bazel-bin/launcher/dtrain-launch --nproc-per-node 2 --master-port 0 --backend gloo -- "$@"; }
echo "| schedule | dtrain step (ms) | PyTorch step (ms) | dtrain / PyTorch |"
echo "|---|---|---|---|"
details=()
for s in "gpipe 1" "1f1b 1" "interleaved_1f1b 2" "zero_bubble 1"; do
  set -- $s
  mine=() theirs=()
  for ((r = 0; r < rounds; r++)); do
    line=$(launch bazel-bin/bench/pipeline_bench --schedule "$1" --stages-per-rank "$2" \
      --micro-batches 8 --steps 4 2>&1 | sed -n 's/^\[rank 0\] //p' | grep '^pipeline_bench')
    details+=("$line")
    mine+=("$(sed -E 's/.*step ([0-9.]+) ms.*/\1/' <<<"$line")")
    theirs+=("$(launch .venv/bin/python -W ignore bench/reference/pipeline_reference.py bench \
      --schedule "$1" --stages-per-rank "$2" --micro-batches 8 --steps 4 2>&1 |
      sed -n 's/^\[rank 0\] pipeline_reference.*step \([0-9.]*\) ms.*/\1/p')")
  done
  python3 - "$1" "${mine[*]}" "${theirs[*]}" <<'PY'
import statistics, sys
a = statistics.median(float(x) for x in sys.argv[2].split())
b = statistics.median(float(x) for x in sys.argv[3].split())
print(f"| {sys.argv[1]} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
PY
done
echo
printf '%s\n' "${details[@]}"
