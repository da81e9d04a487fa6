#include "comm/factory.h"

#include <algorithm>
#include <csignal>

#include "comm/gloo_communicator.h"
#include "core/error.h"
#include "core/guardian.h"
#include "core/logging.h"
#ifdef DTRAIN_WITH_MPI
#include "comm/mpi_communicator.h"
#endif
#ifdef DTRAIN_WITH_NCCL
#include "comm/nccl_communicator.h"
#endif

namespace dtrain::comm {

Backend resolve_backend(Backend requested, c10::DeviceType device, const RankInfo& info,
                        const EnvLookup& env) {
  if (requested == Backend::kAuto) {
    if (auto b = env("DTRAIN_BACKEND"); b && !b->empty()) requested = parse_backend(*b);
  }
  if (requested != Backend::kAuto) return requested;
  if (device == c10::kCUDA) return Backend::kNccl;
  if (info.mpi_launched && has_mpi_backend()) return Backend::kMpi;
  return Backend::kGloo;
}

std::chrono::milliseconds resolve_timeout(const std::optional<std::chrono::milliseconds>& t,
                                          const EnvLookup& env) {
  if (t) return *t;
  double seconds = env_double(env, "DTRAIN_COMM_TIMEOUT_S", 300.0);
  DTRAIN_CHECK_AS(ConfigError, seconds > 0, "DTRAIN_COMM_TIMEOUT_S=", seconds, " must be positive");
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

bool has_mpi_backend() {
#ifdef DTRAIN_WITH_MPI
  return true;
#else
  return false;
#endif
}

bool has_nccl_backend() {
#ifdef DTRAIN_WITH_NCCL
  return true;
#else
  return false;
#endif
}

std::shared_ptr<Communicator> create_world(const CommOptions& options, const EnvLookup& env) {
  // A write to the socket of a peer that died must fail with EPIPE, which the backend reports
  // naming the collective, not kill this rank with SIGPIPE (whose death would then be taken
  // for the cause). Python ignores SIGPIPE at startup for the same reason; a program that set
  // its own handler keeps it.
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    ::signal(SIGPIPE, SIG_IGN);
  }
  RankInfo info = detect_rank_info(options.rendezvous, env);
  Backend backend = resolve_backend(options.backend, options.device, info, env);
  auto timeout = resolve_timeout(options.timeout, env);
  // Before MPI_Init: a rank of mpirun gets a guardian that ends its children if it dies.
  guard_children_of_mpi_rank();
  std::shared_ptr<Communicator> comm;
  switch (backend) {
    case Backend::kMpi: {
#ifndef DTRAIN_WITH_MPI
      DTRAIN_FAIL(ConfigError,
                  "backend mpi is not in this build (configured with DTRAIN_WITH_MPI=OFF): "
                  "rebuild with MPI, or use backend gloo (nccl for CUDA tensors)");
#else
      comm = make_mpi_world(timeout, info.node_key);
      // A job whose environment says N ranks never trains as fewer: the MPI library joined
      // another job than the launcher's (or none: a singleton per process).
      DTRAIN_CHECK_AS(ConfigError, comm->size() == info.world_size || info.source != "torchrun",
                      "mpi backend sees ", comm->size(), " ranks but WORLD_SIZE=", info.world_size,
                      ": ranks started by dtrain-launch are separate MPI jobs; use --backend "
                      "gloo, or start the job with mpirun");
      DTRAIN_CHECK_AS(
          ConfigError, comm->size() == info.world_size || info.source == "single process",
          "the environment says this is rank ", info.rank, " of ", info.world_size, " (",
          info.source == "mpich"   ? "PMI_RANK/PMI_SIZE: MPICH's or Intel MPI's Hydra launcher"
          : info.source == "slurm" ? "SLURM_PROCID/SLURM_NTASKS: srun"
                                   : info.source + "'s variables",
          "), but the MPI library dtrain was built with sees ", comm->size(), " rank(s): it is ",
          "not the MPI that started the job, so each process would train alone. Start the job "
          "with the mpirun of the MPI dtrain was built with (or srun --mpi matching it), or set "
          "parallel.backend: gloo (or DTRAIN_BACKEND=gloo), which forms the job from these "
          "variables with MASTER_ADDR and MASTER_PORT");
#endif
      break;
    }
    case Backend::kGloo: {
      GlooSetup setup;
      setup.store = make_tcp_store(info, timeout);
      setup.rank = info.rank;
      setup.size = info.world_size;
      if (!info.store_note.empty()) logging::info(info.store_note);
      setup.hostname = gloo_address(info);
      setup.timeout = timeout;
      comm = make_gloo_world(setup);
      comm->set_world_nodes(info.node_of);
      break;
    }
    case Backend::kNccl: {
#ifdef DTRAIN_WITH_NCCL
      comm = make_nccl_world(info, timeout);
      comm->set_world_nodes(info.node_of);
#else
      DTRAIN_FAIL(ConfigError,
                  "backend nccl is not in this build: rebuild with CUDA (CMake "
                  "-DDTRAIN_WITH_CUDA=ON, Bazel --config=cuda), or use backend gloo/mpi");
#endif
      break;
    }
    case Backend::kAuto:
      break;
  }
  const auto& nodes = comm->world_nodes();
  logging::debug("communicator: backend ", comm->backend(), " rank ", comm->rank(), "/",
                 comm->size(), " (", comm->local_size(), " ranks on this node, ",
                 nodes.empty() ? 1 : 1 + *std::max_element(nodes.begin(), nodes.end()),
                 " node(s)) from ", info.source);
  return comm;
}

}  // namespace dtrain::comm
