#include "comm/rendezvous.h"

#include <gtest/gtest.h>

#include <map>

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

}  // namespace
}  // namespace dtrain::comm
