#!/usr/bin/env bash
# Where DDP's overhead over the local step comes from on a small machine: dtrain's DDP over MPI
# (2 ranks, the TransformerLM of run_ddp_bench.sh) and its local step (1 process, no
# communication) under each thread placement, alternating for ROUNDS rounds.
#   bench/run_ddp_placement.sh [ROUNDS] [extra step_bench args...]
# Placements:
#   omp1-free    OMP_NUM_THREADS=1, mpirun --bind-to none: the OS places each rank's compute
#                thread and its communication thread on either core (run_ddp_bench.sh's)
#   omp1-core    OMP_NUM_THREADS=1, --bind-to core: each rank and its communication thread
#                share one core (the local step: taskset to one core)
#   omp2-free    OMP_NUM_THREADS=2: each rank computes on both cores (the local step too)
#   omp1-nospin  omp1-free with DTRAIN_COMM_SPIN_US=0: waits sleep at once (comm/worker.h)
# The table: median over rounds of each run's median step and backward, the all-reduce time
# (the communication thread's busy time: on this machine, CPU taken from the other rank's
# compute), what of it was left exposed after the backward, the local step and backward under
# the same placement, and DDP / local.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
args=("--steps" "8" "--warmup" "2" "$@")
scripts/bootstrap >/dev/null
bazel build --config=ci //bench:step_bench >/dev/null 2>&1
bench=bazel-bin/bench/step_bench
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
out=$(mktemp)
ddp() {  # PLACEMENT OMP BIND [ENV=VALUE]
  local name=$1 omp=$2 bind=$3
  shift 3
  env OMP_NUM_THREADS="$omp" "$@" mpirun -np 2 --bind-to "$bind" --map-by core \
    -x OMP_NUM_THREADS -x DTRAIN_COMM_SPIN_US -x DTRAIN_BACKEND=mpi \
    "$bench" --strategy ddp "${args[@]}" | sed "s/^{/{\"placement\":\"$name\",/" >>"$out"
}
local_step() {  # PLACEMENT OMP CPUS
  OMP_NUM_THREADS=$2 taskset -c "$3" "$bench" --strategy local "${args[@]}" |
    sed "s/^{/{\"placement\":\"$1\",/" >>"$out"
}
export DTRAIN_COMM_SPIN_US=${DTRAIN_COMM_SPIN_US:-50}
for r in $(seq "$rounds"); do
  ddp omp1-free 1 none
  local_step omp1-free 1 0,1
  ddp omp1-core 1 core
  local_step omp1-core 1 0
  ddp omp2-free 2 none
  local_step omp2-free 2 0,1
  ddp omp1-nospin 1 none DTRAIN_COMM_SPIN_US=0
done
.venv/bin/python - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
med = lambda rs, f: statistics.median(r[f] for r in rs)
def pick(placement, strategy):
    return [r for r in rows if r["placement"] == placement and r["strategy"] == strategy]
n = len(pick("omp1-free", "ddp"))
print(f"dtrain DDP over MPI, 2 ranks, TransformerLM {rows[0]['params']/1e6:.1f}M parameters, "
      f"{n} alternating rounds (median of per-run medians)\n")
print("| placement | DDP step (s) | DDP backward (s) | all-reduce busy (s) | exposed (s) | "
      "local step (s) | local backward (s) | DDP / local |")
print("|---|---|---|---|---|---|---|---|")
for p, local_p in [("omp1-free", "omp1-free"), ("omp1-core", "omp1-core"),
                   ("omp2-free", "omp2-free"), ("omp1-nospin", "omp1-free")]:
    d, l = pick(p, "ddp"), pick(local_p, "local")
    if not d or not l:
        continue
    s, ls = med(d, "median_step_s"), med(l, "median_step_s")
    print(f"| {p} | {s:.4f} | {med(d, 'median_backward_s'):.4f} | {med(d, 'comm_s'):.4f} | "
          f"{med(d, 'exposed_s'):.4f} | {ls:.4f} | {med(l, 'median_backward_s'):.4f} | "
          f"{s / ls:.3f} |")
PY
rm -f "$out"
