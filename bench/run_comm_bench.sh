#!/usr/bin/env bash
# dtrain's MPI backend against raw MPI, repeated: comm_bench RUNS times at 2 and at 4 ranks
# (4 oversubscribes a 2-core machine), 4 KiB to MAX_MIB, all_reduce / reduce_scatter /
# all_gather in fp32 and bf16, without the Gloo column. Prints, per row, the median and the
# minimum over the runs of dtrain/raw (each run's figure is already the median of --reps
# repetitions), the raw time per op and dtrain's extra time per op (medians).
#   bench/run_comm_bench.sh [RUNS] [MAX_MIB] [RANKS...]
# BASELINE=path/to/an/older/comm_bench runs that binary in turn with this one, run for run, and
# adds its median dtrain/raw and its extra time per op beside this build's, so a change to the
# communicator is judged side by side on the same machine at the same moment.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3} max_mib=${2:-64}
shift 2 || shift $# || true
ranks=("$@")
[ ${#ranks[@]} -gt 0 ] || ranks=(2 4)
scripts/bootstrap >/dev/null
bazel build --config=ci //bench:comm_bench >/dev/null 2>&1
bins=(bazel-bin/bench/comm_bench)
if [ -n "${BASELINE:-}" ]; then
  [ -x "$BASELINE" ] || { echo "BASELINE=$BASELINE is not an executable comm_bench" >&2; exit 2; }
  bins+=("$BASELINE")
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out=$(mktemp)
for r in $(seq "$runs"); do
  for np in "${ranks[@]}"; do
    yield=()
    [ "$np" -gt "$(nproc)" ] && yield=(--mca mpi_yield_when_idle 1)
    for b in "${!bins[@]}"; do
      mpirun -np "$np" --oversubscribe --bind-to none "${yield[@]}" "${bins[$b]}" \
        --max-mib "$max_mib" --no-gloo --reps 5 | sed "s/^|/$b | $np |/" |
        grep -E "^[0-9]+ \| [0-9]+ \| [ar]" >>"$out"
    done
  done
done
.venv/bin/python - "$out" "$runs" "${BASELINE:+1}" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    c = [x.strip() for x in line.split("|")]
    b, np, op, dt, size = int(c[0]), c[1], c[2], c[3], c[4]
    rows.setdefault((int(np), op, dt, size), ([], []))[b].append(
        (float(c[9]), float(c[10]), float(c[11])))
baseline = sys.argv[3] == "1"
print(f"dtrain-MPI / raw MPI over {sys.argv[2]} runs (each the median of 5 repetitions)\n")
head = "| ranks | op | dtype | size | median | min | raw us/op | dtrain extra us/op |"
if baseline:
    head += " baseline median | baseline extra us/op |"
print(head)
print("|---" * (head.count("|") - 1) + "|")
below = []
for (np, op, dt, size), (v, base) in rows.items():
    ratios = [x[0] for x in v]
    med, lo = statistics.median(ratios), min(ratios)
    line = (f"| {np} | {op} | {dt} | {size} | {med:.2f} | {lo:.2f} | "
            f"{statistics.median(x[1] for x in v):.2f} | {statistics.median(x[2] for x in v):.2f} |")
    if baseline:
        line += (f" {statistics.median(x[0] for x in base):.2f} |"
                 f" {statistics.median(x[2] for x in base):.2f} |")
    print(line)
    if med < 0.9:
        below.append(f"{np} ranks {op} {dt} {size} ({med:.2f})")
print(f"\nrows with a median below 0.9: {len(below)} of {len(rows)}" +
      (": " + ", ".join(below) if below else ""))
PY
rm -f "$out"
