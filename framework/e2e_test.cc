// End to end: every tiny config in configs/tiny trains through dtrain-launch (2 ranks, Gloo)
// and its loss falls; DDP and FSDP also under mpirun.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <yaml-cpp/yaml.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "tests/flags.h"
#include "tests/subprocess.h"

namespace {

std::string g_launcher, g_trainer;

using Result = dtrain::testing::CommandResult;
using dtrain::testing::run_command;

Result run(const std::string& cmd) { return run_command(cmd); }

std::string tmp(const std::string& name) { return dtrain::testing::scratch_path(name); }

// The step rows of a metrics file; `run` gets its first row, which describes the run.
std::vector<YAML::Node> metrics(const std::string& path, YAML::Node* run = nullptr) {
  std::ifstream f(path);
  std::vector<YAML::Node> rows;
  for (std::string line; std::getline(f, line);) {
    if (line.empty()) continue;
    YAML::Node n = YAML::Load(line);
    if (n["run"]) {
      if (run != nullptr) *run = n["run"];
      continue;
    }
    rows.push_back(n);
  }
  return rows;
}

void expect_loss_falls(const std::string& config, const std::string& launch_prefix) {
  std::string out =
      tmp(config.substr(config.rfind('/') + 1) + launch_prefix.substr(0, 3) + ".jsonl");
  Result r =
      run(launch_prefix + " " + g_trainer + " --config " + config +
          " --set train.steps=30 --set logging.every_steps=5 --set logging.metrics_file=" + out);
  ASSERT_EQ(r.code, 0) << r.output;
  YAML::Node run_row;
  auto rows = metrics(out, &run_row);
  ASSERT_GE(rows.size(), 3u) << r.output;
  ASSERT_TRUE(run_row) << "no run row in " << out;
  EXPECT_EQ(run_row["ranks"].as<int>(), 2);
  EXPECT_EQ(run_row["config"].as<std::string>(), config);
  double first = rows.front()["loss"].as<double>(), last = rows.back()["loss"].as<double>();
  EXPECT_LT(last, first * 0.85) << config << ": loss " << first << " -> " << last << "\n"
                                << r.output;
  EXPECT_EQ(rows.back()["step"].as<int>(), 30);
  // Synchronization really happened: every rank ends with bitwise the same parameters (a
  // falling loss alone would also pass with it silently off).
  EXPECT_NE(r.output.find("parameters identical on all 2 rank(s)"), std::string::npos) << r.output;
  EXPECT_GT(rows.back()["tokens_per_s"].as<double>(), 0);
}

std::string launch(int n) {
  return g_launcher + " --nproc-per-node " + std::to_string(n) + " --master-port 0 --";
}

TEST(EndToEnd, DdpFp32ConfigTrainsThroughTheLauncher) {
  expect_loss_falls("configs/tiny/ddp_fp32.yaml", launch(2));
}

TEST(EndToEnd, DdpBf16ConfigTrainsThroughTheLauncher) {
  expect_loss_falls("configs/tiny/ddp_bf16.yaml", launch(2));
}

TEST(EndToEnd, DdpFp16ConfigTrainsThroughTheLauncher) {
  expect_loss_falls("configs/tiny/ddp_fp16.yaml", launch(2));
}

// Under ASan, OpenMPI's leaks are suppressed by library, which needs whole allocation stacks:
// ranks under mpirun unwind fully (tests/run_ranks.sh does the same).
const char* const kMpirun =
    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 "
    "ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:fast_unwind_on_malloc=0} "
    "mpirun -np 2 --oversubscribe --bind-to none";

TEST(EndToEnd, DdpConfigTrainsUnderMpirun) {
  expect_loss_falls("configs/tiny/ddp_bf16.yaml", kMpirun);
}

TEST(EndToEnd, FsdpFp32ConfigTrainsThroughTheLauncher) {
  expect_loss_falls("configs/tiny/fsdp_fp32.yaml", launch(2));
}

TEST(EndToEnd, FsdpBf16ConfigTrainsThroughTheLauncher) {
  expect_loss_falls("configs/tiny/fsdp_bf16.yaml", launch(2));
}

TEST(EndToEnd, FsdpFp16ConfigTrainsThroughTheLauncher) {
  expect_loss_falls("configs/tiny/fsdp_fp16.yaml", launch(2));
}

TEST(EndToEnd, FsdpConfigTrainsUnderMpirun) {
  expect_loss_falls("configs/tiny/fsdp_bf16.yaml", kMpirun);
}

// The run's per-step losses (as printed in the metrics file) and its final parameters' digest.
std::pair<std::vector<std::string>, std::string> trajectory(const std::string& config,
                                                            const std::string& extra,
                                                            const std::string& name,
                                                            std::string* output = nullptr) {
  const std::string out = tmp(name + ".jsonl");
  std::remove(out.c_str());
  Result r =
      run(launch(2) + " " + g_trainer + " --config " + config +
          " --set train.steps=3 --set logging.every_steps=1 --set logging.metrics_file=" + out +
          " " + extra);
  EXPECT_EQ(r.code, 0) << r.output;
  if (output != nullptr) *output = r.output;
  std::vector<std::string> losses;
  for (const auto& row : metrics(out)) losses.push_back(row["loss"].Scalar());
  const std::string key = "parameters identical on all 2 rank(s) (xxh64 ";
  const size_t at = r.output.find(key);
  EXPECT_NE(at, std::string::npos) << r.output;
  return {losses, at == std::string::npos ? "" : r.output.substr(at + key.size(), 16)};
}

// Activation recompute changes what is kept for backward, never a gradient: every strategy
// and precision (2 ranks, 2 micro-batches each, so no_sync accumulation too) gives bitwise
// the run without it, with every block and with every 2nd block recomputed.
struct RecomputeCase {
  std::string config, extra;
};

void expect_recompute_changes_nothing(const std::vector<RecomputeCase>& cases,
                                      const std::string& tag) {
  int i = 0;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.config + " " + c.extra);
    const std::string name = tag + std::to_string(i++);
    // The tiny model has 2 blocks: every_n 2 recomputes the first only.
    const std::string recompute =
        i % 2 == 0 ? "--set model.recompute=full" : "--set 'model.recompute={every_n: 2}'";
    const auto plain = trajectory(c.config, c.extra, name + "a");
    const auto again = trajectory(c.config, c.extra + " " + recompute, name + "b");
    ASSERT_EQ(plain.first.size(), 3u);
    EXPECT_EQ(plain.first, again.first) << recompute;
    EXPECT_FALSE(plain.second.empty());
    EXPECT_EQ(plain.second, again.second) << recompute << ": the final parameters differ";
  }
}

