#!/bin/bash
# Runs a test binary as NP real processes and fails when any rank fails.
#   run_ranks.sh mpi    NP LAUNCHER BINARY [args...]   mpirun, backend mpi
#   run_ranks.sh launch NP LAUNCHER BINARY [args...]   dtrain-launch, backend gloo
# Extra environment (e.g. DTRAIN_COMM_TIMEOUT_S) passes through to every rank.
set -u
mode=$1 np=$2 launcher=$3
shift 3
# Bazel's per-test output files would be written by every rank at once.
unset TEST_PREMATURE_EXIT_FILE XML_OUTPUT_FILE GTEST_OUTPUT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export DTRAIN_COMM_TIMEOUT_S=${DTRAIN_COMM_TIMEOUT_S:-120}
case "$mode" in
  mpi)
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    # Ranks may outnumber cores; let idle ranks yield instead of spinning.
    export OMPI_MCA_mpi_yield_when_idle=1
    # Under ASan, OpenMPI's leaks are suppressed by library (bazel/sanitizers/lsan.supp), which
    # needs whole allocation stacks; the fast unwinder stops in OpenMPI's frames. Only ranks
    # under mpirun pay for full unwinding.
    [ -n "${ASAN_OPTIONS:-}" ] && export ASAN_OPTIONS="$ASAN_OPTIONS:fast_unwind_on_malloc=0"
    forward=()
    for v in DTRAIN_COMM_CHECK DTRAIN_TEST_DEVICE DTRAIN_ZOO_SEEDS ASAN_OPTIONS LSAN_OPTIONS UBSAN_OPTIONS TSAN_OPTIONS; do
      [ -n "${!v+x}" ] && forward+=(-x "$v")
    done
    exec mpirun -np "$np" --oversubscribe --bind-to none \
      -x OMP_NUM_THREADS -x DTRAIN_COMM_TIMEOUT_S -x DTRAIN_BACKEND=mpi "${forward[@]}" \
      "$@"
    ;;
  launch)
    exec "$launcher" --nproc-per-node "$np" --master-port 0 --grace-period 5 \
      --backend gloo -- "$@"
    ;;
  *)
    echo "run_ranks.sh: unknown mode '$mode' (mpi | launch)" >&2
    exit 2
    ;;
esac
