#!/usr/bin/env bash
# Tensor parallelism x FSDP: dtrain's 2-D mesh beside PyTorch 2.13's parallelize_module +
# fully_shard (bench/reference/tp_reference.py) on the same Llama shape, at 4 ranks over Gloo,
# one thread per rank, in one run; and dtrain's TP traffic and memory against Megatron's
# formulas (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
# Models").
#   bench/run_tp_bench.sh [ROUNDS [VALIDATION_ROUNDS]]
# 1. Step time: shard 2 x tp 2, with and without sequence parallelism, and FSDP alone over 4
#    (tp 1), each side; rounds alternate dtrain's and PyTorch's runs (a noisy machine), the
#    table shows medians over rounds of each run's median step.
# 2. Bytes per layer: one step's collectives on the tp group, from dtrain's flight recorder
#    (tp 2, no data parallelism), at L and 2L layers: the difference over L is one layer's,
#    free of the embedding's and the loss's. Against Megatron's per layer: 4 all-reduces of
#    b*s*h elements (2 forward, 2 backward), or with sequence parallelism 4 all-gathers and 4
#    reduce-scatters of b*s*h; on a ring each moves 8 (t-1)/t b s h elements per rank.
# 3. Memory per rank: the steady state (parameters, gradients, optimizer state) against
#    1/(tp x shard) of the model's, and the activations of one layer (the step's peak above the
#    steady state, L vs 2L) at tp 1, tp 2 and tp 2 + SP, against Megatron's
#    sbh(10 + 24/t) (TP) and sbh(34/t) (TP + SP) over sbh*34 without TP: the parts the formula
#    divides by t.
# 4. The scaling model's FSDP x TP schedule (bench/scaling_model.py validate-tp) against these
#    runs at 2 and 4 ranks: fed with ranks computing a tp rank's part side by side without
#    collectives (--local-of) and each run's own probes of its collectives (--probe-comm).
#    VALIDATION_ROUNDS (default 7; about 30 s each here): one round's runs on 2 shared cores
#    scatter by up to +-30% around their medians, which 3 rounds do not tame.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
validation_rounds=${2:-7}
scripts/bootstrap >/dev/null
bazel build --config=ci //bench:tp_bench //launcher:dtrain-launch //framework:libdtrain_memory.so \
  >/dev/null 2>&1
export OMP_NUM_THREADS=1
tracker=$PWD/bazel-bin/framework/libdtrain_memory.so
launch() {
  local n=$1
  shift
  bazel-bin/launcher/dtrain-launch --nproc-per-node "$n" --master-port 0 --backend gloo -- "$@" |
    sed -n 's/^\[rank 0\] //p' | grep '^{'
}
out=$(mktemp)
work=$(mktemp -d)
trap 'rm -rf "$out" "$work"' EXIT
for r in $(seq "$rounds"); do
  echo "round $r/$rounds" >&2
  for cfg in "--tp 2" "--tp 2 --sp" "--tp 1"; do
    # shellcheck disable=SC2086
    launch 4 bazel-bin/bench/tp_bench $cfg >>"$out"
    # shellcheck disable=SC2086
    launch 4 .venv/bin/python -W ignore bench/reference/tp_reference.py $cfg --tracker "$tracker" \
      >>"$out"
  done
  launch 4 bazel-bin/bench/tp_bench --tp 2 --sp --keep-gathered >>"$out"
