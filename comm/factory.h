// Creating the world communicator for this process.
//
// Backend `auto` resolves to nccl when the job's tensors live on CUDA, else mpi when an MPI
// launcher started the process (and this build has MPI), else gloo. DTRAIN_BACKEND (dtrain-launch
// --backend) replaces `auto` only; an explicit choice in the config wins. The timeout of every
// collective comes from the options, else DTRAIN_COMM_TIMEOUT_S, else 300 s.
#pragma once

#include <c10/core/DeviceType.h>

#include <chrono>
#include <memory>
#include <optional>

#include "comm/communicator.h"
#include "comm/rendezvous.h"
#include "comm/types.h"
#include "core/env.h"

namespace dtrain::comm {

struct CommOptions {
  Backend backend = Backend::kAuto;
  c10::DeviceType device = c10::kCPU;
  std::optional<std::chrono::milliseconds> timeout;
  RendezvousOptions rendezvous;
};

// What `requested` means for this process (see above); never kAuto. create_world refuses a
// backend this build lacks with ConfigError.
Backend resolve_backend(Backend requested, c10::DeviceType device, const RankInfo& info,
                        const EnvLookup& env = process_env());

// `t` if set, else DTRAIN_COMM_TIMEOUT_S, else 300 s.
std::chrono::milliseconds resolve_timeout(const std::optional<std::chrono::milliseconds>& t,
                                          const EnvLookup& env = process_env());

// Whether this build has the NCCL backend (CMake DTRAIN_WITH_CUDA / Bazel --config=cuda).
bool has_nccl_backend();
// Whether this build has the MPI backend (always in Bazel; CMake DTRAIN_WITH_MPI).
bool has_mpi_backend();

// The world communicator of this job, like init_process_group: rank, world size and the
// rendezvous come from dtrain-launch/torchrun, mpirun or srun variables (detect_rank_info);
// one process without any is a world of one. It knows each rank's node (world_nodes()),
// learned at the rendezvous. Collective: every rank calls it. It sets
// SIGPIPE to be ignored unless the program handles it (as Python does): a dead peer's socket
// then fails the collective with an error instead of killing this rank.
std::shared_ptr<Communicator> create_world(const CommOptions& options = {},
                                           const EnvLookup& env = process_env());

}  // namespace dtrain::comm
