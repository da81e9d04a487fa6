#!/usr/bin/env bash
# The speed figures dtrain promises, timed side by side on this machine and checked against
# their bounds (bench/perf_check.py says which, and why each bound is what it is). CI runs it
# after the test suite; it fails naming the figure, its value and the bound.
#   bench/perf_check.sh [--rounds N] [--only attention,default_bf16,...] [--margin 0.10]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap >/dev/null
log=$(mktemp)
bazel build --config=ci //bench:attention_bench //bench:step_bench //framework:dtrain-train \
  //launcher:dtrain-launch >"$log" 2>&1 || { cat "$log"; exit 1; }
rm -f "$log"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec .venv/bin/python bench/perf_check.py --bin "$(bazel info --config=ci bazel-bin 2>/dev/null)" "$@"
