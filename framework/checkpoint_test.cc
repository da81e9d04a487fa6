// Checkpoints end to end, through dtrain-launch and dtrain-train on real ranks:
//   - a run interrupted after a checkpoint and resumed equals an uninterrupted run bitwise
//     (loss per step, loss scale, final parameters): DDP and FSDP, with gradient accumulation,
//     fp16 + GradScaler, sharded and full checkpoints, `checkpoint.resume: auto` and --resume;
//   - a sharded checkpoint written at 4 ranks loads at 2 and 3, with the validation loss of
//     the 4-rank run within 1e-5, and training continues;
//   - dtrain-launch --max-restarts restarts a killed group, which resumes and ends bitwise
//     equal to an uninterrupted run;
//   - a crash before a checkpoint's last rename leaves the previous one, which resume picks;
//     a flipped byte, a truncated file, a full disk and another model's checkpoint are each
//     refused with a message naming the file or tensor, and nothing is loaded;
//   - PyTorch reads a full checkpoint's model and scaler (torch.load(weights_only=True)), and
//     dtrain loads a PyTorch state_dict(): the same logits on both sides;
//   - the xxh64 checksums match the reference digests.
#include "framework/checkpoint/checkpointer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "framework/checkpoint/hash.h"
#include "framework/checkpoint/pickle.h"
#include "framework/models/transformer_lm.h"
#include "tests/flags.h"
#include "tests/subprocess.h"

