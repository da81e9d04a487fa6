// NCCL backend (built with CMake -DDTRAIN_WITH_CUDA=ON or Bazel --config=cuda).
//
// One NCCL communicator per group, on the device LOCAL_RANK, with its own non-blocking CUDA
// stream. A collective first makes that stream wait (by event) on the caller's current
// stream, so it sees the caller's writes; Work::wait() blocks the host until the op is done
// and then makes the caller's current stream wait on it. The tensors stay referenced until
// completion, so the caching allocator cannot reuse them early.
//
// A watchdog thread completes Works by polling CUDA events, and turns NCCL's asynchronous
// errors and overdue collectives into CommError / TimeoutError, aborting the communicator so
// the process can exit instead of hanging in a kernel. The unique id travels through MPI
// when mpirun started the job, else through the rendezvous' TCPStore.
#pragma once

#include <chrono>
#include <memory>

#include "comm/communicator.h"
#include "comm/rendezvous.h"

namespace dtrain::comm {

std::shared_ptr<Communicator> make_nccl_world(const RankInfo& info,
                                              std::chrono::milliseconds timeout);

}  // namespace dtrain::comm
