// train.spike_guard, judged in one process and end to end through dtrain-launch and
// dtrain-train on two ranks:
//   - the judging: the running median, a spike after `steps` steps in a row (once per run of
//     them), a step the loss scaler skipped left alone, a non-finite loss a spike step; the
//     data steps a training step reads once batches are skipped;
//   - rollback: batches that make the loss spike (DTRAIN_TEST_BAD_BATCHES, x1000 or NaN) roll
//     the run back to the checkpoint before them, a checkpoint due inside the spike waits, and
//     the rest of the run equals, bit for bit (losses at every step, final parameters), a run
//     that never saw those batches (DTRAIN_TEST_SKIP_BATCHES); DDP and FSDP, synchronous and
//     asynchronous checkpoints, and a run killed after the rollback and resumed;
//   - a run that keeps spiking stops, naming the spikes' steps;
//   - warn (the default): a diverging run (train.lr 5) says so.
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "framework/config.h"
#include "framework/guards.h"
#include "tests/flags.h"
#include "tests/subprocess.h"

namespace dtrain::framework {
namespace {

namespace fs = std::filesystem;

std::string g_launcher, g_trainer;

using Result = dtrain::testing::CommandResult;
using dtrain::testing::final_checksum;
using dtrain::testing::run_command;

// --- the judging, one process ------------------------------------------------------------

SpikeGuardConfig guard_config(SpikeAction action) {
  SpikeGuardConfig c;
  c.action = action;
  c.factor = 2.0;
  c.steps = 2;
  c.window = 6;
  return c;
}

TEST(SpikeGuardJudging, TwoStepsInARowAboveTwiceTheMedianAreOneSpike) {
  const SpikeGuardConfig c = guard_config(SpikeAction::kWarn);
  SpikeGuard g(c);
  // Five steps make the history (median 4); then one step above (a streak of one, cleared),
  // then two in a row: a spike over steps 8-9, named once although step 10 is above too.
  auto found =
      g.after_steps(1, {5, 4, 3, 4, 6, 9, 4, 8.5, 9, 20}, std::vector<bool>(10, true), nullptr);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].first, 8);
  EXPECT_EQ(found[0].last, 9);
  EXPECT_EQ(found[0].loss, 9);
  EXPECT_EQ(found[0].median, 4);  // of {5, 4, 3, 4, 6, 4}: 4
  EXPECT_TRUE(g.in_streak());
  EXPECT_EQ(g.record().streak, 3);
  // The history holds the last `window` steps that were not spike steps; step 6 (9 > 2 x 4)
  // was a spike step and is not in it.
  std::vector<int64_t> steps;
  for (const auto& h : g.record().history) steps.push_back(h.first);
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4, 5, 7}));
  // A step back under the threshold ends the run of spike steps.
  EXPECT_TRUE(g.after_steps(11, {4}, {true}, nullptr).empty());
  EXPECT_FALSE(g.in_streak());
}

TEST(SpikeGuardJudging, NothingIsJudgedBeforeTheHistoryHoldsFiveSteps) {
  const SpikeGuardConfig c = guard_config(SpikeAction::kRollback);
  SpikeGuard g(c);
  EXPECT_TRUE(g.after_steps(1, {1, 100, 1000, 1e4}, std::vector<bool>(4, true), nullptr).empty());
}

TEST(SpikeGuardJudging, ANonFiniteLossIsASpikeStepUnlessTheScalerSkippedIt) {
  const SpikeGuardConfig c = guard_config(SpikeAction::kRollback);
  SpikeGuard g(c);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  // Steps 3 and 4: skipped by the scaler, not judged. Steps 5-6: stepped with a NaN and an
  // inf loss, a spike (no history needed for a loss that is not finite).
  auto found = g.after_steps(1, {2, 2, nan, inf, nan, inf, 2},
                             {true, true, false, false, true, true, true}, nullptr);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].first, 5);
  EXPECT_EQ(found[0].last, 6);
  // Under rollback the judging stops at the spike: step 7 is rolled back with it.
  EXPECT_EQ(g.record().history.size(), 2u);
}

