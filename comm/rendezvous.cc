#include "comm/rendezvous.h"

#include <c10/util/hash.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cerrno>
#include <cstring>
#include <set>
#include <sstream>
#include <thread>

#include <climits>
#include <cstdint>

#include "core/error.h"
#include "core/net.h"

namespace dtrain::comm {
namespace {

std::optional<int> get_int(const EnvLookup& env, const std::string& name) {
  if (!env(name)) return std::nullopt;
  const long v = env_int(env, name, 0);
  // Not truncated: RANK=4294967296 would otherwise be rank 0.
  DTRAIN_CHECK_AS(ConfigError, v >= INT_MIN && v <= INT_MAX, "environment variable ", name, "='",
                  *env(name), "' is out of range");
  return static_cast<int>(v);
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
      DTRAIN_CHECK_AS(ConfigError, *nodes >= 1, "SLURM_NNODES=", *nodes, " must be at least 1");
      // In 64 bits: SLURM_NTASKS near INT_MAX must not overflow.
      info.local_world_size =
          static_cast<int>((static_cast<int64_t>(info.world_size) + *nodes - 1) / *nodes);
    } else {
      info.local_world_size = info.world_size;
    }
  } else {
    vars = "defaults";
  }
  if (auto run = env("TORCHELASTIC_RUN_ID"); run && *run != "none") {
    info.job_id = *run;
  } else if (auto job = env("SLURM_JOB_ID")) {
    info.job_id = "slurm-" + *job + (env("SLURM_STEP_ID") ? "." + *env("SLURM_STEP_ID") : "");
  } else if (auto ompi = env("OMPI_MCA_ess_base_jobid")) {
    info.job_id = "openmpi-" + *ompi;
  }
  info.attempt = static_cast<int>(env_int(env, "TORCHELASTIC_RESTART_COUNT", 0));
  if (auto token = env("DTRAIN_JOB_TOKEN")) info.token = *token;
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

namespace {

// A socket listening on addr:port only. Throws CommError naming the address and the fix.
int listen_on(const std::string& addr, int port) {
  net::Listener l = net::listen_on(addr, port);
  if (l.fd >= 0) return l.fd;
  if (l.error == EADDRINUSE) {
    DTRAIN_FAIL(CommError, "rendezvous: port ", port, " on ", addr,
                " is already in use (another job, or one that has not ended yet). Choose "
                "another MASTER_PORT, or dtrain-launch --master-port 0 for a free one.");
  }
  if (l.error == EADDRNOTAVAIL) {
    DTRAIN_FAIL(CommError, "rendezvous: MASTER_ADDR ", addr, " is not an address of this machine (",
                l.detail,
                "), and rank 0 serves the store there. Set MASTER_ADDR to rank 0's host.");
  }
  DTRAIN_FAIL(CommError, "rendezvous: cannot listen on ", addr, ":", port, ": ", l.detail);
}

// What a rank says about itself in the handshake, and what the others expect of it.
std::string entry(const RankInfo& i, int rank) {
  std::ostringstream os;
  os << "world=" << i.world_size << "\nattempt=" << i.attempt << "\njob=" << i.job_id << "\nproof="
     << c10::sha1("dtrain-rdzv\n" + i.token + "\n" + i.job_id + "\n" + std::to_string(rank)).str();
  return os.str();
}

std::string field(const std::string& entry, const std::string& name) {
  std::istringstream in(entry);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name + "=", 0) == 0) return line.substr(name.size() + 1);
  }
  return "?";
}

// Empty when `got` (rank `who`'s entry) is what `mine` expects; else what differs.
std::string mismatch(const RankInfo& mine, int who, const std::string& got) {
  const std::string want = entry(mine, who);
  if (got == want) return "";
  std::ostringstream os;
  os << "rank " << who;
  if (field(got, "world") != field(want, "world")) {
    os << " has world size " << field(got, "world") << ", rank " << mine.rank << " has "
       << mine.world_size << " (WORLD_SIZE or the launcher's --nproc-per-node x --nnodes)";
  } else if (field(got, "job") != field(want, "job")) {
    os << " belongs to job '" << field(got, "job") << "', rank " << mine.rank << " to job '"
       << mine.job_id << "' (TORCHELASTIC_RUN_ID / SLURM_JOB_ID): two jobs share "
       << mine.master_addr << ":" << mine.master_port << "; give each its own MASTER_PORT";
  } else if (field(got, "attempt") != field(want, "attempt")) {
    os << " is at restart " << field(got, "attempt") << ", rank " << mine.rank << " at restart "
       << mine.attempt << " (TORCHELASTIC_RESTART_COUNT): the nodes' launchers restarted "
       << "separately; restart the whole job";
  } else {
    os << " presented a different DTRAIN_JOB_TOKEN (or none): set the same token on every rank";
  }
  return os.str();
}

