#!/usr/bin/env bash
# Pipeline parallelism in the trainer: what `parallel.pp` buys per rank, side by side in one
# run. A 58M-parameter Llama (8 layers, hidden 512, a 32000-token vocabulary, 256 tokens per
# sample, 8 samples in 4 micro-batches per step, fp32, AdamW) trains STEPS steps:
#   one process (2 threads), DDP over 2 ranks, pp 2 under 1f1b, and pp 2 under gpipe
# (2 ranks: one thread each), pp 2 with every layer recomputed; then pp 2 x 2 data-parallel
# ranks under ddp and under fsdp. Per run: the mean step time of the steps after the first, and
# each rank's peak of tensor memory (the trainer's end-of-run report) beside the estimate.
#   bench/run_pp_trainer_bench.sh [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-4}
scripts/bootstrap >/dev/null
bazel build --config=ci //framework:dtrain-train //launcher:dtrain-launch >/dev/null 2>&1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
base=(--config bench/llama58m.yaml --set train.steps="$steps"
      --set logging.metrics_file="$work/metrics.jsonl")
run() {  # name, ranks, overrides...
  local name=$1 n=$2
  shift 2
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  rm -f "$work/metrics.jsonl"
  local out
  if [ "$n" = 1 ]; then
    out=$(OMP_NUM_THREADS=2 bazel-bin/framework/dtrain-train "${base[@]}" \
      "${sets[@]}" 2>&1)
  else
    out=$(bazel-bin/launcher/dtrain-launch --nproc-per-node "$n" --master-port 0 -- \
      bazel-bin/framework/dtrain-train "${base[@]}" "${sets[@]}" 2>&1)
  fi
  local step mem
  step=$(python3 - "$work/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step_time_s"' in l]
later = [r["step_time_s"] for r in rows if r["step"] > 1]
print(f"{1000 * sum(later) / len(later):.0f}")
PY
)
  mem=$(sed -n 's/.*peak memory per rank: //p' <<<"$out" | head -1)
  echo "| $name | $step | $mem |"
}
echo "| run | step (ms) | peak memory per rank |"
echo "|---|---:|---|"
run "one process" 1 parallel.strategy=none
run "DDP, 2 ranks" 2
run "pp 2, 1f1b" 2 parallel.pp=2
run "pp 2, gpipe" 2 parallel.pp=2 parallel.pp_schedule=gpipe
run "pp 2, 1f1b, model.recompute full" 2 parallel.pp=2 model.recompute=full
# 4 ranks on this machine's cores: their step times are not comparable with the rows above;
# their memory is. Two pipelines whose stages are averaged (ddp) or sharded (fsdp) over 2.
run "pp 2 x ddp 2 (4 ranks)" 4 parallel.pp=2
run "pp 2 x fsdp 2 (4 ranks)" 4 parallel.pp=2 parallel.strategy=fsdp