TEST(EndToEnd, RecomputeLeavesDdpAndFullShardBitwiseTheSame) {
  expect_recompute_changes_nothing(
      {{"configs/tiny/ddp_fp32.yaml", ""},
       {"configs/tiny/ddp_bf16.yaml", ""},
       {"configs/tiny/fsdp_fp32.yaml", "--set parallel.sharding_strategy=full_shard"},
       {"configs/tiny/fsdp_bf16.yaml", "--set parallel.sharding_strategy=full_shard"}},
      "recompute_a");
}

// CMake's sanitized ctest run leaves this one out (Bazel runs it): the same code paths as
// above, and fp16 with the GradScaler (DDP) and the ShardedGradScaler (FSDP).
TEST(EndToEnd, RecomputeLeavesTheOtherStrategiesAndFp16BitwiseTheSame) {
  const std::string hybrid =
      "--set parallel.sharding_strategy=hybrid_shard --set parallel.hybrid_group_size=1";
  expect_recompute_changes_nothing(
      {{"configs/tiny/fsdp_fp32.yaml", "--set parallel.sharding_strategy=shard_grad_op"},
       {"configs/tiny/fsdp_bf16.yaml", "--set parallel.sharding_strategy=shard_grad_op"},
       {"configs/tiny/fsdp_fp32.yaml", "--set parallel.sharding_strategy=no_shard"},
       {"configs/tiny/fsdp_bf16.yaml", "--set parallel.sharding_strategy=no_shard"},
       {"configs/tiny/fsdp_fp32.yaml", hybrid},
       {"configs/tiny/fsdp_bf16.yaml", hybrid},
       {"configs/tiny/ddp_fp16.yaml", ""},
       {"configs/tiny/fsdp_fp16.yaml", ""}},
      "recompute_b");
}

// The optimizer in backward (train.optimizer_in_backward) steps each FSDP unit as its gradients
// are reduced: each strategy, in fp32 or bf16, 2 micro-batches, trains bitwise as the step
// after backward, with the same logged gradient norms (the tiny configs clip; neither run does
// here). The trainer's wiring is what this adds: fsdp_test and zoo_test compare every strategy
// in every pattern at the library.
TEST(EndToEnd, TheOptimizerInBackwardTrainsBitwiseAsTheStepAfterBackward) {
  int i = 0;
  const std::pair<std::string, std::string> cases[] = {
      {"configs/tiny/fsdp_bf16.yaml", "full_shard"},
      {"configs/tiny/fsdp_fp32.yaml", "shard_grad_op"},
      {"configs/tiny/fsdp_bf16.yaml", "no_shard"}};
  for (const auto& [config, strategy] : cases) {
    SCOPED_TRACE(config + " " + strategy);
    const std::string extra =
        "--set train.clip_grad_norm=0 --set parallel.sharding_strategy=" + strategy;
    const std::string name = "in_backward" + std::to_string(i++);
    const auto after = trajectory(config, extra, name + "a");
    std::string log;
    const auto during =
        trajectory(config, extra + " --set train.optimizer_in_backward=true", name + "b", &log);
    EXPECT_NE(log.find("steps each FSDP unit in backward"), std::string::npos) << log;
    ASSERT_EQ(after.first.size(), 3u);
    EXPECT_EQ(after.first, during.first) << "losses";
    EXPECT_FALSE(after.second.empty());
    EXPECT_EQ(after.second, during.second) << "the final parameters differ";
    std::vector<std::string> norms[2];
    for (int k = 0; k < 2; ++k) {
      for (const auto& row : metrics(tmp(name + (k == 0 ? "a" : "b") + ".jsonl"))) {
        norms[k].push_back(row["grad_norm"].Scalar());
      }
    }
    EXPECT_EQ(norms[0], norms[1]) << "the logged gradient norms";
    EXPECT_NE(norms[0].front(), "0") << "the gradient norm was not measured";
  }
}