done
# Traffic and activations: one timed step after one warm-up, at 4 and 8 layers.
for layers in 4 8; do
  for cfg in "1 --tp 1" "2 --tp 2" "2 --tp 2 --sp" "2 --tp 2 --sp --keep-gathered"; do
    n=${cfg%% *}
    dir="$work/L$layers-${cfg// /_}"
    mkdir -p "$dir"
    # shellcheck disable=SC2086
    launch "$n" bazel-bin/bench/tp_bench ${cfg#* } --layers "$layers" --steps 1 --warmup 1 \
      --flight-out "$dir" | sed "s|^{|{\"flight\":\"$dir\",\"probe\":true,|" >>"$out"
  done
done
# The scaling model's inputs and the runs it predicts, VALIDATION_ROUNDS times.
val=$work/validate.jsonl
for r in $(seq "$validation_rounds"); do
  echo "validation round $r/$validation_rounds" >&2
  for cfg in "2 --local-of 1" "2 --local-of 2" "4 --local-of 1" "4 --local-of 2" \
    "4 --local-of 4" "2 --tp 2 --probe-comm" "2 --tp 1 --probe-comm" "4 --tp 2 --probe-comm" \
    "4 --tp 4 --probe-comm" "4 --tp 1 --probe-comm"; do
    # shellcheck disable=SC2086
    launch "${cfg%% *}" bazel-bin/bench/tp_bench ${cfg#* } >>"$val"
  done
done
.venv/bin/python - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
timed = [r for r in rows if not r.get("probe")]
probes = [r for r in rows if r.get("probe")]
def name(r):
    return (f"shard {r['dp']} x tp {r['tp']}" + (" + SP" if r["sp"] else "") +
            (" (kept)" if r["sp"] and not r.get("regather", True) else ""))
def mode(r):
    return (r["tp"], r["sp"], r.get("regather", True))
print(f"== step time, {timed[0]['world']} ranks (Gloo, 1 thread each), Llama h {timed[0]['hidden']}, "
      f"{timed[0]['layers']} layers, s {timed[0]['seq']}, b {timed[0]['batch']} per data-parallel rank, fp32")
print(f"{'mesh':<27}{'dtrain s':>9}{'PyTorch s':>10}{'ratio':>7}{'dtrain steady MB':>18}"
      f"{'(pooled)':>9}{'PyTorch steady MB':>19}{'dtrain peak MB':>16}{'PyTorch peak MB':>17}")
for key in [(2, False, True), (2, True, True), (2, True, False), (1, False, True)]:
    d = [r for r in timed if r["impl"] == "dtrain" and mode(r) == key]
    # PyTorch's SequenceParallel keeps the gathered sequence: its one SP run is set beside both.
    p = [r for r in timed if r["impl"] == "pytorch" and (r["tp"], r["sp"]) == key[:2]]
    if not d or not p:
        continue
    md = statistics.median(r["median_step_s"] for r in d)
    mp = statistics.median(r["median_step_s"] for r in p)
    med = lambda rs, f: statistics.median(r[f] for r in rs)
    print(f"{name(d[0]):<27}{md:>9.3f}{mp:>10.3f}{md / mp:>7.2f}{med(d, 'steady_mb'):>18.1f}"
          f"{med(d, 'pooled_mb'):>9.1f}{med(p, 'steady_mb'):>19.1f}{med(d, 'peak_mb'):>16.1f}"
          f"{med(p, 'peak_mb'):>17.1f}")
print("steady: between steps, gradients of the last step still held on both sides; pooled: of "
      "dtrain's, FSDP's freed gathered and gradient buffers kept for the next step")

def window_entries(r):
    d = json.load(open(f"{r['flight']}/flight_rank0.json"))
    lo, hi = r["window_us"]
    return [e for e in d["entries"] if lo <= e["issued_us"] <= hi]
def tp_traffic(r):
    """Elements of the tp group's collectives in the window (as full tensors), and the ring's
    elements moved per rank."""
    t = r["tp"]
    group = list(range(t))
    full = wire = 0
    ops = {}
    for e in window_entries(r):
        if e["ranks"] != group:
            continue
        n = e["numel"]
        if e["op"] == "all_reduce":
            f, w = n, 2 * (t - 1) / t * n
        elif e["op"] == "all_gather":      # numel: each rank's input
            f, w = t * n, (t - 1) * n
        elif e["op"] == "reduce_scatter":  # numel: the whole input
            f, w = n, (t - 1) / t * n
        else:
            continue
        full += f
        wire += w
        ops[e["op"]] = ops.get(e["op"], 0) + 1
    return full, wire, ops
by = {(r["layers"],) + mode(r): r for r in probes}
small, big = sorted({r["layers"] for r in probes})
per = big - small
print()
print(f"== tp traffic per layer (the {big}- and {small}-layer steps' difference over {per}), "
      f"tp 2, fp32 (4 bytes)")
print(f"{'':<15}{'collectives':>32}{'elements (full)':>17}{'Megatron':>10}{'wire/rank':>11}{'Megatron':>10}")
for sp, regather in ((False, True), (True, False), (True, True)):
    a, b = by[(big, 2, sp, regather)], by[(small, 2, sp, regather)]
    fa, wa, oa = tp_traffic(a)
    fb, wb, ob = tp_traffic(b)
    bsh = a["batch"] * a["seq"] * a["hidden"]
    t = 2
    ops = ", ".join(f"{(oa[k] - ob.get(k, 0)) // per} {k}" for k in sorted(oa)
                    if oa[k] != ob.get(k, 0))
    meg_full = (4 * bsh) if not sp else 8 * bsh
    meg_wire = 8 * (t - 1) / t * bsh
    label = "TP" if not sp else "TP + SP, kept" if not regather else "TP + SP"
    print(f"{label:<15}{ops:>32}{(fa - fb) / per:>17.0f}{meg_full:>10}"
          f"{(wa - wb) / per:>11.0f}{meg_wire:>10.0f}")
print("(under SP the norms' weight gradients, 2h per layer, go in one all-reduce per step; "
      "'TP + SP' all-gathers each column-wise input again in backward, as Megatron-LM does)")
print()
print("== memory per rank")
one = by[(big, 1, False, True)]
for sp in (False, True):
    r = by[(big, 2, sp, True)]
    print(f"tp 2{' + SP' if sp else ''}: {r['local_elements']} parameters here (the model's "
          f"{one['local_elements']} / 2 = {one['local_elements'] / 2:.0f} plus the norms whole); "
          f"steady {r['steady_mb']:.1f} MB against parameters + gradients + AdamW's 2 moments "
          f"(4 x 4 bytes) {16 * r['local_elements'] / 1e6:.1f} MB")
act = {}
for key in [(1, False, True), (2, False, True), (2, True, True), (2, True, False)]:
    a, b = by[(big,) + key], by[(small,) + key]
    act[key] = ((a["peak_mb"] - a["steady_mb"]) - (b["peak_mb"] - b["steady_mb"])) / per
base = act[(1, False, True)]
r = by[(big, 1, False, True)]
sbh = r["seq"] * r["batch"] * r["hidden"] * 4 / 1e6
print(f"activations per layer, MB (s*b*h*4 bytes = {sbh:.3f} MB), and as a fraction of tp 1's "
      f"against Megatron's formula (16-bit terms, attention scores aside):")
for key, label, formula, text in [
        ((1, False, True), "tp 1", 1.0, "34/34"),
        ((2, False, True), "tp 2", (10 + 24 / 2) / 34, "(10 + 24/t)/34"),
        ((2, True, True), "tp 2 + SP", 0.5, "(34/t)/34"),
        ((2, True, False), "tp 2 + SP, kept", (4 + 30 / 2) / 34, "(4 + 30/t)/34")]:
    print(f"  {label:<17}{act[key]:>8.3f} MB  {act[key] / base:>5.2f}   formula {text} = {formula:.2f}")
PY
echo
echo "== the scaling model's FSDP x TP step against these runs"
.venv/bin/python bench/scaling_model.py validate-tp --measured "$val" || true
