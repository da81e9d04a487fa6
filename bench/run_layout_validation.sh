#!/usr/bin/env bash
# The scaling model's (dp, tp, pp) layout choice, validated on this machine: a 58M-parameter
# Llama (8 layers, hidden 512, 8 heads, a 32000-token vocabulary, 256 tokens per sample) at 4
# ranks, the same global batch (16 samples, 4 micro-batches per data-parallel rank) under every
# layout of 4 ranks: FSDP over dp, TP over tp (sequence parallel off), 1F1B over pp, fp32.
#   1. One process (every core) measures the compute rate: one core's is the model's "GPU"
#      throughput.
#   2. bench/scaling_model.py layout --cores predicts every layout's step with that rate, the
#      4 ranks sharing this machine's cores (processor sharing: a rank idle in the pipeline's
#      bubble lends its core; no collective hides under compute), and Gloo's alpha-beta at 4
#      ranks (docs/benchmarks.md: 730 us, 1.18 GB/s).
#   3. dtrain-train runs every layout for STEPS steps; the step is the mean after the first.
# Prints predicted against measured, and whether the model's top two are the measured top two
# in the same order.
#   bench/run_layout_validation.sh [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-4}
scripts/bootstrap >/dev/null
bazel build --config=ci //framework:dtrain-train //launcher:dtrain-launch >/dev/null 2>&1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cores=$(nproc)
ranks=4
global=16
base=(--config bench/llama58m.yaml --set train.steps="$steps"
      --set logging.metrics_file="$work/metrics.jsonl" --set parallel.strategy=fsdp)
mean_step() {
  python3 - "$work/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step_time_s"' in l]
later = [r["step_time_s"] for r in rows if r["step"] > 1]
print(f"{sum(later) / len(later):.4f}")
PY
}
# 1. The compute rate: one process, every core, 8 samples.
rm -f "$work/metrics.jsonl"
OMP_NUM_THREADS=$cores bazel-bin/framework/dtrain-train "${base[@]}" \
  --set parallel.strategy=none >/dev/null 2>&1
one=$(mean_step)
# 6 x parameters x tokens per second, per core.
tflops=$(python3 -c "print(6 * 58.47e6 * 8 * 256 / $one / $cores / 1e12)")
echo "one process: $one s per step of 8 samples on $cores cores: $tflops TFLOP/s per core"
# 2. The model.
python3 bench/scaling_model.py layout --model llama58m --gpus $ranks --gpus-per-node $ranks \
  --global-tokens $((global * 256)) --micro-batches 4 --tflops "$tflops" --mfu 1 \
  --nvlink-us 730 --nvlink-gbps 1.18 --param-bytes 4 --cores "$cores" \
  --json >"$work/predicted.jsonl"
# 3. Every layout, measured.
: >"$work/measured.jsonl"
while read -r line; do
  read -r dp tp pp < <(python3 -c "import json,sys; r=json.loads(sys.argv[1]); print(r['dp'], r['tp'], r['pp'])" "$line")
  rm -f "$work/metrics.jsonl"
  bazel-bin/launcher/dtrain-launch --nproc-per-node $ranks --master-port 0 -- \
    bazel-bin/framework/dtrain-train "${base[@]}" \
    --set parallel.tp=$tp --set parallel.pp=$pp --set train.batch_size=$((global / dp)) \
    >"$work/run.log" 2>&1 || { tail -20 "$work/run.log"; exit 1; }
  echo "{\"dp\": $dp, \"tp\": $tp, \"pp\": $pp, \"step_s\": $(mean_step)}" >>"$work/measured.jsonl"
done <"$work/predicted.jsonl"
python3 - "$work/predicted.jsonl" "$work/measured.jsonl" <<'PY'
import json, sys
pred = [json.loads(l) for l in open(sys.argv[1])]
meas = {(r["dp"], r["tp"], r["pp"]): r["step_s"] for r in map(json.loads, open(sys.argv[2]))}
key = lambda r: (r["dp"], r["tp"], r["pp"])
by_meas = sorted(meas, key=meas.get)
print("| dp | tp | pp | predicted step (s) | measured step (s) | error | predicted rank | measured rank |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|")
for i, r in enumerate(pred):
    m = meas[key(r)]
    print(f"| {r['dp']} | {r['tp']} | {r['pp']} | {r['step_s']:.3f} | {m:.3f} | "
          f"{(r['step_s'] - m) / m:+.1%} | {i + 1} | {by_meas.index(key(r)) + 1} |")
top2 = [key(r) for r in pred[:2]]
if top2 == by_meas[:2]:
    verdict = "the same, in the same order"
elif set(top2) == set(by_meas[:2]):
    verdict = "the same two, in the other order"
else:
    verdict = "different"
best = meas[by_meas[0]]
print(f"the model's top two {top2}: measured top two {by_meas[:2]}; {verdict}. The model's "
      f"choice {top2[0]} measured {meas[top2[0]]:.3f} s, {(meas[top2[0]] - best) / best:+.1%} "
      f"from the fastest layout; ranks 3-6 "
      f"{'in its order' if [key(r) for r in pred[2:]] == by_meas[2:] else 'in another order'}")
PY