// Token files hold what a corpus holds: the GPL-3 text's bytes as uint16 tokens, in a .bin
// and in an .npy (as numpy.save writes it), train bitwise the run on the text itself.
TEST(EndToEnd, TokenFilesOfACorpusTrainBitwiseAsTheCorpus) {
  std::ifstream text("/usr/share/common-licenses/GPL-3", std::ios::binary);
  std::vector<uint16_t> tokens;
  for (int c; (c = text.get()) != EOF;) tokens.push_back(static_cast<uint16_t>(c));
  ASSERT_GT(tokens.size(), 30000u);
  const std::string bin = tmp("gpl3.bin"), npy = tmp("gpl3.npy");
  {
    std::ofstream f(bin, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
    std::string dict = "{'descr': '<u2', 'fortran_order': False, 'shape': (" +
                       std::to_string(tokens.size()) + ",), }";
    while ((10 + dict.size() + 1) % 64 != 0) dict += ' ';
    dict += '\n';
    std::ofstream g(npy, std::ios::binary | std::ios::trunc);
    g.write("\x93NUMPY\x01\x00", 8);
    const uint16_t len = static_cast<uint16_t>(dict.size());
    g.write(reinterpret_cast<const char*>(&len), 2);
    g << dict;
    g.write(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  }
  const auto corpus = trajectory("configs/tiny/ddp_fp32.yaml", "", "tokens_corpus");
  ASSERT_EQ(corpus.first.size(), 3u);
  for (const std::string& path : {bin, npy}) {
    SCOPED_TRACE(path);
    // A .bin file records no token type (no meta.json here): data.dtype says it.
    const auto got = trajectory("configs/tiny/ddp_fp32.yaml",
                                "--set data.source=tokens --set data.path=" + path +
                                    (path == bin ? " --set data.dtype=uint16" : ""),
                                "tokens_file");
    EXPECT_EQ(got.first, corpus.first);
    EXPECT_EQ(got.second, corpus.second) << "the final parameters differ";
  }
}

TEST(EndToEnd, EstimatePrintsTheMemoryPerRankAndTrainsNothing) {
  const std::string out = tmp("estimate.jsonl");
  std::remove(out.c_str());
  Result r = run(g_trainer +
                 " --config configs/tiny/fsdp_bf16.yaml --estimate --ranks 4 --ranks-per-node 2 "
                 "--set logging.metrics_file=" +
                 out);
  EXPECT_EQ(r.code, 0) << r.output;
  for (const char* needle : {"strategy fsdp full_shard, precision bf16, 4 rank(s), 2 on this node",
                             "per rank:", "optimizer state", "with model.recompute: full",
                             "this node: 2 rank(s) x", "deepest of this width that fits"}) {
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
  }
  EXPECT_EQ(r.output.find("step 1"), std::string::npos) << r.output;
  EXPECT_FALSE(std::ifstream(out).good()) << "--estimate trained";
  r = run(g_trainer + " --config configs/tiny/fsdp_bf16.yaml --estimate --set model.recompute=yes");
  EXPECT_EQ(r.code, 2) << r.output;
}

TEST(EndToEnd, FsdpOnlyPrecisionFieldsAreRefusedUnderDdp) {
  Result r =
      run(g_trainer + " --config configs/tiny/ddp_bf16.yaml --set precision.output_dtype=fp32");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("precision.output_dtype: output_dtype is an FSDP setting"),
            std::string::npos)
      << r.output;
}

TEST(EndToEnd, BadConfigExitsTwoNamingTheKey) {
  Result r = run(g_trainer + " --config configs/tiny/ddp_fp32.yaml --set train.stepz=3");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("train.stepz: unknown key; did you mean 'steps'?"), std::string::npos)
      << r.output;
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  g_launcher = dtrain::testing::flag_value(argc, argv, "launcher");
  g_trainer = dtrain::testing::flag_value(argc, argv, "trainer");
  if (g_launcher.empty() || g_trainer.empty()) {
    std::fprintf(stderr, "usage: e2e_test --launcher=PATH --trainer=PATH\n");
    return 2;
  }
  return RUN_ALL_TESTS();
}
