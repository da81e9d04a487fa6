// MPI backend (OpenMPI). All MPI calls of the process, MPI_Init_thread and MPI_Finalize
// included, run on one ordered worker thread owned by a process-wide runtime, so
// MPI_THREAD_FUNNELED suffices and collectives overlap the caller's compute.
//
// MPI has no 16-bit float types: fp16 and bf16 travel as 2-byte datatypes with user-defined
// SUM/MAX/MIN ops that widen each pair to fp32 and round the result back (one rounding per
// pairwise step). AVG is SUM followed by a division by the group size. CUDA tensors are
// staged through host memory. A timed-out collective leaves the worker blocked in MPI; the
// runtime then skips MPI_Finalize at exit (the launcher or mpirun ends the job).
//
// Optional in the CMake build (DTRAIN_WITH_MPI=OFF, e.g. on GPU machines without an MPI):
// then has_mpi_backend() is false and backend mpi is a ConfigError.
#pragma once

#include <chrono>
#include <functional>
#include <memory>

#include "comm/communicator.h"

namespace dtrain::comm {

// The world communicator over MPI_COMM_WORLD (duplicated). Initializes MPI on first use.
std::shared_ptr<Communicator> make_mpi_world(std::chrono::milliseconds timeout);

// Runs `fn` on the MPI worker thread, after every collective issued before it (for raw-MPI
// benchmarks that must be serialized with dtrain's own MPI calls).
void run_on_mpi_thread(const std::function<void()>& fn);

}  // namespace dtrain::comm
