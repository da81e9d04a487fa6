#!/usr/bin/env bash
# FSDP step time and memory: dtrain's FSDP (each strategy, fp32 and bf16, Gloo and MPI)
# beside PyTorch 2.13's fully_shard (bench/reference/fsdp_reference.py, Gloo) and dtrain's
# DDP, on the same ~19M-parameter TransformerLM, batch, sequence length and one thread per
# rank, 2 ranks. Every configuration runs once per round, rounds alternate (noisy machine);
# the table shows medians over rounds of each run's median step.
#
# Memory is measured alike on both sides: the RSS high-water mark, and the bytes CPU tensors
# hold at the step's peak through dtrain's counting allocator (framework/memory.h; the Python
# side loads it with ctypes). "theory" = steady state (parameters + gradients + optimizer
# state, / N) + the activations of the same step in one process (step_bench --strategy
# local) + limit_all_gathers blocks and the root gathered in param_dtype.
#   bench/run_fsdp_bench.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
args=(--steps 8 --warmup 2)
scripts/bootstrap >/dev/null
bazel build --config=ci //bench:step_bench //launcher:dtrain-launch //framework:libdtrain_memory.so \
  >/dev/null 2>&1
launch() { bazel-bin/launcher/dtrain-launch --nproc-per-node 2 --master-port 0 "$@" | sed 's/^\[rank 0\] //'; }
mpi() { mpirun -np 2 --bind-to none -x OMP_NUM_THREADS -x DTRAIN_BACKEND=mpi "$@"; }
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_mpi_yield_when_idle=1
tracker=$PWD/bazel-bin/framework/libdtrain_memory.so
out=$(mktemp)
for r in $(seq "$rounds"); do
  echo "round $r/$rounds" >&2
  for p in fp32 bf16; do
    launch -- .venv/bin/python -W ignore bench/reference/fsdp_reference.py bench --precision $p \
      --tracker "$tracker" "${args[@]}" >>"$out"
    for s in full_shard shard_grad_op no_shard; do
      launch --backend gloo -- bazel-bin/bench/step_bench --strategy fsdp --sharding $s \
        --precision $p "${args[@]}" >>"$out"
    done
    mpi bazel-bin/bench/step_bench --strategy fsdp --precision $p "${args[@]}" >>"$out"
    launch --backend gloo -- bazel-bin/bench/step_bench --strategy ddp --precision $p \
      "${args[@]}" >>"$out"
    mpi bazel-bin/bench/step_bench --strategy ddp --precision $p "${args[@]}" >>"$out"
    bazel-bin/bench/step_bench --strategy local --precision $p "${args[@]}" >>"$out"
  done
  launch -- .venv/bin/python -W ignore bench/reference/fsdp_reference.py bench --precision bf16 \
    --fused --tracker "$tracker" "${args[@]}" >>"$out"
  # PyTorch's local step (fp32, its default AdamW as fully_shard's rows use), for its ratio.
  PYTHONPATH=bench/reference .venv/bin/python bench/reference/ddp_reference.py --local \
    "${args[@]}" >>"$out"
done
.venv/bin/python - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
def key(r):
    return (r["impl"], r["strategy"] + ("+fused" if r.get("fused") else ""), r.get("sharding", ""),
            r.get("precision", "fp32"), r["backend"])
groups = {}
for r in rows: groups.setdefault(key(r), []).append(r)
med = lambda k, f: statistics.median(r[f] for r in groups[k])
d, blocks, limit = 512, 6, 2
block = 12 * d * d + 13 * d                     # d_ff = 4 d
root = (256 + 64) * d + 2 * d
def theory(p):
    local = ("dtrain", "local", "", p, "none")
    act = med(local, "peak_tracked_mb") - med(local, "steady_tracked_mb")
    bytes_ = 4 if p == "fp32" else 2
    return act, (limit * block + root) * bytes_ / 1e6
n = len(groups[("pytorch", "fsdp2", "", "fp32", "gloo")])
print(f"TransformerLM 19.1M parameters, 2 ranks x 1 thread, batch 4 x 64, AdamW; {n} alternating "
      "rounds (median of per-run medians)\n")
print("| run | precision | backend | step (s) | vs its local step | vs dtrain DDP | "
      "vs PyTorch fully_shard | comm hidden | peak RSS (MB) | peak tensors (MB) | vs PyTorch | "
      "steady (MB) | theory (MB) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
order = [("pytorch", "fsdp2", ""), ("pytorch", "fsdp2+fused", ""), ("dtrain", "fsdp", "full_shard"),
         ("dtrain", "fsdp", "shard_grad_op"), ("dtrain", "fsdp", "no_shard"), ("dtrain", "ddp", ""),
         ("dtrain", "local", "")]
for p in ("fp32", "bf16"):
    pt = ("pytorch", "fsdp2", "", p, "gloo")
    for impl, strat, shard in order:
        for backend in ("gloo", "mpi", "none"):
            k = (impl, strat, shard, p, backend)
            if k not in groups: continue
            s = med(k, "median_step_s")
            ddp = ("dtrain", "ddp", "", p, backend)
            vs_ddp = f"{s / med(ddp, 'median_step_s'):.2f}" if ddp in groups and strat != "ddp" else "-"
            vs_pt = f"{s / med(pt, 'median_step_s'):.2f}" if k != pt else "1.00"
            hidden = f"{100 * med(k, 'hidden'):.0f}%" if "hidden" in groups[k][0] and backend != "none" else "-"
            # The same model and per-rank batch in one process without communication: dtrain's
            # for dtrain's rows; PyTorch's (fp32 only, ddp_reference.py --local) for PyTorch's.
            local_k = (("pytorch", "local", "", p, "none") if impl == "pytorch"
                       else ("dtrain", "local", "", p, "none"))
            vs_local = (f"{s / med(local_k, 'median_step_s'):.2f}"
                        if local_k in groups and strat != "local" else "-")
            tracked = med(k, "peak_tracked_mb")
            vs_mem = f"{tracked / med(pt, 'peak_tracked_mb'):.2f}"
            th = "-"
            if strat == "fsdp" and shard == "full_shard":
                act, gathered = theory(p)
                t = med(k, "steady_tracked_mb") + act + gathered
                th = f"{t:.0f} (peak {tracked / t:.2f}x)"
            name = {"fsdp2": "PyTorch fully_shard", "fsdp2+fused": "PyTorch fully_shard, fused AdamW",
                    "fsdp": f"dtrain FSDP {shard}", "ddp": "dtrain DDP",
                    "local": "one process, no comm"}[strat]
            print(f"| {name} | {p} | {backend} | {s:.3f} | {vs_local} | {vs_ddp} | {vs_pt} | {hidden} | "
                  f"{med(k, 'peak_rss_mb'):.0f} | {tracked:.0f} | {vs_mem} | "
                  f"{med(k, 'steady_tracked_mb'):.0f} | {th} |")
PY
rm -f "$out"