namespace dtrain::framework {
namespace {

namespace fs = std::filesystem;

std::string g_launcher, g_trainer, g_python, g_interop;

using Result = dtrain::testing::CommandResult;
using dtrain::testing::final_checksum;
using dtrain::testing::run_command;

Result run(const std::string& cmd) { return run_command(cmd); }

std::string tmp(const std::string& name) {
  const std::string dir = dtrain::testing::scratch_path("ckpt_test/" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// dtrain-train on `ranks` ranks (dtrain-launch, Gloo) with a checkpoint every 20 of 40
// steps into `dir`, metrics every step into dir/metrics.jsonl.
std::string train_cmd(const std::string& config, int ranks, const std::string& dir,
                      const std::string& extra = "", const std::string& env = "",
                      const std::string& launcher_flags = "") {
  return env + " OMP_NUM_THREADS=1 " + g_launcher + " --nproc-per-node " + std::to_string(ranks) +
         " --master-port 0 --grace-period 2 " + launcher_flags + " -- " + g_trainer + " --config " +
         config + " --set train.steps=40 --set checkpoint.every_steps=20" +
         " --set checkpoint.dir=" + dir + " --set logging.every_steps=1" +
         " --set logging.metrics_file=" + dir + "/metrics.jsonl --set logging.progress_bar=false " +
         extra;
}

// Metrics rows by step (the last row of a step wins), as their raw text fields.
std::map<int, std::map<std::string, std::string>> metrics(const std::string& dir) {
  std::map<int, std::map<std::string, std::string>> rows;
  std::ifstream f(dir + "/metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    if (line.empty()) continue;
    YAML::Node n = YAML::Load(line);
    if (n["run"]) continue;  // the row describing the run
    auto& row = rows[n["step"].as<int>()];
    for (const auto& kv : n) row[kv.first.as<std::string>()] = kv.second.Scalar();
  }
  return rows;
}

// An uninterrupted run, and one killed after its step-20 checkpoint then resumed: the same
// loss and scale at every step after 20, the same final parameters bit for bit.
void expect_resume_is_exact(const std::string& config, const std::string& extra,
                            const std::string& how_resumed = "auto") {
  SCOPED_TRACE(config + " " + extra + " resume " + how_resumed);
  const std::string a = tmp("a"), b = tmp("b");
  Result whole = run(train_cmd(config, 2, a, extra));
  ASSERT_EQ(whole.code, 0) << whole.output;
  Result killed = run(train_cmd(config, 2, b, extra, "DTRAIN_TEST_KILL_AT_STEP=20:1"));
  ASSERT_NE(killed.code, 0) << "the kill hook did not fire:\n" << killed.output;
  ASSERT_TRUE(fs::exists(b + "/step_00000020/COMPLETE")) << killed.output;
  std::string resume = how_resumed == "auto" ? "" : " --resume " + b + "/step_00000020";
  Result resumed = run(train_cmd(config, 2, b, extra + resume));
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + b + "/step_00000020 at step 20"),
            std::string::npos)
      << resumed.output;
  auto ma = metrics(a), mb = metrics(b);
  for (int step = 21; step <= 40; ++step) {
    ASSERT_TRUE(ma.count(step) && mb.count(step)) << "step " << step;
    EXPECT_EQ(ma[step]["loss"], mb[step]["loss"]) << "loss at step " << step;
    EXPECT_EQ(ma[step]["scale"], mb[step]["scale"]) << "scale at step " << step;
  }
  EXPECT_EQ(mb[20]["loss"], ma[20]["loss"]) << "rows up to the checkpoint are kept";
  const std::string sum = final_checksum(whole.output);
  ASSERT_FALSE(sum.empty()) << whole.output;
  EXPECT_EQ(final_checksum(resumed.output), sum) << "final parameters differ";
}

TEST(Resume, DdpFp32WithGradientAccumulationIsBitwiseExact) {
  expect_resume_is_exact("configs/tiny/ddp_fp32.yaml", "");  // micro_batches 2
}

TEST(Resume, FsdpShardedCheckpointIsBitwiseExact) {
  expect_resume_is_exact("configs/tiny/fsdp_fp32.yaml", "", "path");
}

TEST(Resume, FsdpFullCheckpointIsBitwiseExact) {
  expect_resume_is_exact("configs/tiny/fsdp_fp32.yaml", "--set checkpoint.format=full");
}

TEST(Resume, Fp16WithGradScalerIsBitwiseExactScalesIncluded) {
  // A high initial scale and a short growth interval: the scale backs off and grows.
  expect_resume_is_exact("configs/tiny/fsdp_fp16.yaml",
                         "--set precision.scaler.init_scale=1.0e9 "
                         "--set precision.scaler.growth_interval=3");
}

// Saved in the per_parameter layout at 4 ranks; read back at 2 ranks in the same layout and
// at 3 in the flat one.
TEST(Resume, ShardedCheckpointReshardsFromFourRanksToTwoAndThree) {
  const std::string four = tmp("four");
  const std::string eval = "--set train.eval_every=20";
  Result r = run(train_cmd("configs/tiny/fsdp_fp32.yaml", 4, four, eval));
  ASSERT_EQ(r.code, 0) << r.output;
  const double want = std::stod(metrics(four)[20]["val_loss"]);
  for (const auto& [ranks, layout] :
       std::vector<std::pair<int, std::string>>{{2, "per_parameter"}, {3, "flat"}}) {
    SCOPED_TRACE(::testing::Message() << ranks << " ranks, " << layout);
    const std::string dir = tmp("at" + std::to_string(ranks));
    Result s = run(train_cmd(
        "configs/tiny/fsdp_fp32.yaml", ranks, dir,
        eval + " --set parallel.shard_layout=" + layout + " --resume " + four + "/step_00000020"));
    ASSERT_EQ(s.code, 0) << s.output;
    EXPECT_NE(s.output.find("written at 4 rank(s)"), std::string::npos) << s.output;
    auto m = metrics(dir);
    const double got = std::stod(m[20]["val_loss"]);
    EXPECT_NEAR(got, want, 1e-5 * want) << "validation loss of the resharded model";
    // Training continues: 20 more steps, the loss finite and the model still learning.
    ASSERT_TRUE(m.count(40)) << s.output;
    EXPECT_LT(std::stod(m[40]["val_loss"]), got);
  }
}

TEST(Resume, LauncherRestartsTheGroupFromTheNewestCheckpoint) {
  const std::string a = tmp("whole"), b = tmp("restarted");
  Result whole = run(train_cmd("configs/tiny/ddp_fp32.yaml", 2, a));
  ASSERT_EQ(whole.code, 0) << whole.output;
  Result r = run(train_cmd("configs/tiny/ddp_fp32.yaml", 2, b, "", "DTRAIN_TEST_KILL_AT_STEP=30:1",
                           "--max-restarts 1"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("restart"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("resumed from " + b + "/step_00000020 at step 20"), std::string::npos)
      << r.output;
  EXPECT_EQ(final_checksum(r.output), final_checksum(whole.output)) << r.output;
}

TEST(Integrity, ACrashBeforeTheLastRenameLeavesThePreviousCheckpoint) {
  const std::string dir = tmp("crash");
  Result r = run(train_cmd("configs/tiny/ddp_fp32.yaml", 2, dir, "",
                           "DTRAIN_TEST_CRASH_BEFORE_RENAME=step_00000040/meta.json"));
  ASSERT_NE(r.code, 0) << r.output;
  EXPECT_FALSE(fs::exists(dir + "/step_00000040/COMPLETE"));
  EXPECT_EQ(Checkpointer::newest_complete(dir).value_or(""), dir + "/step_00000020");
  Result resumed = run(train_cmd("configs/tiny/ddp_fp32.yaml", 2, dir));
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + dir + "/step_00000020"), std::string::npos)
      << resumed.output;
}

// One good checkpoint at step 20 (the run is killed after writing it).
std::string one_checkpoint(const std::string& name) {
  const std::string dir = tmp(name);
  Result r =
      run(train_cmd("configs/tiny/ddp_fp32.yaml", 2, dir, "", "DTRAIN_TEST_KILL_AT_STEP=20:1"));
  EXPECT_TRUE(fs::exists(dir + "/step_00000020/COMPLETE")) << r.output;
  return dir;
}

void expect_refused(const std::string& dir, const std::string& extra,
                    const std::vector<std::string>& needles) {
  Result r = run(train_cmd("configs/tiny/ddp_fp32.yaml", 2, dir, extra));
  EXPECT_NE(r.code, 0) << r.output;
  for (const auto& n : needles)
    EXPECT_NE(r.output.find(n), std::string::npos) << n << "\n" << r.output;
  EXPECT_EQ(r.output.find("resumed from"), std::string::npos) << r.output;
}

TEST(Integrity, Xxh64MatchesTheReferenceDigestsWhateverTheUpdateSizes) {
  // Digests of the reference implementation (xxhash's XXH64, seed 0).
  EXPECT_EQ(ckpt::hex(ckpt::checksum("", 0)), "ef46db3751d8e999");
  EXPECT_EQ(ckpt::hex(ckpt::checksum("abc", 3)), "44bc2cf5ad770999");
  std::string data;
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < 256; ++i) data.push_back(static_cast<char>(i));
  data += "dtrain";  // 774 bytes: 24 stripes of 32, then 6 tail bytes
  EXPECT_EQ(ckpt::hex(ckpt::checksum(data.data(), data.size())), "fc695ce66d2c2c9d");
  // Streaming in pieces of every size from 1 to 70 gives the same digest.
  for (size_t piece = 1; piece <= 70; ++piece) {
    ckpt::Hasher h;
    for (size_t at = 0; at < data.size(); at += piece)
      h.update(data.data() + at, std::min(piece, data.size() - at));
    EXPECT_EQ(ckpt::hex(h.digest()), "fc695ce66d2c2c9d") << "pieces of " << piece;
  }
}

// Damages one byte of `path` at `offset`.
void flip_byte(const std::string& path, std::streamoff offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(offset);
  f.write(&c, 1);
}

TEST(Integrity, AFlippedByteAndATruncatedFileAreRefusedByName) {
  const std::string dir = one_checkpoint("corrupt");
  const std::string model = dir + "/step_00000020/model.pt";
  flip_byte(model, 1000);
  expect_refused(dir, "", {model, "fails its checksum"});
  const std::string other = one_checkpoint("truncated");
  const std::string optim = other + "/step_00000020/optim.pt";
  fs::resize_file(optim, fs::file_size(optim) / 2);
  expect_refused(other, "", {optim, "truncated"});
}

// The newest checkpoint damaged in a file only rank 1 reads: resume auto falls back to the
// older one (the warning names both, and the damaged one is kept aside), every rank reports
// the damaged file first, and resuming it by name is refused the same way.
TEST(Integrity, ADamagedNewestCheckpointFallsBackToTheNewestIntactOne) {
  const std::string dir = tmp("fallback");
  Result whole = run(train_cmd("configs/tiny/ddp_fp32.yaml", 2, dir));
  ASSERT_EQ(whole.code, 0) << whole.output;
  const std::string newest = dir + "/step_00000040";
  flip_byte(newest + "/rank_00001.pt", 100);
  Result named = run(train_cmd("configs/tiny/ddp_fp32.yaml", 2, dir, "--resume " + newest));
  EXPECT_NE(named.code, 0) << named.output;
  // Rank 0 reads no file of rank 1's, yet says which one is damaged, instead of a peer's
  // closed connection.
  EXPECT_TRUE(std::regex_search(
      named.output, std::regex("\\[rank 0\\][^\n]*rank_00001\\.pt[^\n]*found by rank 1")))
      << named.output;
  EXPECT_EQ(named.output.find("Connection closed"), std::string::npos) << named.output;

  Result resumed = run(train_cmd("configs/tiny/ddp_fp32.yaml", 2, dir));
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("checkpoint '" + newest + "' is damaged ("), std::string::npos)
      << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from '" + dir + "/step_00000020', the newest intact"),
            std::string::npos)
      << resumed.output;
  EXPECT_TRUE(fs::exists(dir + "/damaged_step_00000040/rank_00001.pt"));
  EXPECT_TRUE(fs::exists(newest + "/COMPLETE")) << "the resumed run saves step 40 again";
}