TEST(SpikeGuardJudging, SkippedBatchesShiftTheDataStepsInOrder) {
  const SpikeGuardConfig c = guard_config(SpikeAction::kRollback);
  SpikeGuard g(c);
  g.skip_batches(3, 2);  // data steps 3 and 4 (0-based)
  std::vector<int64_t> got;
  for (int64_t s = 0; s < 6; ++s) got.push_back(g.data_step(s));
  EXPECT_EQ(got, (std::vector<int64_t>{0, 1, 2, 5, 6, 7}));
  // A spike over training steps 5-6 (1-based: 0-based 4 and 5) read data steps 6 and 7; a
  // rollback skips those too, and the stream goes on at 8.
  EXPECT_EQ(g.roll_back_past(SpikeGuard::Spike{5, 6, 10, 1}), (std::vector<int64_t>{6, 7}));
  EXPECT_EQ(g.record().skipped_batches, (std::vector<int64_t>{3, 4, 6, 7}));
  got.clear();
  for (int64_t s = 0; s < 6; ++s) got.push_back(g.data_step(s));
  EXPECT_EQ(got, (std::vector<int64_t>{0, 1, 2, 5, 8, 9}));
}

TEST(SpikeGuardJudging, OneRollbackMoreThanAllowedStopsNamingEverySpike) {
  SpikeGuardConfig c = guard_config(SpikeAction::kRollback);
  c.max_rollbacks = 1;
  SpikeGuard g(c);
  g.roll_back_past(SpikeGuard::Spike{7, 8, 10, 1});
  try {
    g.roll_back_past(SpikeGuard::Spike{7, 9, 10, 1});
    FAIL() << "a second rollback past max_rollbacks 1 was allowed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("2 spikes, over steps 7-8, 7-9"), std::string::npos)
        << e.what();
  }
}

// --- end to end, two ranks ---------------------------------------------------------------

