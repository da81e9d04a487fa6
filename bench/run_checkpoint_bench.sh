#!/usr/bin/env bash
# Checkpoint write/read time and bytes of the ~19M TransformerLM under FSDP at 2 ranks: dtrain
# (full and sharded; every file fsynced, renamed and checksummed) beside PyTorch's torch.save
# of the full state and torch.distributed.checkpoint, on the same machine, alternating.
#   bench/run_checkpoint_bench.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
scripts/bootstrap >/dev/null
bazel build --config=ci //bench:checkpoint_bench //launcher:dtrain-launch >/dev/null 2>bazel build //bench:checkpoint_bench //launcher:dtrain-launch >/dev/null 2>&11
launch() { bazel-bin/launcher/dtrain-launch --nproc-per-node 2 --master-port 0 "$@" | sed 's/^\[rank 0\] //'; }
export OMP_NUM_THREADS=1
scratch=$(mktemp -d)
out=$(mktemp)
log=$(mktemp)
trap 'echo "checkpoint bench failed; its log:" >&2; cat "$log" >&2' ERR
for r in $(seq "$rounds"); do
  launch --backend gloo -- bazel-bin/bench/checkpoint_bench --dir "$scratch/dtrain" 2>>"$log" | grep '^{' >>"$out"
  launch -- .venv/bin/python -W ignore bench/reference/checkpoint_reference.py --dir "$scratch/pt" \
    2>>"$log" | grep '^{' >>"$out"
done
.venv/bin/python - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
groups = {}
for r in rows: groups.setdefault((r["impl"], r["format"]), []).append(r)
med = lambda k, f: statistics.median(r[f] for r in groups[k])
n = len(next(iter(groups.values())))
print(f"Checkpoint of the 19.1M TransformerLM under FSDP (parameters + AdamW state), 2 ranks, "
      f"{n} alternating rounds (median of per-run medians)\n")
print("| implementation | format | write (s) | read (s) | bytes (MB) |")
print("|---|---|---|---|---|")
for k in groups:
    print(f"| {k[0]} | {k[1]} | {med(k, 'write_s'):.3f} | {med(k, 'read_s'):.3f} | "
          f"{med(k, 'bytes') / 1e6:.1f} |")
PY
rm -rf "$scratch" "$out" "$log"