// Saving again into a step folder a killed writer left: no temporary file remains in the
// complete checkpoint.
TEST(Integrity, ReSavingIntoAStepFolderLeavesNoTemporaryFiles) {
  const std::string dir = one_checkpoint("resave");
  const std::string step40 = dir + "/step_00000040";
  fs::create_directories(step40);
  std::ofstream(step40 + "/model.pt.tmp.12345") << "left by a killed writer";
  Result r = run(train_cmd("configs/tiny/ddp_fp32.yaml", 2, dir));
  ASSERT_EQ(r.code, 0) << r.output;
  ASSERT_TRUE(fs::exists(step40 + "/COMPLETE"));
  for (const auto& e : fs::directory_iterator(step40)) {
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
  }
}

// The guards' counts resume with the run: a loss scale that collapses at step 8 when the run
// is left alone collapses at step 8 when the run is killed after step 5 and resumed.
TEST(Resume, TheScaleCollapseGuardStopsAResumedRunWhereItWould) {
  const std::string dir = tmp("guards");
  const std::string cmd = " OMP_NUM_THREADS=1 " + g_launcher +
                          " --nproc-per-node 2 --master-port 0 --grace-period 2 -- " + g_trainer +
                          " --config configs/tiny/ddp_fp16.yaml --set train.steps=20" +
                          " --set checkpoint.every_steps=5 --set checkpoint.dir=" + dir +
                          " --set logging.progress_bar=false" +
                          " --set precision.scaler.max_consecutive_skips=6";
  const std::string collapse = "step 8: the loss scale collapsed (6 steps skipped in a row";
  Result alone = run("DTRAIN_TEST_NAN_FROM_STEP=3:1" + cmd + " --set checkpoint.resume=never");
  EXPECT_NE(alone.output.find(collapse), std::string::npos) << alone.output;
  fs::remove_all(dir);
  Result killed = run("DTRAIN_TEST_NAN_FROM_STEP=3:1 DTRAIN_TEST_KILL_AT_STEP=5:1" + cmd);
  ASSERT_TRUE(fs::exists(dir + "/step_00000005/COMPLETE")) << killed.output;
  Result resumed = run("DTRAIN_TEST_NAN_FROM_STEP=3:1" + cmd);
  EXPECT_NE(resumed.code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + dir + "/step_00000005"), std::string::npos)
      << resumed.output;
  EXPECT_NE(resumed.output.find(collapse), std::string::npos) << resumed.output;
}

