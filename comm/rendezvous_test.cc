#include "comm/rendezvous.h"

#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <sstream>
#include <thread>

#include "comm/factory.h"
#include "core/error.h"

namespace dtrain::comm {
namespace {

EnvLookup fake(std::map<std::string, std::string> vars) {
  return [vars](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

TEST(Rendezvous, SingleProcessByDefault) {
  RankInfo i = detect_rank_info({}, fake({}));
  EXPECT_EQ(i.rank, 0);
  EXPECT_EQ(i.world_size, 1);
  EXPECT_EQ(i.master_addr, "127.0.0.1");
  EXPECT_EQ(i.master_port, 29500);
  EXPECT_FALSE(i.mpi_launched);
}

TEST(Rendezvous, TorchrunVariables) {
  RankInfo i = detect_rank_info({}, fake({{"RANK", "5"},
                                          {"WORLD_SIZE", "8"},
                                          {"LOCAL_RANK", "1"},
                                          {"LOCAL_WORLD_SIZE", "4"},
                                          {"MASTER_ADDR", "10.1.2.3"},
                                          {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(i.source, "torchrun");
  EXPECT_EQ(i.rank, 5);
  EXPECT_EQ(i.world_size, 8);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.local_world_size, 4);
  EXPECT_EQ(i.master_addr, "10.1.2.3");
  EXPECT_EQ(i.master_port, 1234);
}

TEST(Rendezvous, OpenMpiVariables) {
  RankInfo i = detect_rank_info({}, fake({{"OMPI_COMM_WORLD_RANK", "3"},
                                          {"OMPI_COMM_WORLD_SIZE", "4"},
                                          {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                          {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}));
  EXPECT_EQ(i.source, "openmpi");
  EXPECT_EQ(i.rank, 3);
  EXPECT_EQ(i.world_size, 4);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.local_world_size, 2);
  EXPECT_TRUE(i.mpi_launched);
}

TEST(Rendezvous, SlurmVariables) {
  RankInfo i = detect_rank_info({}, fake({{"SLURM_PROCID", "6"},
                                          {"SLURM_NTASKS", "8"},
                                          {"SLURM_LOCALID", "2"},
                                          {"SLURM_NTASKS_PER_NODE", "4"}}));
  EXPECT_EQ(i.source, "slurm");
  EXPECT_EQ(i.rank, 6);
  EXPECT_EQ(i.world_size, 8);
  EXPECT_EQ(i.local_rank, 2);
  EXPECT_EQ(i.local_world_size, 4);
  RankInfo j = detect_rank_info(
      {}, fake({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "6"}, {"SLURM_NNODES", "3"}}));
  EXPECT_EQ(j.local_world_size, 2);
  EXPECT_EQ(j.local_rank, 0);
}

// MPICH's and Intel MPI's Hydra. Under a Slurm allocation its ranks also see Slurm's
// variables, which number Hydra's proxies (one per node), not the ranks: PMI's win.
TEST(Rendezvous, HydraVariablesWinOverSlurms) {
  RankInfo i = detect_rank_info({}, fake({{"PMI_RANK", "3"},
                                          {"PMI_SIZE", "4"},
                                          {"MPI_LOCALRANKID", "1"},
                                          {"MPI_LOCALNRANKS", "2"},
                                          {"SLURM_PROCID", "1"},
                                          {"SLURM_NTASKS", "2"}}));
  EXPECT_EQ(i.source, "mpich");
  EXPECT_EQ(i.rank, 3);
  EXPECT_EQ(i.world_size, 4);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.local_world_size, 2);
  EXPECT_TRUE(i.local_given);
  EXPECT_TRUE(i.mpi_launched);
}

// Kubeflow's PyTorchJob sets RANK and WORLD_SIZE only: the local rank and size are not taken
// as given (the rendezvous learns them); torchrun's are, and GROUP_RANK tells its nodes apart.
TEST(Rendezvous, WhatTheEnvironmentSaysAboutTheNode) {
  RankInfo job = detect_rank_info(
      {}, fake({{"RANK", "2"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "trainer-master-0"}}));
  EXPECT_EQ(job.source, "torchrun");
  EXPECT_FALSE(job.local_given);
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  EXPECT_EQ(job.node_key, host);
  RankInfo run = detect_rank_info({}, fake({{"RANK", "2"},
                                            {"WORLD_SIZE", "4"},
                                            {"LOCAL_RANK", "0"},
                                            {"LOCAL_WORLD_SIZE", "2"},
                                            {"GROUP_RANK", "1"}}));
  EXPECT_TRUE(run.local_given);
  EXPECT_EQ(run.node_key, std::string(host) + "#1");
  RankInfo slurm = detect_rank_info(
      {}, fake({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_NNODES", "2"}}));
  EXPECT_FALSE(slurm.local_given);  // SLURM_NNODES alone is a guess
}

TEST(Rendezvous, PrecedenceExplicitThenTorchrunThenMpiThenSlurm) {
  auto all = fake({{"RANK", "1"},
                   {"WORLD_SIZE", "2"},
                   {"OMPI_COMM_WORLD_RANK", "3"},
                   {"OMPI_COMM_WORLD_SIZE", "4"},
                   {"SLURM_PROCID", "5"},
                   {"SLURM_NTASKS", "6"}});
  RendezvousOptions explicit_opts;
  explicit_opts.rank = 0;
  explicit_opts.world_size = 1;
  EXPECT_EQ(detect_rank_info(explicit_opts, all).source, "explicit");
  EXPECT_EQ(detect_rank_info({}, all).source, "torchrun");
  EXPECT_EQ(detect_rank_info({}, fake({{"OMPI_COMM_WORLD_RANK", "3"},
                                       {"OMPI_COMM_WORLD_SIZE", "4"},
                                       {"SLURM_PROCID", "5"},
                                       {"SLURM_NTASKS", "6"}}))
                .source,
            "openmpi");
}

TEST(Rendezvous, InconsistentVariablesNameTheirSource) {
  try {
    detect_rank_info({}, fake({{"RANK", "4"}, {"WORLD_SIZE", "4"}}));
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 4 from RANK/WORLD_SIZE"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(detect_rank_info({}, fake({{"RANK", "x"}, {"WORLD_SIZE", "2"}})), ConfigError);
  EXPECT_THROW(
      detect_rank_info({}, fake({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "0"}})),
      ConfigError);
}

// Inputs in fuzz/regressions/fuzz_rendezvous/: values beyond int were truncated (RANK=4294967296
// was rank 0, MASTER_PORT=4294996796 was 29500) and SLURM_NTASKS near INT_MAX overflowed.
TEST(Rendezvous, OutOfRangeValuesAreRefused) {
  EXPECT_THROW(detect_rank_info({}, fake({{"RANK", "4294967296"}, {"WORLD_SIZE", "2"}})),
               ConfigError);
  EXPECT_THROW(detect_rank_info(
                   {}, fake({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "4294996796"}})),
               ConfigError);
  EXPECT_THROW(
      detect_rank_info({}, fake({{"RANK", "0"}, {"WORLD_SIZE", "99999999999999999999999"}})),
      ConfigError);
  EXPECT_THROW(detect_rank_info(
                   {}, fake({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NNODES", "0"}})),
               ConfigError);
  RankInfo i = detect_rank_info(
      {}, fake({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2147483647"}, {"SLURM_NNODES", "2"}}));
  EXPECT_EQ(i.local_world_size, 1073741824);
}

TEST(Backend, AutoPicksNcclForCudaMpiUnderMpirunElseGloo) {
  RankInfo plain;
  RankInfo mpi;
  mpi.mpi_launched = true;
  auto none = fake({});
  EXPECT_EQ(resolve_backend(Backend::kAuto, c10::kCUDA, plain, none), Backend::kNccl);
  EXPECT_EQ(resolve_backend(Backend::kAuto, c10::kCPU, mpi, none), Backend::kMpi);
  EXPECT_EQ(resolve_backend(Backend::kAuto, c10::kCPU, plain, none), Backend::kGloo);
  // DTRAIN_BACKEND (dtrain-launch --backend) replaces auto only.
  auto env = fake({{"DTRAIN_BACKEND", "mpi"}});
  EXPECT_EQ(resolve_backend(Backend::kAuto, c10::kCPU, plain, env), Backend::kMpi);
  EXPECT_EQ(resolve_backend(Backend::kGloo, c10::kCPU, plain, env), Backend::kGloo);
  EXPECT_THROW(parse_backend("tcp"), ConfigError);
}

TEST(Timeout, FromOptionsThenEnvironmentThenDefault) {
  EXPECT_EQ(resolve_timeout(std::chrono::milliseconds(1500), fake({})).count(), 1500);
  EXPECT_EQ(resolve_timeout(std::nullopt, fake({{"DTRAIN_COMM_TIMEOUT_S", "2.5"}})).count(), 2500);
  EXPECT_EQ(resolve_timeout(std::nullopt, fake({})).count(), 300000);
  EXPECT_THROW(resolve_timeout(std::nullopt, fake({{"DTRAIN_COMM_TIMEOUT_S", "-1"}})), ConfigError);
}

// A socket bound to 127.0.0.1:port (0: a free port), or -1 when the port is taken.
int bind_loopback(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// A free TCP port on the loopback.
int free_port() {
  int fd = bind_loopback(0);
  sockaddr_in sa{};
  socklen_t len = sizeof(sa);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  ::close(fd);
  return ntohs(sa.sin_port);
}

RankInfo rank_info(int rank, int world, int port) {
  RankInfo i;
  i.rank = rank;
  i.world_size = world;
  i.master_port = port;
  i.job_id = "job-a";
  i.token = "secret";
  return i;
}

// Runs make_tcp_store for each info on its own thread, as separate processes would; returns
// each rank's error ("" if none). The stores live until every rank is done.
// `learned`, when given, receives each rank's info after the rendezvous (its layout).
std::vector<std::string> join(const std::vector<RankInfo>& infos, int timeout_ms = 3000,
                              std::vector<RankInfo>* learned = nullptr) {
  struct Result {
    c10::intrusive_ptr<c10d::Store> store;
    std::string error;
    RankInfo info;
  };
  std::vector<std::future<Result>> f;
  for (const auto& i : infos) {
    f.push_back(
        std::async(std::launch::async, [info = RankInfo(i), timeout_ms]() mutable -> Result {
          try {
            auto store = make_tcp_store(info, std::chrono::milliseconds(timeout_ms));
            return {store, "", info};
          } catch (const CommError& e) {
            return {{}, e.what(), info};
          }
        }));
  }
  std::vector<Result> results;
  for (auto& x : f) results.push_back(x.get());
  std::vector<std::string> out;
  for (const auto& r : results) {
    out.push_back(r.error);
    if (learned) learned->push_back(r.info);
  }
  return out;
}

// The ranks learn which node each is on from the rendezvous; an environment that says
// otherwise is refused on every rank, naming both.
TEST(RendezvousStore, LearnsTheNodeLayoutAndRefusesAContradiction) {
  int port = free_port();
  std::vector<RankInfo> infos;
  // Node "b" holds ranks 1 and 3: Slurm's cyclic distribution.
  for (const char* node : {"a", "b", "a", "b"}) {
    infos.push_back(rank_info(static_cast<int>(infos.size()), 4, port));
    infos.back().node_key = node;
  }
  std::vector<RankInfo> learned;
  for (const auto& e : join(infos, 3000, &learned)) EXPECT_EQ(e, "");
  ASSERT_EQ(learned.size(), 4u);
  for (const auto& i : learned) {
    EXPECT_EQ(i.node_of, (std::vector<int>{0, 1, 0, 1}));
    EXPECT_EQ(i.node_names, (std::vector<std::string>{"a", "b"}));
    EXPECT_EQ(i.local_world_size, 2);
    // Node "b"'s address is the one its first rank reached rank 0 from (loopback here).
    EXPECT_EQ(i.node_addresses.at(1), "127.0.0.1");
  }
  EXPECT_EQ(learned[2].local_rank, 1);
  EXPECT_EQ(learned[3].local_rank, 1);
  // Rank 3's launcher says it is alone on its node.
  port = free_port();
  for (auto& i : infos) i.master_port = port;
  infos[3].local_given = true;
  infos[3].local_rank = 0;
  infos[3].local_world_size = 1;
  infos[0].local_vars = "LOCAL_RANK/LOCAL_WORLD_SIZE";
  for (const auto& e : join(infos)) {
    EXPECT_NE(e.find("rank 3's environment (LOCAL_RANK/LOCAL_WORLD_SIZE) says local rank 0 of 1, "
                     "but the ranks that met from its node 'b' are [1,3] (local rank 1 of 2)"),
              std::string::npos)
        << e;
  }
}

TEST(RendezvousStore, AdmitsTheRanksOfOneJob) {
  int port = free_port();
  auto errors = join({rank_info(0, 3, port), rank_info(1, 3, port), rank_info(2, 3, port)});
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

// Each way a process can belong to another job is refused on both sides, naming what differs.
TEST(RendezvousStore, RefusesARankOfAnotherJobOnEverySide) {
  struct Case {
    const char* what;
    std::function<void(RankInfo&)> change;  // applied to rank 1
    std::string needle;
  };
  for (const auto& c : std::vector<Case>{
           {"world size", [](RankInfo& i) { i.world_size = 3; }, "has world size"},
           {"job id", [](RankInfo& i) { i.job_id = "job-b"; }, "belongs to job"},
           {"restart attempt", [](RankInfo& i) { i.attempt = 1; }, "at restart"},
           {"token", [](RankInfo& i) { i.token = "guess"; }, "different DTRAIN_JOB_TOKEN"},
           {"no token", [](RankInfo& i) { i.token.clear(); }, "different DTRAIN_JOB_TOKEN"},
       }) {
    SCOPED_TRACE(c.what);
    int port = free_port();
    RankInfo one = rank_info(1, 2, port);
    c.change(one);
    auto errors = join({rank_info(0, 2, port), one});
    for (const auto& e : errors) {
      EXPECT_NE(e.find("refused"), std::string::npos) << e;
      EXPECT_NE(e.find(c.needle), std::string::npos) << e;
    }
  }
}

TEST(RendezvousStore, NamesTheRanksThatNeverJoined) {
  int port = free_port();
  auto errors = join({rank_info(0, 3, port), rank_info(1, 3, port)}, 1500);
  EXPECT_NE(errors[0].find("ranks [2] of 3 did not join within 1 s"), std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("refused: ranks [2] of 3 did not join"), std::string::npos) << errors[1];
}

// The store listens on MASTER_ADDR only: the kernel's table of listening sockets shows it
// bound to 127.0.0.1, not 0.0.0.0 or ::.
TEST(RendezvousStore, ListensOnTheMasterAddressOnly) {
  int port = free_port();
  // Rank 0 serves and waits for rank 1; the socket table is read meanwhile.
  auto zero = std::async(std::launch::async, [&] {
    return make_tcp_store(rank_info(0, 2, port), std::chrono::milliseconds(5000));
  });
  std::vector<std::string> listening;  // local addresses of sockets on `port` in LISTEN
  for (int attempt = 0; attempt < 200 && listening.empty(); ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
      std::ifstream f(table);
      std::string line;
      std::getline(f, line);  // header
      while (std::getline(f, line)) {
        std::istringstream in(line);
        std::string slot, local, remote, state;
        in >> slot >> local >> remote >> state;
        auto colon = local.rfind(':');
        if (state == "0A" && std::stoi(local.substr(colon + 1), nullptr, 16) == port) {
          listening.push_back(local.substr(0, colon));
        }
      }
    }
  }
  auto one = make_tcp_store(rank_info(1, 2, port), std::chrono::milliseconds(5000));
  auto store = zero.get();
  ASSERT_FALSE(listening.empty()) << "no listening socket on port " << port;
  for (const auto& a : listening) EXPECT_EQ(a, "0100007F") << "the store listens on " << a;
}

TEST(RendezvousStore, ASingleProcessOpensNoPort) {
  int port = free_port();
  auto store = make_tcp_store(rank_info(0, 1, port), std::chrono::milliseconds(1000));
  store->set("k", std::vector<uint8_t>{1});
  EXPECT_EQ(store->get("k"), std::vector<uint8_t>{1});
  // The port is still free: binding it succeeds.
  int fd = bind_loopback(port);
  EXPECT_GE(fd, 0);
  ::close(fd);
}

TEST(RendezvousStore, APortInUseIsNamedWithTheFix) {
  int port = free_port();
  int fd = bind_loopback(port);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  auto errors = join({rank_info(0, 2, port)});
  ::close(fd);
  EXPECT_NE(errors[0].find("port " + std::to_string(port) + " on 127.0.0.1 is already in use"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[0].find("--master-port 0"), std::string::npos) << errors[0];
}

TEST(Rendezvous, JobIdAttemptAndTokenComeFromTheLauncherSlurmOrMpirun) {
  RankInfo l = detect_rank_info({}, fake({{"RANK", "0"},
                                          {"WORLD_SIZE", "2"},
                                          {"TORCHELASTIC_RUN_ID", "abc"},
                                          {"TORCHELASTIC_RESTART_COUNT", "2"},
                                          {"DTRAIN_JOB_TOKEN", "t"}}));
  EXPECT_EQ(l.job_id, "abc");
  EXPECT_EQ(l.attempt, 2);
  EXPECT_EQ(l.token, "t");
  EXPECT_EQ(detect_rank_info({}, fake({{"SLURM_PROCID", "0"},
                                       {"SLURM_NTASKS", "2"},
                                       {"SLURM_JOB_ID", "77"},
                                       {"SLURM_STEP_ID", "3"}}))
                .job_id,
            "slurm-77.3");
  EXPECT_EQ(detect_rank_info({}, fake({})).job_id, "none");
}

}  // namespace
}  // namespace dtrain::comm
