#!/usr/bin/env bash
# DDP step time: PyTorch 2.13's DDP (Gloo) beside dtrain's DDP over Gloo and over MPI, same
# TransformerLM (~19M parameters), batch, sequence length and threads per rank, 2 ranks.
# The three run in alternation for ROUNDS rounds (noisy machines); the table shows medians
# over rounds of each run's median step time, and the ratios dtrain / PyTorch.
#   bench/run_ddp_bench.sh [ROUNDS] [extra step_bench/ddp_reference args...]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
args=("--steps" "8" "--warmup" "2" "$@")
scripts/bootstrap >/dev/null
bazel build //bench:step_bench //launcher:dtrain-launch >/dev/null 2>&1
launch=bazel-bin/launcher/dtrain-launch
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_mpi_yield_when_idle=1
out=$(mktemp)
for r in $(seq "$rounds"); do
  PYTHONPATH=bench/reference $launch --nproc-per-node 2 --master-port 0 -- \
    .venv/bin/python bench/reference/ddp_reference.py "${args[@]}" | sed 's/^\[rank 0\] //' >>"$out"
  $launch --nproc-per-node 2 --master-port 0 --backend gloo -- bazel-bin/bench/step_bench \
    --strategy ddp "${args[@]}" \
    | sed 's/^\[rank 0\] //' >>"$out"
  mpirun -np 2 --bind-to none -x OMP_NUM_THREADS -x DTRAIN_BACKEND=mpi bazel-bin/bench/step_bench \
    --strategy ddp "${args[@]}" >>"$out"
done
.venv/bin/python - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
def key(r): return r["impl"] + "/" + r["backend"]
groups = {}
for r in rows: groups.setdefault(key(r), []).append(r)
med = lambda k, f: statistics.median(r[f] for r in groups[k])
pt = med("pytorch/gloo", "median_step_s")
p = rows[0]["params"]
print(f"DDP step time, TransformerLM {p/1e6:.1f}M parameters, 2 ranks x 1 thread, "
      f"{len(groups['pytorch/gloo'])} alternating rounds (median of per-run medians)\n")
print("| implementation | step (s) | backward (s) | ratio vs PyTorch | all-reduce (s) | exposed (s) | hidden behind backward |")
print("|---|---|---|---|---|---|---|")
for k, label in [("pytorch/gloo", "PyTorch 2.13 DDP, Gloo"), ("dtrain/gloo", "dtrain DDP, Gloo"),
                 ("dtrain/mpi", "dtrain DDP, MPI")]:
    if k not in groups: continue
    s = med(k, "median_step_s"); b = med(k, "median_backward_s")
    extra = (f"{med(k,'comm_s'):.4f} | {med(k,'exposed_s'):.4f} | {100*med(k,'hidden'):.0f}%"
             if "comm_s" in groups[k][0] else "n/a | n/a | n/a")
    print(f"| {label} | {s:.4f} | {b:.4f} | {s/pt:.3f} | {extra} |")
PY
rm -f "$out"
