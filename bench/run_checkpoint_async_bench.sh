#!/usr/bin/env bash
# What a checkpoint costs the training run: the same dtrain-train job (2 ranks) saving every K
# steps synchronously (checkpoint.async: false: the step waits for every file to be written,
# fsynced and committed), asynchronously (true: the step waits only while the state is copied
# into staging buffers), and never, in alternating rounds. Prints, per mode, the median time
# the step was blocked by a save (sync: the whole save; async: the staging, plus any wait for
# the previous save), and the training time of the whole run against the run that never saves.
#   bench/run_checkpoint_async_bench.sh [ROUNDS] [CONFIG] [STEPS] [EVERY] [--set key=value ...]
# Defaults: 2 rounds of configs/fsdp_fp32.yaml (19.1M parameters), 40 steps, a save every 10.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2} config=${2:-configs/fsdp_fp32.yaml} steps=${3:-40} every=${4:-10}
shift $(($# < 4 ? $# : 4))
scripts/bootstrap >/dev/null
log=$(mktemp)
bazel build --config=ci //framework:dtrain-train //launcher:dtrain-launch >"$log" 2>&1 ||
  { cat "$log"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work" "$log"' EXIT
for r in $(seq "$rounds"); do
  for mode in never sync async; do
    echo "round $r/$rounds: $mode" >&2
    extra=(--set "checkpoint.dir=$work/$mode" --set "checkpoint.every_steps=$every")
    [ "$mode" = never ] && extra=(--set checkpoint.dir=)
    [ "$mode" = async ] && extra+=(--set checkpoint.async=true)
    rm -rf "${work:?}/$mode"
    bazel-bin/launcher/dtrain-launch --nproc-per-node 2 --master-port 0 -- \
      bazel-bin/framework/dtrain-train --config "$config" --set "train.steps=$steps" \
      --set logging.every_steps=1 --set train.eval_every=0 --set logging.progress_bar=false \
      --set logging.sample_tokens=0 --set logging.metrics_file= "${extra[@]}" "$@" \
      >"$work/$mode.$r.log" 2>&1 || { tail -n 30 "$work/$mode.$r.log"; exit 1; }
  done
done
.venv/bin/python - "$work" "$rounds" "$config" "$steps" "$every" <<'PY'
import re, statistics, sys
from datetime import datetime
work, rounds, config, steps, every = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
stamp = re.compile(r"^\[rank 0\] (\S+ \S+) ")
def when(line):
    return datetime.strptime(stamp.match(line).group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
rows = {}
for mode in ("never", "sync", "async"):
    first, later, train = [], [], []
    for r in range(1, rounds + 1):
        lines = open(f"{work}/{mode}.{r}.log").read().splitlines()
        start = next(l for l in lines if " info step 1/" in l)
        end = next(l for l in lines if f" info step {steps}/" in l)
        # The training loop, first step to last, every save inside it.
        train.append(when(end) - when(start))
        stalls = []
        for l in lines:
            m = re.search(r"checkpoint (\S+) (written|staged) in ([0-9.]+) s", l)
            if m and not m.group(1).endswith(f"step_{int(steps):08d}"):  # the last is after it
                stalls.append(float(m.group(3)))
            w = re.search(r"waited ([0-9.]+) s for it", l)
            if w and stalls:
                stalls[-1] += float(w.group(1))  # the save that had to wait for the previous
        if stalls:
            first.append(stalls[0])
            later += stalls[1:]
    med = lambda v: statistics.median(v) if v else float("nan")  # noqa: E731
    rows[mode] = (med(first), med(later), statistics.median(train))
base = rows["never"][2]
print(f"{config}, {steps} steps, a save every {every}, 2 ranks, {rounds} alternating rounds "
      "(medians)\n")
print("| mode | step blocked by the first save (s) | by each later save (s) | training loop (s) | "
      "vs never saving |")
print("|---|---:|---:|---:|---:|")
for mode, (f, l, t) in rows.items():
    print(f"| {mode} | {f:.3f} | {l:.3f} | {t:.2f} | {t / base:.3f}x |")
sync_whole = statistics.median([x for x in rows["sync"][:2] if x == x])
print(f"\nasync stall / sync save's whole time, later saves (the first allocates the staging "
      f"buffers): {rows['async'][1]:.3f} / {sync_whole:.3f} s = {rows['async'][1] / sync_whole:.1%}")
PY