std::string tmp(const std::string& name) {
  const std::string dir = dtrain::testing::scratch_path("spike_guard_test/" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// 24 steps on two ranks, a checkpoint every 4 into `dir`, a metrics row every step.
std::string train_cmd(const std::string& config, const std::string& dir, const std::string& env,
                      const std::string& extra = "") {
  return env + " OMP_NUM_THREADS=1 " + g_launcher +
         " --nproc-per-node 2 --master-port 0 --grace-period 2 -- " + g_trainer + " --config " +
         config +
         " --set train.steps=24 --set checkpoint.every_steps=4 --set checkpoint.dir=" + dir +
         " --set logging.every_steps=1 --set logging.metrics_file=" + dir +
         "/metrics.jsonl --set logging.progress_bar=false --set "
         "train.spike_guard.action=rollback " +
         extra;
}

// Metrics rows by step, the last row of a step winning (a rollback's replay rewrites them),
// the rollback's own rows apart.
struct Metrics {
  std::map<int, std::map<std::string, std::string>> steps;
  std::vector<std::map<std::string, std::string>> rollbacks;
};

Metrics metrics(const std::string& dir) {
  Metrics m;
  std::ifstream f(dir + "/metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    if (line.empty()) continue;
    YAML::Node n = YAML::Load(line);
    if (n["run"]) continue;
    std::map<std::string, std::string> row;
    for (const auto& kv : n) row[kv.first.as<std::string>()] = kv.second.Scalar();
    if (n["rolled_back"]) {
      m.rollbacks.push_back(row);
    } else if (!n["spike"]) {
      m.steps[n["step"].as<int>()] = row;
    }
  }
  return m;
}

// Batches 12 and 13 make the loss spike (steps 12 and 13 read them): step 12's checkpoint is
// postponed, step 13 completes the spike, the run goes back to step 8's checkpoint, skips data
// steps 12 and 13, and from there equals a run that skipped them from the start. `kill`: the
// rolled-back run is also killed after step 20 and resumed (the skipped batches travel in
// the checkpoint).
void expect_rollback_is_exact(const std::string& config, const std::string& bad,
                              const std::string& extra, bool kill = false) {
  SCOPED_TRACE(config + " " + bad + " " + extra + (kill ? " killed and resumed" : ""));
  const std::string a = tmp("spiked"), b = tmp("never_saw"), c = tmp("plain");
  Result never = run_command(train_cmd(config, b, "DTRAIN_TEST_SKIP_BATCHES=12:2", extra));
  ASSERT_EQ(never.code, 0) << never.output;
  Result plain = run_command(train_cmd(config, c, "", extra));
  ASSERT_EQ(plain.code, 0) << plain.output;
  const std::string env = "DTRAIN_TEST_BAD_BATCHES=12:2" + bad;
  Result spiked = run_command(
      train_cmd(config, a, env + (kill ? " DTRAIN_TEST_KILL_AT_STEP=20:1" : ""), extra));
  if (kill) {
    ASSERT_NE(spiked.code, 0) << "the kill hook did not fire:\n" << spiked.output;
    ASSERT_TRUE(fs::exists(a + "/step_00000020/COMPLETE")) << spiked.output;
    const std::string first = spiked.output;
    spiked = run_command(train_cmd(config, a, env, extra));
    spiked.output = first + spiked.output;
    EXPECT_NE(spiked.output.find("resumed from " + a + "/step_00000020 at step 20"),
              std::string::npos)
        << spiked.output;
  }
  ASSERT_EQ(spiked.code, 0) << spiked.output;
  EXPECT_NE(spiked.output.find("checkpoint of step 12 postponed"), std::string::npos)
      << spiked.output;
  EXPECT_NE(spiked.output.find("since step 12; rolled back from step 13 to the checkpoint of "
                               "step 8, skipping the batches of data step(s) 12, 13"),
            std::string::npos)
      << spiked.output;
  EXPECT_FALSE(fs::exists(a + "/step_00000012")) << "a checkpoint was written inside the spike";
  const Metrics ma = metrics(a), mb = metrics(b), mc = metrics(c);
  ASSERT_EQ(ma.rollbacks.size(), 1u);
  EXPECT_EQ(ma.rollbacks[0].at("step"), "8");
  EXPECT_EQ(ma.rollbacks[0].at("rolled_back_from"), "13");
  EXPECT_EQ(ma.rollbacks[0].at("skipped_batches"), "12, 13");
  for (int step = 1; step <= 24; ++step) {
    ASSERT_TRUE(ma.steps.count(step) && mb.steps.count(step)) << "step " << step;
    EXPECT_EQ(ma.steps.at(step).at("loss"), mb.steps.at(step).at("loss")) << "step " << step;
  }
  // The skipped batches mattered: from step 12 on, the run that saw them all differs.
  EXPECT_EQ(mc.steps.at(11).at("loss"), mb.steps.at(11).at("loss"));
  EXPECT_NE(mc.steps.at(12).at("loss"), mb.steps.at(12).at("loss"));
  const std::string sum = final_checksum(never.output);
  ASSERT_FALSE(sum.empty()) << never.output;
  EXPECT_EQ(final_checksum(spiked.output), sum) << "final parameters differ";
  EXPECT_NE(final_checksum(plain.output), sum);
}

TEST(SpikeRollback, DdpAsyncCheckpointsEqualsARunThatNeverSawTheBatches) {
  expect_rollback_is_exact("configs/tiny/ddp_fp32.yaml", "", "--set checkpoint.async=true");
}

// NaN losses without a scaler: the parameters turn NaN, every later loss is NaN; the rollback
// restores them, and train.max_nonfinite_steps (which would stop the run) gives way to it.
TEST(SpikeRollback, FsdpNonFiniteLossesKilledAndResumed) {
  expect_rollback_is_exact("configs/tiny/fsdp_fp32.yaml", ":nan", "",
                           /*kill=*/true);
}

TEST(SpikeRollback, ARunThatKeepsSpikingStopsNamingTheSteps) {
  const std::string a = tmp("keeps");
  Result r = run_command(train_cmd("configs/tiny/ddp_fp32.yaml", a, "DTRAIN_TEST_BAD_BATCHES=12:40",
                                   "--set train.spike_guard.max_rollbacks=2"));
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("the loss keeps spiking: 3 spikes, over steps 12-13, 12-13, 12-13, "
                          "one more than train.spike_guard.max_rollbacks (2)"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(metrics(a).rollbacks.size(), 2u);
}

// The default (warn): the run goes on, and says so once.
TEST(SpikeWarn, ADivergingRunSaysSo) {
  const std::string a = tmp("diverges");
  Result r = run_command(" OMP_NUM_THREADS=1 " + g_launcher +
                         " --nproc-per-node 2 --master-port 0 --grace-period 2 -- " + g_trainer +
                         " --config configs/tiny/ddp_fp32.yaml --set train.steps=30 "
                         "--set train.lr=5 --set train.clip_grad_norm=0 "
                         "--set logging.progress_bar=false --set logging.metrics_file=" +
                         a + "/metrics.jsonl");
  ASSERT_EQ(r.code, 0) << r.output;
  std::smatch m;
  const std::regex re("step ([0-9]+): loss spike: the loss \\(([0-9.]+), over ranks\\)");
  ASSERT_TRUE(std::regex_search(r.output, m, re)) << r.output;
  EXPECT_GT(std::stod(m[2].str()), 10.0) << r.output;
}

}  // namespace
}  // namespace dtrain::framework

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  using dtrain::testing::flag_value;
  dtrain::framework::g_launcher = flag_value(argc, argv, "launcher");
  dtrain::framework::g_trainer = flag_value(argc, argv, "trainer");
  if (dtrain::framework::g_launcher.empty() || dtrain::framework::g_trainer.empty()) {
    std::fprintf(stderr, "usage: spike_guard_test --launcher=PATH --trainer=PATH\n");
    return 2;
  }
  return RUN_ALL_TESTS();
}
