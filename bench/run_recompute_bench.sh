#!/usr/bin/env bash
# Activation recompute (model.recompute): the bytes CPU tensors hold at the step's peak
# (dtrain's counting allocator, as dtrain-train reports it) and the step time, against depth,
# with recompute off, on every 2nd block and on every block. FSDP full_shard, bf16, 2 ranks,
# d_model 256, seq_len 256, batch 8 per rank; the same steps side by side in one run.
#   bench/run_recompute_bench.sh [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-4}
scripts/bootstrap >/dev/null
bazel build --config=ci //framework:dtrain-train //launcher:dtrain-launch >/dev/null 2>&1
export OMP_NUM_THREADS=1
printf '| layers | recompute | peak tensors (MiB) | estimate (MiB) | step (ms) | losses equal |\n'
printf '|---:|---|---:|---:|---:|---|\n'
for layers in 2 4 8 16; do
  reference=""
  for recompute in none "{every_n: 2}" full; do
    out=$(bazel-bin/launcher/dtrain-launch --nproc-per-node 2 --master-port 0 -- \
      bazel-bin/framework/dtrain-train --config configs/tiny/fsdp_bf16.yaml \
      --set train.steps="$steps" --set train.batch_size=8 --set train.micro_batches=1 \
      --set model.d_model=256 --set model.d_ff=1024 --set model.seq_len=256 \
      --set model.n_layers=$layers --set "model.recompute=$recompute" \
      --set logging.every_steps=1 --set logging.progress_bar=false 2>&1)
    peak=$(sed -n 's/.*rank 0 RSS [0-9.]* MiB (tensors \([0-9.]*\) MiB);.* estimated \([0-9.]*\) MiB.*/\1 \2/p' <<<"$out")
    step=$(grep -o 'step [0-9.]* ms' <<<"$out" | tail -n +2 | awk '{s += $2; n++} END {printf "%.0f", s / n}')
    losses=$(grep -o 'info step [0-9]*/[0-9]* loss [0-9.]*' <<<"$out" | awk '{print $5}' | tr '\n' ' ')
    [ -z "$reference" ] && reference=$losses
    same=$([ "$losses" = "$reference" ] && echo yes || echo NO)
    printf '| %s | %s | %s | %s | %s | %s |\n' "$layers" "$recompute" ${peak:-? ?} "${step:-?}" "$same"
  done
done
