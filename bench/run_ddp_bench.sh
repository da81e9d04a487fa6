#!/usr/bin/env bash
# DDP step time beside the local step: PyTorch 2.13's DDP (Gloo) and dtrain's DDP over Gloo and
# over MPI, and the same model and per-rank batch in one process without communication (the
# local step, the limit of data parallelism), for PyTorch and dtrain. TransformerLM (~19M
# parameters), 2 ranks x 1 thread (the local step: 1 process x 1 thread). The runs alternate
# for ROUNDS rounds (noisy machines); the tables show medians over rounds of each run's median.
#   bench/run_ddp_bench.sh [ROUNDS] [extra step_bench/ddp_reference args...]
# Tables: step, backward, optimizer and communication per implementation with step / local
# step; the same DDP steps against the same processes' steps without communication
# (--local-ab: every other step under no_sync(), which cancels the drift between processes);
# the optimizer's share of the step: dtrain's fused AdamW (the trainer's), LibTorch's
# torch::optim::AdamW, PyTorch's default (foreach) and fused=True; and what a GradScaler adds
# to dtrain's DDP step over MPI: unscaled and checked in DDP's write-back (the trainer's way),
# checked there only, or checked by the scaler itself, and the trainer's way against no scaler
# in alternate steps of one process (--scaler ab).
#   ONLY=scaler   the GradScaler runs alone
#   ONLY=bf16     bf16 autocast step for step against PyTorch's torch.autocast: one process
#                 and DDP at 2 ranks (PyTorch's buckets reduced in bf16 as dtrain's), PyTorch
#                 with its default and its fused AdamW
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
args=("--steps" "8" "--warmup" "2" "$@")
ab_args=("--steps" "16" "--warmup" "2" "$@")  # alternate steps: 8 of each kind
scripts/bootstrap >/dev/null
bazel build --config=ci //bench:step_bench //launcher:dtrain-launch >/dev/null 2>&1
launch=bazel-bin/launcher/dtrain-launch
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_mpi_yield_when_idle=1
out=$(mktemp)
ref=bench/reference/ddp_reference.py
only=${ONLY:-all}
if [ "$only" = bf16 ]; then
  args+=(--precision bf16)
fi
# One run each; the order rotates by one every round, so no run always follows the same one
# (the machine's state after a run moves the next run's numbers by several percent).
run() {
  case $1 in
    pytorch-ddp)
      PYTHONPATH=bench/reference $launch --nproc-per-node 2 --master-port 0 -- \
        .venv/bin/python $ref "${args[@]}" | sed 's/^\[rank 0\] //' ;;
    gloo-ddp)
      $launch --nproc-per-node 2 --master-port 0 --backend gloo -- bazel-bin/bench/step_bench \
        --strategy ddp "${args[@]}" | sed 's/^\[rank 0\] //' ;;
    mpi-ddp)
      mpirun -np 2 --bind-to none -x OMP_NUM_THREADS -x DTRAIN_BACKEND=mpi \
        bazel-bin/bench/step_bench --strategy ddp "${args[@]}" ;;
    pytorch-ddp-fused)
      PYTHONPATH=bench/reference $launch --nproc-per-node 2 --master-port 0 -- \
        .venv/bin/python $ref --fused "${args[@]}" | sed 's/^\[rank 0\] //' ;;
    pytorch-local) PYTHONPATH=bench/reference .venv/bin/python $ref --local "${args[@]}" ;;
    pytorch-local-fused)
      PYTHONPATH=bench/reference .venv/bin/python $ref --local --fused "${args[@]}" ;;
    local) bazel-bin/bench/step_bench --strategy local "${args[@]}" ;;
    local-libtorch) bazel-bin/bench/step_bench --strategy local --optimizer libtorch "${args[@]}" ;;
    pytorch-ddp-ab)
      PYTHONPATH=bench/reference $launch --nproc-per-node 2 --master-port 0 -- \
        .venv/bin/python $ref --local-ab "${ab_args[@]}" | sed 's/^\[rank 0\] //' ;;
    gloo-ddp-ab)
      $launch --nproc-per-node 2 --master-port 0 --backend gloo -- bazel-bin/bench/step_bench \
        --strategy ddp --local-ab "${ab_args[@]}" | sed 's/^\[rank 0\] //' ;;
    mpi-ddp-ab)
      mpirun -np 2 --bind-to none -x OMP_NUM_THREADS -x DTRAIN_BACKEND=mpi \
        bazel-bin/bench/step_bench --strategy ddp --local-ab "${ab_args[@]}" ;;
    scaler-ab)
      mpirun -np 2 --bind-to none -x OMP_NUM_THREADS -x DTRAIN_BACKEND=mpi \
        bazel-bin/bench/step_bench --strategy ddp --precision bf16 --scaler ab "${ab_args[@]}" ;;
    scaler-*)
      mpirun -np 2 --bind-to none -x OMP_NUM_THREADS -x DTRAIN_BACKEND=mpi \
        bazel-bin/bench/step_bench --strategy ddp --precision bf16 --scaler "${1#scaler-}" \
        "${args[@]}" ;;
  esac
}
runs=(scaler-in-ddp scaler-verdict scaler-own-check scaler-off scaler-ab)
if [ "$only" = bf16 ]; then
  runs=(pytorch-ddp pytorch-ddp-fused gloo-ddp mpi-ddp pytorch-local pytorch-local-fused local)