void handshake(c10d::Store& store, const RankInfo& info, std::chrono::milliseconds timeout) {
  const std::string prefix = "dtrain/rdzv/";
  auto key = [&](int r) { return prefix + "rank" + std::to_string(r); };
  auto put = [&](const std::string& k, const std::string& v) {
    store.set(k, std::vector<uint8_t>(v.begin(), v.end()));
  };
  auto get = [&](const std::string& k) {
    auto v = store.get(k);
    return std::string(v.begin(), v.end());
  };
  const std::string where = info.master_addr + ":" + std::to_string(info.master_port);
  if (info.rank == 0) {
    put(key(0), entry(info, 0));
    std::set<int> pending;
    for (int r = 1; r < info.world_size; ++r) pending.insert(r);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::string refused;
    while (!pending.empty() && refused.empty()) {
      for (auto it = pending.begin(); it != pending.end() && refused.empty();) {
        if (!store.check({key(*it)})) {
          ++it;
          continue;
        }
        refused = mismatch(info, *it, get(key(*it)));
        it = pending.erase(it);
      }
      if (!pending.empty() && refused.empty()) {
        if (std::chrono::steady_clock::now() >= deadline) {
          std::ostringstream missing;
          int shown = 0;
          for (int r : pending) missing << (shown++ ? "," : "") << r;
          refused = "ranks [" + missing.str() + "] of " + std::to_string(info.world_size) +
                    " did not join within " + std::to_string(timeout.count() / 1000) +
                    " s. Check that every rank started, with the same MASTER_ADDR/MASTER_PORT";
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
    put(prefix + "verdict", refused.empty() ? "ok" : "refused: " + refused);
    if (!refused.empty()) {
      // The store ends with this rank: give the ranks that joined a moment to read why.
      const int joined = info.world_size - 1 - static_cast<int>(pending.size());
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while (store.add(prefix + "read", 0) < joined && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      DTRAIN_FAIL(CommError, "rendezvous at ", where, " refused: ", refused, ".");
    }
    return;
  }
  put(key(info.rank), entry(info, info.rank));
  // Rank 0 decides within `timeout` of its start; the slack covers the ranks' start skew.
  const auto patience = timeout + std::chrono::seconds(5);
  std::string zero, verdict;
  try {
    store.wait({key(0)}, patience);
    zero = get(key(0));
  } catch (const std::exception& e) {
    DTRAIN_FAIL(CommError, "rendezvous: rank ", info.rank, " found no rank 0 at ", where,
                " within ", patience.count() / 1000, " s (", ::dtrain::detail::clause(e.what()),
                "). Check MASTER_ADDR/MASTER_PORT and that every rank started.");
  }
  std::string wrong = mismatch(info, 0, zero);
  if (!wrong.empty()) store.add(prefix + "read", 1);  // rank 0 need not wait for this rank
  DTRAIN_CHECK_AS(CommError, wrong.empty(), "rendezvous at ", where, " refused: ", wrong, ".");
  try {
    store.wait({prefix + "verdict"}, patience);
    verdict = get(prefix + "verdict");
  } catch (const std::exception& e) {
    DTRAIN_FAIL(CommError, "rendezvous: rank 0 at ", where, " gave no verdict within ",
                patience.count() / 1000, " s (", ::dtrain::detail::clause(e.what()),
                "). Check that every rank started, with the same MASTER_ADDR/MASTER_PORT.");
  }
  store.add(prefix + "read", 1);
  DTRAIN_CHECK_AS(CommError, verdict == "ok", "rendezvous at ", where, " ",
                  verdict.substr(0, 8) == "refused:" ? verdict : "refused: " + verdict, ".");
}

}  // namespace

c10::intrusive_ptr<c10d::Store> make_tcp_store(const RankInfo& info,
                                               std::chrono::milliseconds timeout) {
  // One process has no one to meet: no port (two single-process runs never collide).
  if (info.world_size == 1) return c10::make_intrusive<c10d::HashStore>();
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(info.master_port);
  opts.isServer = info.rank == 0;
  opts.numWorkers = info.world_size;
  opts.waitWorkers = false;  // the handshake waits, and knows who is missing
  opts.timeout = timeout;
  if (opts.isServer) opts.masterListenFd = listen_on(info.master_addr, info.master_port);
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(info.master_addr, opts);
  } catch (const std::exception& e) {
    if (opts.masterListenFd) ::close(*opts.masterListenFd);
    DTRAIN_FAIL(CommError, "rendezvous: rank ", info.rank, " of ", info.world_size, " could not ",
                info.rank == 0 ? "serve" : "reach", " the store at ", info.master_addr, ":",
                info.master_port, " (", info.source, "): ", ::dtrain::detail::clause(e.what()),
                ". Check MASTER_ADDR/MASTER_PORT, that the port is free, and that every rank "
                "started.");
  }
  handshake(*store, info, timeout);
  return store;
}

}  // namespace dtrain::comm
