// Rendezvous: who am I (rank, world size, local rank, local world size) and where do ranks
// meet (the store).
//
// Sources, first match wins (docs/clusters.md has the whole table):
//   1. explicit options (both rank and world_size given)
//   2. torchrun / dtrain-launch / PyTorchJob: RANK WORLD_SIZE [LOCAL_RANK LOCAL_WORLD_SIZE]
//   3. OpenMPI (mpirun):          OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}
//   4. MPICH / Intel MPI (Hydra): PMI_RANK PMI_SIZE [MPI_LOCALRANKID MPI_LOCALNRANKS]; before
//                                 Slurm, whose variables Hydra's ranks inherit
//   5. Slurm (srun):              SLURM_PROCID SLURM_NTASKS SLURM_LOCALID
//                                 [SLURM_NTASKS_PER_NODE]
//   6. a single process (rank 0 of 1)
// MASTER_ADDR/MASTER_PORT (default 127.0.0.1:29500, as torchrun) apply to every source.
//
// The node layout is learned, not assumed: at the rendezvous every rank says which node it is
// on (its host name, and GROUP_RANK where a launcher sets one), and rank 0 hands everyone the
// layout. The local rank and local world size come from it; where the environment also gave
// them (LOCAL_WORLD_SIZE, ...), a difference is refused on every rank, naming both.
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
#include <vector>

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
  // Whether the environment gave local_rank/local_world_size (which variables: local_vars);
  // when it did not, they are the single-node guess until the rendezvous learns them.
  bool local_given = false;
  std::string local_vars;
  std::string host;  // this host's name (gethostname)
  // This rank's node as the ranks tell nodes apart: the host name, plus "#GROUP_RANK" where
  // a launcher sets GROUP_RANK (several launchers on one host are separate nodes).
  std::string node_key;
  // Learned at the rendezvous (make_tcp_store): each world rank's node index (nodes numbered
  // in order of their first rank), each node's name, and the address each node's first rank
  // reaches rank 0 from ("" for rank 0's own node).
  std::vector<int> node_of;
  std::vector<std::string> node_names;
  std::vector<std::string> node_addresses;
  // Set by make_tcp_store on rank 0 when the store listens elsewhere than MASTER_ADDR (why),
  // for the caller to log.
  std::string store_note;
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

// TCPStore on master_addr:master_port, served by rank 0 on that address only
// (net::store_bind_address: every interface where that name resolves to loopback here).
// Blocks until every rank has joined and been admitted (see above), or throws CommError
// naming the address and the ranks missing or refused; then fills in the learned layout
// (node_of, node_names, node_addresses, local_rank, local_world_size). A single process
// (world size 1) gets an in-memory store and opens no port.
c10::intrusive_ptr<c10d::Store> make_tcp_store(RankInfo& info, std::chrono::milliseconds timeout);
inline c10::intrusive_ptr<c10d::Store> make_tcp_store(RankInfo&& info,
                                                      std::chrono::milliseconds timeout) {
  return make_tcp_store(info, timeout);  // the layout learned is not wanted
}

// The address this rank's Gloo sockets should use: 127.0.0.1 when the job is on one node;
// "" (GLOO_SOCKET_IFNAME, else Gloo's own choice by host name) when the host name resolves
// to an address other nodes can reach; else the local address that routes to another node
// (the host name resolves to loopback, as in Debian's /etc/hosts).
std::string gloo_address(const RankInfo& info);

}  // namespace dtrain::comm
