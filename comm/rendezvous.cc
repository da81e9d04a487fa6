#include "comm/rendezvous.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "core/error.h"

namespace dtrain::comm {
namespace {

std::optional<int> get_int(const EnvLookup& env, const std::string& name) {
  if (!env(name)) return std::nullopt;
  return static_cast<int>(env_int(env, name, 0));
}

}  // namespace

RankInfo detect_rank_info(const RendezvousOptions& options, const EnvLookup& env) {
  RankInfo info;
  std::string vars;
  info.mpi_launched = env("OMPI_COMM_WORLD_SIZE") || env("PMI_SIZE") || env("PMIX_RANK");
  if (options.rank && options.world_size) {
    info.source = "explicit";
    vars = "explicit options rank/world_size";
    info.rank = *options.rank;
    info.world_size = *options.world_size;
    info.local_rank = options.local_rank.value_or(info.rank);
    info.local_world_size = options.local_world_size.value_or(info.world_size);
  } else if (env("RANK") && env("WORLD_SIZE")) {
    info.source = "torchrun";
    vars = "RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE";
    info.rank = *get_int(env, "RANK");
    info.world_size = *get_int(env, "WORLD_SIZE");
    info.local_rank = get_int(env, "LOCAL_RANK").value_or(info.rank);
    info.local_world_size = get_int(env, "LOCAL_WORLD_SIZE").value_or(info.world_size);
  } else if (env("OMPI_COMM_WORLD_RANK") && env("OMPI_COMM_WORLD_SIZE")) {
    info.source = "openmpi";
    vars = "OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE";
    info.rank = *get_int(env, "OMPI_COMM_WORLD_RANK");
    info.world_size = *get_int(env, "OMPI_COMM_WORLD_SIZE");
    info.local_rank = get_int(env, "OMPI_COMM_WORLD_LOCAL_RANK").value_or(info.rank);
    info.local_world_size = get_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE").value_or(info.world_size);
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    info.source = "slurm";
    vars = "SLURM_PROCID/NTASKS/LOCALID/NTASKS_PER_NODE";
    info.rank = *get_int(env, "SLURM_PROCID");
    info.world_size = *get_int(env, "SLURM_NTASKS");
    info.local_rank = get_int(env, "SLURM_LOCALID").value_or(0);
    if (auto per_node = get_int(env, "SLURM_NTASKS_PER_NODE")) {
      info.local_world_size = *per_node;
    } else if (auto nodes = get_int(env, "SLURM_NNODES")) {
      info.local_world_size = (info.world_size + *nodes - 1) / std::max(1, *nodes);
    } else {
      info.local_world_size = info.world_size;
    }
  } else {
    vars = "defaults";
  }
  if (auto addr = env("MASTER_ADDR")) info.master_addr = *addr;
  if (env("MASTER_PORT")) info.master_port = *get_int(env, "MASTER_PORT");
  if (options.master_addr) info.master_addr = *options.master_addr;
  if (options.master_port) info.master_port = *options.master_port;

  DTRAIN_CHECK_AS(ConfigError, info.world_size >= 1, "world size ", info.world_size, " from ", vars,
                  " must be at least 1");
  DTRAIN_CHECK_AS(ConfigError, info.rank >= 0 && info.rank < info.world_size, "rank ", info.rank,
                  " from ", vars, " is outside [0, ", info.world_size, ")");
  DTRAIN_CHECK_AS(ConfigError,
                  info.local_world_size >= 1 && info.local_world_size <= info.world_size,
                  "local world size ", info.local_world_size, " from ", vars,
                  " must be in [1, world size ", info.world_size, "]");
  DTRAIN_CHECK_AS(ConfigError, info.local_rank >= 0 && info.local_rank < info.local_world_size,
                  "local rank ", info.local_rank, " from ", vars, " is outside [0, ",
                  info.local_world_size, ")");
  DTRAIN_CHECK_AS(ConfigError, info.master_port > 0 && info.master_port < 65536, "MASTER_PORT ",
                  info.master_port, " is not a TCP port (1-65535)");
  return info;
}

c10::intrusive_ptr<c10d::Store> make_tcp_store(const RankInfo& info,
                                               std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(info.master_port);
  opts.isServer = info.rank == 0;
  opts.numWorkers = info.world_size;
  opts.waitWorkers = true;
  opts.timeout = timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(info.master_addr, opts);
  } catch (const std::exception& e) {
    DTRAIN_FAIL(CommError, "rendezvous: rank ", info.rank, " of ", info.world_size, " could not ",
                info.rank == 0 ? "serve" : "reach", " the store at ", info.master_addr, ":",
                info.master_port, " (", info.source, "): ", ::dtrain::detail::clause(e.what()),
                ". Check MASTER_ADDR/MASTER_PORT, that the port is free, and that every rank "
                "started.");
  }
}

}  // namespace dtrain::comm