// Another model's checkpoint: one config error (exit 2) naming the first parameter that
// differs and how many do, before anything is read; not "no intact checkpoint", and the
// checkpoint is not set aside as damaged.
TEST(Integrity, AnotherModelsCheckpointIsRefusedNamingTheTensorAndNothingLoads) {
  const std::string dir = one_checkpoint("other_model");
  Result r = run(train_cmd("configs/tiny/ddp_fp32.yaml", 2, dir, "--set model.d_model=32"));
  EXPECT_EQ(r.code, 2) << r.output;
  for (const char* n : {"holds another model than this run's",
                        "'tok_emb.weight' is [256, 64] there and [256, 32] here",
                        "parameter(s) of another shape", "model.* settings"}) {
    EXPECT_NE(r.output.find(n), std::string::npos) << n << "\n" << r.output;
  }
  for (const char* never : {"resumed from", "no intact checkpoint", "damaged"}) {
    EXPECT_EQ(r.output.find(never), std::string::npos) << never << "\n" << r.output;
  }
  EXPECT_EQ(Checkpointer::newest_complete(dir).value_or(""), dir + "/step_00000020");
}

TEST(Integrity, AFullDiskGivesAClearErrorAndKeepsThePreviousCheckpoint) {
  const std::string dir = one_checkpoint("full_disk");
  // A file-size limit of 100 KiB: model.pt (~480 kB) and optim.pt of the step-40 checkpoint
  // cannot be written.
  Result r = run("ulimit -f 100 && " + train_cmd("configs/tiny/ddp_fp32.yaml", 2, dir));
  EXPECT_NE(r.code, 0) << r.output;
  // model.pt and optim.pt are written at once: either may hit the limit first.
  EXPECT_TRUE(std::regex_search(r.output, std::regex("step_00000040/(model|optim)\\.pt")))
      << r.output;
  EXPECT_NE(r.output.find("the disk is full, or a file-size limit was reached"), std::string::npos)
      << r.output;
  EXPECT_EQ(Checkpointer::newest_complete(dir).value_or(""), dir + "/step_00000020");
  EXPECT_FALSE(fs::exists(dir + "/step_00000040/COMPLETE"));
}