elif [ "$only" = all ]; then
  runs=(pytorch-ddp gloo-ddp mpi-ddp pytorch-local pytorch-local-fused local local-libtorch
    pytorch-ddp-ab gloo-ddp-ab mpi-ddp-ab "${runs[@]}")
fi
for r in $(seq "$rounds"); do
  k=$(((r - 1) % ${#runs[@]}))
  for name in "${runs[@]:k}" "${runs[@]:0:k}"; do run "$name" >>"$out"; done
done
.venv/bin/python - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
def key(r):
    k = "/".join([r["impl"], r.get("strategy", "ddp"), r.get("backend", ""),
                  r.get("optimizer", "default")])
    k += "/ab" if "ab_sync_step_s" in r else ""
    return k + ("/scaler-" + r.get("scaler", "off") if r.get("precision") == "bf16" else "")
groups = {}
for r in rows: groups.setdefault(key(r), []).append(r)
med = lambda k, f: statistics.median(r[f] for r in groups[k])
p = rows[0]["params"]
if any(k.startswith("pytorch/") and k.endswith("/scaler-off") for k in groups):
    n = len(groups.get("pytorch/local/none/default/scaler-off", []))
    print(f"bf16 autocast, step for step against PyTorch 2.13's torch.autocast: TransformerLM "
          f"{p/1e6:.1f}M parameters, 2 ranks x 1 thread (local: 1 process x 1 thread), {n} "
          "alternating rounds (median of per-run medians); DDP buckets reduced in bf16 on both "
          "sides\n")
    print("| run | step (s) | forward + loss (s) | backward (s) | optimizer (s) | "
          "dtrain / PyTorch (default AdamW) | dtrain / PyTorch (fused AdamW) |")
    print("|---|---|---|---|---|---|---|")
    for k, label, versus in [
            ("dtrain/local/none/fused", "dtrain, one process", "pytorch/local/none"),
            ("pytorch/local/none/default", "PyTorch, one process", None),
            ("pytorch/local/none/fused", "PyTorch AdamW(fused=True), one process", None),
            ("dtrain/ddp/mpi/fused", "dtrain DDP, MPI", "pytorch/ddp/gloo"),
            ("dtrain/ddp/gloo/fused", "dtrain DDP, Gloo", "pytorch/ddp/gloo"),
            ("pytorch/ddp/gloo/default", "PyTorch DDP, Gloo", None),
            ("pytorch/ddp/gloo/fused", "PyTorch DDP, Gloo, AdamW(fused=True)", None)]:
        k += "/scaler-off"
        if k not in groups: continue
        s = med(k, "median_step_s")
        b, o = med(k, "median_backward_s"), med(k, "median_optimizer_s")
        ratio = lambda opt: (f"{s / med(versus + '/' + opt + '/scaler-off', 'median_step_s'):.3f}"
                             if versus and versus + "/" + opt + "/scaler-off" in groups else "")
        print(f"| {label} | {s:.4f} | {s - b - o:.4f} | {b:.4f} | {o:.4f} | {ratio('default')} | "
              f"{ratio('fused')} |")
if "pytorch/ddp/gloo/default" in groups:
    n = len(groups["pytorch/ddp/gloo/default"])
    print(f"DDP step time beside the local step, TransformerLM {p/1e6:.1f}M parameters, 2 ranks "
          f"x 1 thread (local: 1 process x 1 thread), {n} alternating rounds (median of per-run "
          f"medians)\n")
    print("| implementation | step (s) | backward (s) | optimizer (s) | all-reduce (s) | "
          "exposed (s) | step / its local step |")
    print("|---|---|---|---|---|---|---|")
    local_pt = med("pytorch/local/none/default", "median_step_s")
    local_dt = med("dtrain/local/none/fused", "median_step_s")
    for k, label, local in [
            ("pytorch/ddp/gloo/default", "PyTorch 2.13 DDP, Gloo", local_pt),
            ("dtrain/ddp/gloo/fused", "dtrain DDP, Gloo", local_dt),
            ("dtrain/ddp/mpi/fused", "dtrain DDP, MPI", local_dt),
            ("pytorch/local/none/default", "PyTorch, local step", local_pt),
            ("dtrain/local/none/fused", "dtrain, local step", local_dt)]:
        if k not in groups: continue
        s = med(k, "median_step_s")
        comm = (f"{med(k,'comm_s'):.4f} | {med(k,'exposed_s'):.4f}"
                if "comm_s" in groups[k][0] and "ddp" in k else "n/a | n/a")
        print(f"| {label} | {s:.4f} | {med(k,'median_backward_s'):.4f} | "
              f"{med(k,'median_optimizer_s'):.4f} | {comm} | {s/local:.3f} |")
    abk = [("pytorch/ddp/gloo/default/ab", "PyTorch 2.13 DDP, Gloo"),
           ("dtrain/ddp/gloo/fused/ab", "dtrain DDP, Gloo"), ("dtrain/ddp/mpi/fused/ab", "dtrain DDP, MPI")]
    if any(k in groups for k, _ in abk):
        print("\nThe same, against the same two processes' own steps without communication "
              "(every other step under no_sync(): both ranks compute, nothing is reduced; medians "
              "of per-run medians, 8 steps of each kind per run; this cancels the drift between "
              "processes that moves the table above by several percent)\n")
        print("| implementation | DDP step (s) | step without communication (s) | ratio | per run |")
        print("|---|---|---|---|---|")
        for k, label in abk:
            if k not in groups: continue
            rs = groups[k]
            ratios = sorted(r["ab_sync_step_s"] / r["ab_local_step_s"] for r in rs)
            sy = statistics.median(r["ab_sync_step_s"] for r in rs)
            lo = statistics.median(r["ab_local_step_s"] for r in rs)
            print(f"| {label} | {sy:.4f} | {lo:.4f} | {statistics.median(ratios):.3f} | "
                  f"{ratios[0]:.3f} - {ratios[-1]:.3f} |")
    print("\nAdamW's share of the local step\n")
    print("| optimizer | optimizer (s) | step (s) | share |")
    print("|---|---|---|---|")
    for k, label in [("dtrain/local/none/fused", "dtrain::optim::AdamW (fused kernel; the trainer's)"),
                     ("dtrain/local/none/libtorch", "torch::optim::AdamW (LibTorch's loop)"),
                     ("pytorch/local/none/fused", "PyTorch AdamW(fused=True)"),
                     ("pytorch/local/none/default", "PyTorch AdamW (default, foreach)")]:
        if k not in groups: continue
        o, s = med(k, "median_optimizer_s"), med(k, "median_step_s")
        print(f"| {label} | {o:.4f} | {s:.4f} | {100*o/s:.1f}% |")
base = "dtrain/ddp/mpi/fused/scaler-off"
if base in groups and any(k.startswith(base[:-3]) and k != base for k in groups):
    n = len(groups[base])
    print(f"\nWhat a GradScaler adds to dtrain's DDP step over MPI ({n} rounds; bf16 autocast and\n"
          "buckets with the scaler on top: its work is what it is with fp16, whose CPU matmuls\n"
          "are too slow to be a fair denominator). scaler: scale(), step() less the fused AdamW\n"
          "inside it, and update(), in the process; write-back: DDP's write-back of the reduced\n"
          "buckets, which widens them and, by mode, also checks (and unscales) them; check: an\n"
          "inf/NaN loop of its own; AdamW: the fused kernel, which also unscales every gradient\n"
          "when handed the scale. Each set against the run without a scaler:\n"
          "added = scaler + check + (write-back - its own) + (AdamW - its own).\n")
    print("| gradients checked (and unscaled) by | scaler (s) | write-back (s) | check (s) | "
          "AdamW (s) | added (s) | added / step |")
    print("|---|---|---|---|---|---|---|")
    ad0, st0 = med(base, "median_adamw_s"), med(base, "median_step_s")
    wb0 = med(base, "median_write_back_s")
    for k, label in [("dtrain/ddp/mpi/fused/scaler-in-ddp",
                      "DDP's write-back, checked and unscaled (grad_scaler; the trainer's)"),
                     ("dtrain/ddp/mpi/fused/scaler-verdict",
                      "DDP's write-back, checked; the kernel unscales (check_finite)"),
                     ("dtrain/ddp/mpi/fused/scaler-own-check", "the scaler's own pass"),
                     (base, "(no scaler)")]:
        if k not in groups: continue
        sc, ck, ad, wb = (med(k, f) for f in ("median_scaler_s", "median_finite_check_s",
                                              "median_adamw_s", "median_write_back_s"))
        added = sc + ck + (wb - wb0) + (ad - ad0)
        print(f"| {label} | {sc:.5f} | {wb:.5f} | {ck:.5f} | {ad:.5f} | {added:.5f} | "
              f"{100 * added / st0:.2f}% |")
    print(f"\nDDP step without a scaler: {st0:.4f} s")
ab = "dtrain/ddp/mpi/fused/scaler-ab"
if ab in groups:
    rs = groups[ab]
    m = lambda f: statistics.median(r[f] for r in rs)
    added = (m("ab_on_scaler_s") + (m("ab_on_write_back_s") - m("ab_off_write_back_s")) +
             (m("ab_on_adamw_s") - m("ab_off_adamw_s")))
    print(f"\nThe trainer's way against no scaler in alternate steps of one process ({len(rs)} "
          "runs x 8 steps each; medians of per-run medians):\n")
    print("| steps | step (s) | forward (s) | backward (s) | scaler (s) | write-back (s) | "
          "AdamW (s) |")
    print("|---|---|---|---|---|---|---|")
    for tag, label in [("on", "with the GradScaler in DDP's write-back"), ("off", "without")]:
        f = lambda name: m("ab_" + tag + "_" + name + "_s")
        print(f"| {label} | {f('step'):.5f} | {f('forward'):.5f} | {f('backward'):.5f} | "
              f"{f('scaler'):.5f} | {f('write_back'):.5f} | {f('adamw'):.5f} |")
    ratios = sorted(r["ab_on_step_s"] / r["ab_off_step_s"] for r in rs)
    print(f"\nadded = scaler + (write-back - without) + (AdamW - without) = {added:.5f} s, "
          f"{100 * added / m('ab_off_step_s'):.2f}% of the step. Whole steps with / without, "
          f"per run: median {statistics.median(ratios):.3f}, {ratios[0]:.3f} to {ratios[-1]:.3f} "
          "(forward and backward, the same work in both, move as much).")
PY
rm -f "$out"
