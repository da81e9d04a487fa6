#include "comm/rendezvous.h"

#include <c10/util/hash.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
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
    info.local_given = env("LOCAL_WORLD_SIZE").has_value();
    info.local_vars = "LOCAL_RANK/LOCAL_WORLD_SIZE";
  } else if (env("OMPI_COMM_WORLD_RANK") && env("OMPI_COMM_WORLD_SIZE")) {
    info.source = "openmpi";
    vars = "OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE";
    info.rank = *get_int(env, "OMPI_COMM_WORLD_RANK");
    info.world_size = *get_int(env, "OMPI_COMM_WORLD_SIZE");
    info.local_rank = get_int(env, "OMPI_COMM_WORLD_LOCAL_RANK").value_or(info.rank);
    info.local_world_size = get_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE").value_or(info.world_size);
    info.local_given = env("OMPI_COMM_WORLD_LOCAL_SIZE").has_value();
    info.local_vars = "OMPI_COMM_WORLD_LOCAL_RANK/LOCAL_SIZE";
  } else if (env("PMI_RANK") && env("PMI_SIZE")) {
    // MPICH's and Intel MPI's Hydra; under Slurm its ranks also see SLURM_PROCID, which
    // numbers Hydra's proxies, not the ranks.
    info.source = "mpich";
    vars = "PMI_RANK/PMI_SIZE/MPI_LOCALRANKID/MPI_LOCALNRANKS";
    info.rank = *get_int(env, "PMI_RANK");
    info.world_size = *get_int(env, "PMI_SIZE");
    info.local_rank = get_int(env, "MPI_LOCALRANKID").value_or(info.rank);
    info.local_world_size = get_int(env, "MPI_LOCALNRANKS").value_or(info.world_size);
    info.local_given = env("MPI_LOCALNRANKS").has_value();
    info.local_vars = "MPI_LOCALRANKID/MPI_LOCALNRANKS";
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    info.source = "slurm";
    vars = "SLURM_PROCID/NTASKS/LOCALID/NTASKS_PER_NODE";
    info.rank = *get_int(env, "SLURM_PROCID");
    info.world_size = *get_int(env, "SLURM_NTASKS");
    info.local_rank = get_int(env, "SLURM_LOCALID").value_or(0);
    info.local_vars = "SLURM_LOCALID/SLURM_NTASKS_PER_NODE";
    if (auto per_node = get_int(env, "SLURM_NTASKS_PER_NODE")) {
      info.local_world_size = *per_node;
      info.local_given = true;
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
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  info.host = host[0] != 0 ? host : "localhost";
  info.node_key = info.host;
  if (auto group = env("GROUP_RANK"); group && !group->empty()) info.node_key += "#" + *group;
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

// What a rank says about where it runs, after its entry: its node, the local rank and size
// its environment gave ("-" when none), and the address it reaches rank 0 from.
std::string whereabouts(const RankInfo& i) {
  std::ostringstream os;
  os << "\nnode=" << i.node_key << "\nlocal=";
  if (i.local_given) {
    os << i.local_rank << "/" << i.local_world_size;
  } else {
    os << "-";
  }
  os << "\nvia=" << (i.rank == 0 ? std::string() : net::local_address_toward(i.master_addr));
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

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::istringstream in(text);
  std::string item;
  while (std::getline(in, item, sep)) out.push_back(item);
  return out;
}

// Empty when `got` (rank `who`'s entry) is what `mine` expects; else what differs.
std::string mismatch(const RankInfo& mine, int who, const std::string& got) {
  const std::string want = entry(mine, who);
  bool same = true;
  for (const char* name : {"world", "attempt", "job", "proof"}) {
    same = same && field(got, name) == field(want, name);
  }
  if (same) return "";
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

// Rank 0's view of every admitted rank's whereabouts: the layout, as the verdict carries it
// ("nodes=a b\naddresses=- 10.0.0.2\nnode_of=0,0,1,1"), or why it is refused: a local rank
// or size the environment gave that the layout contradicts.
std::string layout(const RankInfo& zero, const std::vector<std::string>& entries,
                   std::string* refused) {
  std::vector<std::string> names, addresses;
  std::vector<int> node_of;
  for (const auto& e : entries) {
    const std::string key = field(e, "node");
    auto it = std::find(names.begin(), names.end(), key);
    if (it == names.end()) {
      names.push_back(key);
      addresses.push_back(field(e, "via"));
      it = names.end() - 1;
    }
    node_of.push_back(static_cast<int>(it - names.begin()));
  }
  for (size_t r = 0; r < entries.size() && refused->empty(); ++r) {
    const std::string claim = field(entries[r], "local");
    if (claim == "-" || claim == "?") continue;
    std::vector<int> peers;
    for (size_t q = 0; q < entries.size(); ++q) {
      if (node_of[q] == node_of[r]) peers.push_back(static_cast<int>(q));
    }
    const int index = static_cast<int>(std::find(peers.begin(), peers.end(), r) - peers.begin());
    const std::string learned = std::to_string(index) + "/" + std::to_string(peers.size());
    if (claim == learned) continue;
    std::ostringstream os;
    const auto said = split(claim, '/');
    os << "rank " << r << "'s environment (" << zero.local_vars << ") says local rank "
       << said.front() << " of " << said.back() << ", but the ranks that met from its node '"
       << names[node_of[r]] << "' are [";
    for (size_t i = 0; i < peers.size(); ++i) os << (i ? "," : "") << peers[i];
    os << "] (local rank " << index << " of " << peers.size()
       << "). Check the ranks per node the launcher was given on that node";
    *refused = os.str();
  }
  std::ostringstream os;
  os << "nodes=";
  for (size_t i = 0; i < names.size(); ++i) os << (i ? " " : "") << names[i];
  os << "\naddresses=";
  for (size_t i = 0; i < addresses.size(); ++i) {
    os << (i ? " " : "") << (addresses[i].empty() ? "-" : addresses[i]);
  }
  os << "\nnode_of=";
  for (size_t i = 0; i < node_of.size(); ++i) os << (i ? "," : "") << node_of[i];
  return os.str();
}

// The layout in a verdict, into `info` (see make_tcp_store).
void learn_layout(const std::string& verdict, RankInfo& info) {
  info.node_names = split(field(verdict, "nodes"), ' ');
  info.node_addresses.clear();
  for (const auto& a : split(field(verdict, "addresses"), ' ')) {
    info.node_addresses.push_back(a == "-" ? std::string() : a);
  }
  info.node_of.clear();
  for (const auto& n : split(field(verdict, "node_of"), ',')) info.node_of.push_back(std::stoi(n));
  DTRAIN_CHECK_AS(CommError, static_cast<int>(info.node_of.size()) == info.world_size,
                  "rendezvous: rank 0's layout names ", info.node_of.size(), " ranks, not ",
                  info.world_size);
  const int mine = info.node_of[info.rank];
  info.local_world_size = 0;
  info.local_rank = 0;
  for (int r = 0; r < info.world_size; ++r) {
    if (info.node_of[r] != mine) continue;
    if (r < info.rank) ++info.local_rank;
    ++info.local_world_size;
  }
}

void handshake(c10d::Store& store, RankInfo& info, std::chrono::milliseconds timeout) {
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
    std::vector<std::string> entries(static_cast<size_t>(info.world_size));
    entries[0] = entry(info, 0) + whereabouts(info);
    put(key(0), entries[0]);
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
        entries[*it] = get(key(*it));
        refused = mismatch(info, *it, entries[*it]);
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
    std::string nodes;
    if (refused.empty()) nodes = layout(info, entries, &refused);
    const std::string verdict = refused.empty() ? "ok\n" + nodes : "refused: " + refused;
    put(prefix + "verdict", verdict);
    if (!refused.empty()) {
      // The store ends with this rank: give the ranks that joined a moment to read why.
      const int joined = info.world_size - 1 - static_cast<int>(pending.size());
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while (store.add(prefix + "read", 0) < joined && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      DTRAIN_FAIL(CommError, "rendezvous at ", where, " refused: ", refused, ".");
    }
    learn_layout(verdict, info);
    return;
  }
  put(key(info.rank), entry(info, info.rank) + whereabouts(info));
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
  DTRAIN_CHECK_AS(CommError, verdict.rfind("ok\n", 0) == 0, "rendezvous at ", where, " ",
                  verdict.substr(0, 8) == "refused:" ? verdict : "refused: " + verdict, ".");
  learn_layout(verdict, info);
}

}  // namespace

c10::intrusive_ptr<c10d::Store> make_tcp_store(RankInfo& info, std::chrono::milliseconds timeout) {
  // One process has no one to meet: no port (two single-process runs never collide).
  if (info.world_size == 1) {
    info.node_of = {0};
    info.node_names = {info.node_key};
    info.node_addresses = {""};
    return c10::make_intrusive<c10d::HashStore>();
  }
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(info.master_port);
  opts.isServer = info.rank == 0;
  opts.numWorkers = info.world_size;
  opts.waitWorkers = false;  // the handshake waits, and knows who is missing
  opts.timeout = timeout;
  if (opts.isServer) {
    std::string why;
    const std::string bind = net::store_bind_address(info.master_addr, &why);
    if (bind != info.master_addr) {
      info.store_note = "rendezvous: the store listens on " + bind + ":" +
                        std::to_string(info.master_port) + " (" + why +
                        "); the job token admits only this job's ranks";
    }
    opts.masterListenFd = listen_on(bind, info.master_port);
  }
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

std::string gloo_address(const RankInfo& info) {
  const bool one_node =
      std::all_of(info.node_of.begin(), info.node_of.end(), [](int n) { return n == 0; });
  if (one_node) return "127.0.0.1";
  if (std::getenv("GLOO_SOCKET_IFNAME") != nullptr) return "";
  if (!net::resolves_to_loopback(info.host)) return "";
  // Rank 0's node: the address that routes to the next node's; the others: the one that
  // routes to MASTER_ADDR.
  const int mine = info.node_of.empty() ? 0 : info.node_of[info.rank];
  std::string toward = info.master_addr;
  if (mine == 0 && info.node_addresses.size() > 1) toward = info.node_addresses[1];
  const std::string address = net::local_address_toward(toward);
  DTRAIN_CHECK_AS(CommError, !address.empty() && !net::is_loopback_literal(address),
                  "gloo: this host's name ('", info.host,
                  "') resolves to a loopback address, and no route leads from here to ", toward,
                  ": set GLOO_SOCKET_IFNAME to the interface the nodes share");
  return address;
}

}  // namespace dtrain::comm
