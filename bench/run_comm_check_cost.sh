#!/usr/bin/env bash
# What the collective check costs (comm/communicator.h): a job (default: configs/default.yaml
# at 2 ranks, DDP over Gloo; one thread per rank) with DTRAIN_COMM_CHECK=0 (never), unset (the
# trainer's default: through setup and the first 2 steps) and 1 (every collective of the run),
# in alternating rounds. Prints the median over rounds of: the first 2 steps' time, the later
# steps' mean, all steps, and the whole run's wall time (launch to exit).
#   bench/run_comm_check_cost.sh [ROUNDS] [STEPS] [CONFIG] [RANKS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
steps=${2:-30}
config=${3:-configs/default.yaml}
ranks=${4:-2}
scripts/bootstrap >/dev/null
bazel build --config=ci //framework:dtrain-train //launcher:dtrain-launch >/dev/null 2>&1
export OMP_NUM_THREADS=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
out=$work/rows.jsonl
for r in $(seq "$rounds"); do
  echo "round $r/$rounds" >&2
  for mode in never default always; do
    case $mode in
      never) env=(DTRAIN_COMM_CHECK=0) ;;
      default) env=() ;;
      always) env=(DTRAIN_COMM_CHECK=1) ;;
    esac
    metrics=$work/$mode-$r.jsonl
    t0=$(date +%s.%N)
    env "${env[@]}" bazel-bin/launcher/dtrain-launch --nproc-per-node "$ranks" --master-port 0 -- \
      bazel-bin/framework/dtrain-train --config "$config" --set train.steps="$steps" \
      --set logging.every_steps=1 --set logging.progress_bar=false --set checkpoint.dir= \
      --set train.eval_every=0 --set logging.sample_tokens=0 \
      --set logging.metrics_file="$metrics" --set model.save_pretrained= >/dev/null 2>&1
    t1=$(date +%s.%N)
    echo "{\"mode\": \"$mode\", \"wall_s\": $(echo "$t1 - $t0" | bc), \"metrics\": \"$metrics\"}" >>"$out"
  done
done
.venv/bin/python - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
res = {}
for r in rows:
    steps = [json.loads(l) for l in open(r["metrics"]) if '"step_time_s"' in l]
    t = {s["step"]: s["step_time_s"] for s in steps}
    first = t[1] + t[2]
    later = statistics.mean(v for k, v in t.items() if k > 2)
    res.setdefault(r["mode"], []).append((first, later, r["wall_s"], sum(t.values())))
med = lambda xs: statistics.median(xs)
base = res["never"]
print(f"{'DTRAIN_COMM_CHECK':<24}{'steps 1-2 (s)':>14}{'later step (s)':>16}{'all steps (s)':>15}{'wall (s)':>10}")
for mode, label in (("never", "0 (never)"), ("default", "unset (first 2 steps)"),
                    ("always", "1 (every step)")):
    xs = res[mode]
    print(f"{label:<24}{med([x[0] for x in xs]):>14.3f}{med([x[1] for x in xs]):>16.4f}"
          f"{med([x[3] for x in xs]):>15.3f}{med([x[2] for x in xs]):>10.2f}")
PY
