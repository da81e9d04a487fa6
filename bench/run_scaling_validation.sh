#!/usr/bin/env bash
# Validates bench/scaling_model.py on this machine: the DDP step of the 19M-parameter
# TransformerLM (step_bench's) measured by dtrain-train at 2, 3 and 4 ranks over MPI and Gloo,
# against the model fed with traces of the same model (one process: compute; 2 ranks: the
# buckets) and each backend's alpha-beta fitted to comm_bench's all-reduce times at that rank
# count.
#   bench/run_scaling_validation.sh [--keep DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
[ "${1:-}" = --keep ] && work=${2:?--keep needs a folder} && mkdir -p "$work"
scripts/bootstrap >/dev/null
bazel build --config=ci //framework:dtrain-train //launcher:dtrain-launch //bench:comm_bench \
  >/dev/null 2>&1
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_mpi_yield_when_idle=1
model=(--config configs/default.yaml --set data.source=synthetic --set model.d_model=512
  --set model.n_layers=6 --set model.n_heads=8 --set model.d_ff=2048 --set model.seq_len=64
  --set train.batch_size=4 --set train.micro_batches=1 --set train.eval_every=0
  --set logging.progress_bar=false --set logging.every_steps=1 --set checkpoint.dir=)
launch=bazel-bin/launcher/dtrain-launch
train=bazel-bin/framework/dtrain-train
# The step profile: compute from one process (steps 4-8), buckets from a 2-rank run.
$train "${model[@]}" --set parallel.strategy=none --set train.steps=8 \
  --set logging.trace="$work/local_trace.json" --set logging.trace_start=4 \
  --set logging.trace_steps=5 --set logging.metrics_file= >/dev/null
$launch --nproc-per-node 2 --master-port 0 --backend gloo -- $train "${model[@]}" \
  --set train.steps=7 --set logging.trace="$work/ddp_trace.json" --set logging.trace_start=6 \
  --set logging.trace_steps=1 --set logging.metrics_file= >/dev/null
for p in 2 3 4; do
  mpirun -np $p --oversubscribe --bind-to none -x OMP_NUM_THREADS -x DTRAIN_BACKEND=mpi $train \
    "${model[@]}" --set train.steps=12 --set "logging.metrics_file=$work/mpi_$p.jsonl" >/dev/null
  $launch --nproc-per-node $p --master-port 0 --backend gloo -- $train "${model[@]}" \
    --set train.steps=12 --set "logging.metrics_file=$work/gloo_$p.jsonl" >/dev/null
  mpirun -np $p --oversubscribe --bind-to none -x OMP_NUM_THREADS bazel-bin/bench/comm_bench \
    --max-mib 16 --reps 3 >"$work/comm_$p.md"
done
.venv/bin/python - "$work" <<'PY' >"$work/measured.json"
import json, statistics, sys
work = sys.argv[1]
runs = []
for p in (2, 3, 4):
    lines = open(f"{work}/comm_{p}.md").readlines()
    rows = [l for l in lines if l.startswith("| all_reduce | fp32 |")]
    # Columns by their header, so a column comm_bench adds does not shift the fit.
    header = [x.strip() for x in next(l for l in lines if l.startswith("| op |")).strip().strip("|").split("|")]
    for backend, name in (("mpi", "dtrain-mpi algbw"), ("gloo", "gloo algbw")):
        col = header.index(name)
        pts = []
        for l in rows:
            c = [x.strip() for x in l.strip().strip("|").split("|")]
            num, unit = c[2].split()
            size = int(num) * (1 << 20 if unit == "MiB" else 1 << 10)
            pts.append([size, size / (float(c[col]) * 1e9)])
        steps = [json.loads(l)["step_time_s"] for l in open(f"{work}/{backend}_{p}.jsonl")
                 if '"step_time_s"' in l]
        runs.append({"backend": backend, "ranks": p, "step_s": statistics.median(steps[3:]),
                     "all_reduce": pts})
print(json.dumps({"local_trace": f"{work}/local_trace.json", "ddp_trace": f"{work}/ddp_trace.json",
                  "cores": 2, "threads": 1, "runs": runs}))
PY
.venv/bin/python bench/scaling_model.py validate --measured "$work/measured.json"
