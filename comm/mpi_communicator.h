// MPI backend (OpenMPI). Collectives run on ordered worker threads, so they overlap the
// caller's compute: the world communicator's (which also runs MPI_Init_thread and
// MPI_Finalize), and one per communicator made by split() when the library provides
// MPI_THREAD_MULTIPLE (OpenMPI does). Collectives on different communicators then progress
// at once (FSDP's all-gathers do not wait behind its reduce-scatters, which run on a
// communicator of their own); without MPI_THREAD_MULTIPLE (an application that initialized
// MPI itself with a lower level) every communicator shares the world's thread.
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
#include <string>

#include "comm/communicator.h"

namespace dtrain::comm {

// The world communicator over MPI_COMM_WORLD (duplicated). Initializes MPI on first use.
// With a `node_key` (comm/rendezvous.h), the ranks learn each other's node through one
// MPI_Allgather of the keys' hashes (outside the communicator's own numbered collectives)
// and the communicator knows them (world_nodes()).
std::shared_ptr<Communicator> make_mpi_world(std::chrono::milliseconds timeout,
                                             const std::string& node_key = "");

// Runs `fn` on the MPI worker thread, after every collective issued before it (for raw-MPI
// benchmarks that must be serialized with dtrain's own MPI calls).
void run_on_mpi_thread(const std::function<void()>& fn);

}  // namespace dtrain::comm
