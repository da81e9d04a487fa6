// NCCL backend (built with CMake -DDTRAIN_WITH_CUDA=ON or Bazel --config=cuda).
//
// One NCCL communicator per group, on the device LOCAL_RANK, with its own non-blocking CUDA
// stream. A collective first makes that stream wait (by event) on the caller's current
// stream, so it sees the caller's writes. Work::wait() does not block the host: as c10d's
// does, it makes the caller's current stream wait on the collective's completion event, so
// later kernels see the result and the host runs ahead. The tensors stay referenced until
// completion, so the caching allocator cannot reuse them early.
//
// A watchdog thread completes Works by polling CUDA events (their device-side duration is
// Work::busy_seconds, measured by timing events on the NCCL stream), and turns NCCL's
// asynchronous errors into CommError and overdue collectives into TimeoutError. Either
// breaks the communicator: it is aborted once, every pending op fails, and later
// collectives are refused at once, so a rank stuck in a kernel can exit. The unique id
// travels through MPI when mpirun started the job, else through the rendezvous' TCPStore,
// which rank 0 keeps serving for the communicator's lifetime.
#pragma once

#include <chrono>
#include <memory>

#include "comm/communicator.h"
#include "comm/rendezvous.h"

namespace dtrain::comm {

// Fills in `info`'s node layout as the rendezvous learns it (comm/rendezvous.h).
std::shared_ptr<Communicator> make_nccl_world(RankInfo& info, std::chrono::milliseconds timeout);

}  // namespace dtrain::comm
