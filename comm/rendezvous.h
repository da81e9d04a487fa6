// Rendezvous: who am I (rank, world size, local rank, local world size) and where do ranks
// meet (the store).
//
// Sources, first match wins:
//   1. explicit options (both rank and world_size given)
//   2. torchrun / dtrain-launch: RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR
//   MASTER_PORT
//   3. OpenMPI (mpirun):         OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}
//   4. Slurm (srun):             SLURM_PROCID SLURM_NTASKS SLURM_LOCALID (+ SLURM_NTASKS_PER_NODE)
//   5. a single process (rank 0 of 1)
// MASTER_ADDR/MASTER_PORT (default 127.0.0.1:29500, as torchrun) apply to every source.
// The store is a c10d::TCPStore served by rank 0; NCCL exchanges its unique id through it
// (or through MPI when launched by mpirun, see comm/factory.h).
//
// Exposure (docs/reliability.md): the store listens on MASTER_ADDR only (loopback unless a
// job spans nodes), never on every interface. Before anything else uses it, every rank
// proves it belongs to this job: rank 0 admits a rank only with the same world size, job id
// (TORCHELASTIC_RUN_ID, which dtrain-launch sets per run, else SLURM_JOB_ID, else mpirun's
// job id), restart attempt, and DTRAIN_JOB_TOKEN (sent as a SHA-1 of token, job and rank,
// never in clear), and every rank checks rank 0 the same way. A mismatch is refused on every
// rank with an error that names the rank and what differs.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <optional>
#include <string>

#include "core/env.h"

namespace dtrain::comm {

struct RankInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "single process";  // "explicit", "torchrun", "openmpi", "slurm"
  bool mpi_launched = false;              // started by an MPI launcher (backend auto picks mpi)
  std::string job_id = "none";            // TORCHELASTIC_RUN_ID, SLURM_JOB_ID, mpirun's job
  int attempt = 0;                        // TORCHELASTIC_RESTART_COUNT
  std::string token;                      // DTRAIN_JOB_TOKEN; empty: none
};

struct RendezvousOptions {
  std::optional<int> rank;
  std::optional<int> world_size;
  std::optional<int> local_rank;
  std::optional<int> local_world_size;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
};

// Throws ConfigError naming the variables and their source when they are inconsistent.
RankInfo detect_rank_info(const RendezvousOptions& options = {},
                          const EnvLookup& env = process_env());

// TCPStore on master_addr:master_port, served by rank 0 on that address only. Blocks until
// every rank has joined and been admitted (see above), or throws CommError naming the
// address and the ranks missing or refused. A single process (world size 1) gets an
// in-memory store and opens no port.
c10::intrusive_ptr<c10d::Store> make_tcp_store(const RankInfo& info,
                                               std::chrono::milliseconds timeout);

}  // namespace dtrain::comm