TEST(Interop, PythonLoadsTheModelAndScalerOfAFullCheckpoint) {
  const std::string dir = tmp("interop");
  Result r = run(train_cmd("configs/tiny/ddp_fp16.yaml", 2, dir, "--set train.steps=20"));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string step = dir + "/step_00000020";
  Result py = run(g_python + " " + g_interop + " read " + step);
  ASSERT_EQ(py.code, 0) << py.output;
  auto from_python =
      ckpt::unpickle(ckpt::read_raw(step + "/python.pt"), "python.pt").toGenericDict();
  // dtrain's own model, loaded from the same file: the same logits.
  TransformerLM m(
      TransformerLMOptions().vocab_size(256).seq_len(32).d_model(64).n_layers(2).n_heads(4).d_ff(
          256));
  load_state_dict(*m, step + "/model.pt");
  at::Tensor x = at::arange(2 * 32, at::kLong).reshape({2, 32}).remainder(251);
  at::Tensor ours = m->forward(x).detach();
  at::Tensor theirs = from_python.at("logits").toTensor();
  EXPECT_TRUE(at::allclose(ours, theirs, 1e-6, 1e-6))
      << "max diff " << (ours - theirs).abs().max().item<double>();
  // The scaler: what PyTorch's GradScaler holds after load_state_dict is what dtrain saved.
  auto saved = ckpt::unpickle(ckpt::read_raw(step + "/scaler.pt"), "scaler.pt").toGenericDict();
  EXPECT_EQ(from_python.at("scale").toTensor().item<double>(), saved.at("scale").toDouble());
  EXPECT_EQ(from_python.at("growth_tracker").toTensor().item<int64_t>(),
            saved.at("_growth_tracker").toInt());
}

TEST(Interop, APyTorchStateDictLoadsIntoDtrainsTransformerLM) {
  const std::string dir = tmp("from_python");
  Result py = run(g_python + " " + g_interop + " write " + dir);
  ASSERT_EQ(py.code, 0) << py.output;
  TransformerLM m(
      TransformerLMOptions().vocab_size(256).seq_len(32).d_model(64).n_layers(2).n_heads(4).d_ff(
          256));
  load_state_dict(*m, dir + "/state_dict.pt");
  at::Tensor x = at::arange(2 * 32, at::kLong).reshape({2, 32}).remainder(251);
  at::Tensor ours = m->forward(x).detach();
  at::Tensor theirs = ckpt::unpickle(ckpt::read_raw(dir + "/logits.pt"), "logits.pt").toTensor();
  EXPECT_TRUE(at::allclose(ours, theirs, 1e-6, 1e-6))
      << "max diff " << (ours - theirs).abs().max().item<double>();
  // A mismatched module is refused before anything is copied.
  TransformerLM small(
      TransformerLMOptions().d_model(32).n_heads(4).d_ff(64).n_layers(2).seq_len(32));
  at::Tensor before = small->tok_emb->weight.detach().clone();
  EXPECT_THROW(load_state_dict(*small, dir + "/state_dict.pt"), CheckpointError);
  EXPECT_TRUE(at::equal(before, small->tok_emb->weight));
}

}  // namespace
}  // namespace dtrain::framework

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  using dtrain::testing::flag_value;
  dtrain::framework::g_launcher = flag_value(argc, argv, "launcher");
  dtrain::framework::g_trainer = flag_value(argc, argv, "trainer");
  dtrain::framework::g_python = flag_value(argc, argv, "python");
  dtrain::framework::g_interop = flag_value(argc, argv, "interop");
  if (dtrain::framework::g_launcher.empty() || dtrain::framework::g_trainer.empty() ||
      dtrain::framework::g_python.empty() || dtrain::framework::g_interop.empty()) {
    std::fprintf(stderr,
                 "usage: checkpoint_test --launcher=PATH --trainer=PATH --python=PATH "
                 "--interop=tests/checkpoint_interop.py\n");
    return 2;
  }
  return RUN_ALL_TESTS();
}
