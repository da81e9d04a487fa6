// A user's mistakes, one table: each row runs a real command (dtrain-train, dtrain-launch, a
// benchmark) the way a user would get it wrong, and checks the exit code and that the message
// names what to fix. Every row also checks what no user should see: "unexpected error", a
// LibTorch backtrace ("frame #", "Exception raised from"), a source tag ("[config.cc:42]"),
// a crash (exit code >= 128) or a hang (every command runs under `timeout`).
//
// Classes covered: config values (unknown, duplicate, non-finite, absurd, from a --set), the
// config file itself (missing, empty, a directory), paths in the config (data, metrics),
// sizes that cannot fit in memory, environment variables, command-line flags of every
// binary (including --help and --version, which exit 0), the rendezvous (a missing peer, a
// port in use) and a diverging run.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <vector>

#include "tests/flags.h"
#include "tests/subprocess.h"

namespace {

std::string g_launcher, g_trainer, g_comm_bench, g_scaler_bench, g_step_bench;

using Result = dtrain::testing::CommandResult;

Result run(const std::string& cmd) {
  // `env` lets a row start with VAR=value assignments; `timeout` turns a hang into a failure.
  return dtrain::testing::run_command("timeout -k 5 90 env " + cmd);
}

std::string tmp(const std::string& name) { return dtrain::testing::scratch_path(name); }

std::string write(const std::string& name, const std::string& text) {
  const std::string path = tmp(name);
  std::ofstream(path) << text;
  return path;
}

// A TCP port nobody listens on now.
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

struct Mistake {
  std::string what;  // what the user did
  std::string command;
  int code;                          // expected exit code
  std::vector<std::string> needles;  // the message must contain each
};

void check(const Mistake& m) {
  SCOPED_TRACE(m.what + ": " + m.command);
  Result r = run(m.command);
  EXPECT_EQ(r.code, m.code) << r.output;
  for (const auto& n : m.needles)
    EXPECT_NE(r.output.find(n), std::string::npos) << n << "\n" << r.output;
  for (const char* never : {"unexpected error", "frame #", "Exception raised from",
                            "terminate called", "internal error"}) {
    EXPECT_EQ(r.output.find(never), std::string::npos) << never << "\n" << r.output;
  }
  EXPECT_FALSE(std::regex_search(r.output, std::regex(R"(\[[A-Za-z_/]+\.(cc|h|cpp):[0-9]+\])")))
      << "a source tag reached the user:\n"
      << r.output;
}

std::string train(const std::string& args) {
  return g_trainer + " --config configs/tiny/ddp_fp32.yaml " + args;
}

// The same at 2 ranks through dtrain-launch.
std::string launch2(const std::string& args) {
  return g_launcher + " --nproc-per-node 2 --master-port 0 --backend gloo -- " + train(args);
}

TEST(UserMistakes, ConfigValuesNameTheKeyTheSourceAndTheFix) {
  const std::string dup = write("dup.yaml",
                                "model: {type: transformer}\ntrain:\n  steps: 3\n  batch_size: 2\n"
                                "  lr: 1.0e-3\n  steps: 5\n");
  for (const auto& m : std::vector<Mistake>{
           {"an unknown key from --set",
            train("--set foo.bar=1"),
            2,
            {"--set foo.bar=1", "unknown key"}},
           {"a misspelt key from --set",
            train("--set train.stesp=3"),
            2,
            {"--set train.stesp=3", "did you mean 'steps'"}},
           {"an infinite learning rate", train("--set train.lr=.inf"), 2, {"train.lr", "finite"}},
           {"a NaN weight decay",
            train("--set train.weight_decay=.nan"),
            2,
            {"train.weight_decay", "finite"}},
           {"an absurd learning rate", train("--set train.lr=1e6"), 2, {"train.lr", "<= 10"}},
           {"a key written twice",
            g_trainer + " --config " + dup,
            2,
            {"dup.yaml:6", "train.steps", "duplicate key", "line 3"}},
           {"a --set without '='",
            train("--set train.lr"),
            2,
            {"--set train.lr", "key.path=value"}},
       }) {
    check(m);
  }
}

TEST(UserMistakes, TheConfigFileItselfAndThePathsItNames) {
  const std::string empty = write("empty.yaml", "");
  for (const auto& m : std::vector<Mistake>{
           {"a config that does not exist",
            g_trainer + " --config nope.yaml",
            2,
            {"nope.yaml", "cannot be read"}},
           {"an empty config", g_trainer + " --config " + empty, 2, {"empty.yaml", "is empty"}},
           {"a directory as the config",
            g_trainer + " --config configs",
            2,
            {"configs", "is a directory"}},
           {"data.path is a directory",
            train("--set data.source=corpus --set data.path=/tmp --set model.vocab_size=256"),
            2,
            {"data.path", "is a directory"}},
           {"an unwritable metrics file",
            train("--set logging.metrics_file=/proc/dtrain/metrics.jsonl"),
            2,
            {"logging.metrics_file", "/proc/dtrain/metrics.jsonl"}},
       }) {
    check(m);
  }
}

TEST(UserMistakes, SizesThatCannotFitAreRefusedBeforeAllocating) {
  for (const auto& m : std::vector<Mistake>{
           {"a huge d_model",
            train("--set model.d_model=200000 --set model.n_heads=4"),
            2,
            {"needs about", "parallel.strategy: fsdp"}},
           {"a huge seq_len", train("--set model.seq_len=10000000"), 2, {"needs about"}},
           {"a huge batch", train("--set train.batch_size=200000000"), 2, {"needs about"}},
       }) {
    check(m);
  }
}

TEST(UserMistakes, EnvironmentVariablesAreNamed) {
  for (const auto& m : std::vector<Mistake>{
           {"an unknown log level",
            "DTRAIN_LOG_LEVEL=loud " + train(""),
            2,
            {"DTRAIN_LOG_LEVEL='loud'", "trace, debug, info"}},
           {"a rank outside the world",
            "RANK=3 WORLD_SIZE=2 " + train(""),
            2,
            {"rank 3", "outside [0, 2)"}},
       }) {
    check(m);
  }
  // MPICH's Hydra environment (PMI_RANK/PMI_SIZE) with backend auto picks MPI, and an MPI that
  // Hydra did not start inits each process alone: refused, not two jobs of one rank each.
  if (std::system("command -v mpirun >/dev/null 2>&1") == 0) {
    check({"an MPICH environment around another MPI",
           "PMI_RANK=0 PMI_SIZE=2 " + train("--set parallel.backend=auto"),
           2,
           {"the environment says this is rank 0 of 2", "PMI_RANK/PMI_SIZE", "sees 1 rank(s)",
            "parallel.backend: gloo"}});
  }
}

TEST(UserMistakes, EveryBinaryExplainsItselfAndRefusesBadFlags) {
  std::vector<Mistake> rows{
      {"dtrain-train without --config", g_trainer, 2, {"--config is required"}},
      {"--config without a value", g_trainer + " --config", 2, {"--config"}},
      {"an unknown flag", g_trainer + " --config configs/tiny/ddp_fp32.yaml --lr 1", 2, {"--lr"}},
      {"dtrain-launch -h", g_launcher + " -h", 0, {"--nproc-per-node", "--max-restarts"}},
      {"dtrain-launch without a program",
       g_launcher + " --nproc-per-node 2",
       2,
       {"no program to launch", "usage: dtrain-launch"}},
      {"an absurd --nproc-per-node",
       g_launcher + " --nproc-per-node 99999999999 true",
       2,
       {"--nproc-per-node"}},
      {"a zero --nproc-per-node", g_launcher + " --nproc-per-node 0 true", 2, {"--nproc-per-node"}},
      {"a bad backend", g_launcher + " --backend tcp true", 2, {"--backend", "tcp"}},
  };
  for (const auto& bin : {g_trainer, g_launcher, g_comm_bench, g_scaler_bench, g_step_bench}) {
    if (bin.empty()) continue;  // comm_bench needs MPI: a CMake build without it has none
    const std::string name = bin.substr(bin.rfind('/') + 1);
    rows.push_back({name + " --help", bin + " --help", 0, {"--version"}});
    rows.push_back({name + " --version", bin + " --version", 0, {name + " 0."}});
  }
  for (const auto& m : rows) check(m);
}

TEST(UserMistakes, RendezvousFailuresSayWhatToCheck) {
  const std::string port = std::to_string(free_port());
  // A listener on `busy`: the store cannot bind it.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  ::listen(fd, 1);
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const std::string busy = std::to_string(ntohs(a.sin_port));
  for (const auto& m : std::vector<Mistake>{
           {"only rank 0 of a 2-rank Slurm job started",
            "SLURM_PROCID=0 SLURM_NTASKS=2 SLURM_LOCALID=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                port + " DTRAIN_COMM_TIMEOUT_S=3 " + train("--set parallel.backend=gloo"),
            1,
            {"rendezvous", "ranks [1] of 2 did not join", "every rank started",
             "MASTER_ADDR/MASTER_PORT"}},
           {"the port is in use",
            "RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + busy +
                " DTRAIN_COMM_TIMEOUT_S=3 " + train("--set parallel.backend=gloo"),
            1,
            {"rendezvous", busy, "is already in use", "--master-port 0"}},
       }) {
    check(m);
  }
  ::close(fd);
}

TEST(UserMistakes, ADivergingRunStopsNamingTheStepInsteadOfPrintingNaN) {
  check(
      {"a NaN loss on one rank without a loss scaler",
       "DTRAIN_TEST_NAN_FROM_STEP=3:1 " + g_launcher +
           " --nproc-per-node 2 --master-port 0 --backend gloo -- " +
           train("--set train.steps=8 --set logging.progress_bar=false"),
       1,
       {"step 3: the loss is not finite", "train.max_nonfinite_steps", "logging.numerics: true"}});
  // Allowed twice in a row: stops at the second.
  check({"max_nonfinite_steps 2",
         "DTRAIN_TEST_NAN_FROM_STEP=3:0 " + g_launcher +
             " --nproc-per-node 2 --master-port 0 --backend gloo -- " +
             train("--set train.steps=8 --set train.max_nonfinite_steps=2"),
         1,
         {"step 4: the loss is not finite", "for 2 consecutive step(s)"}});
}

// What a terminal shows for one line of output: "\r" returns to the start, "\033[K" erases to
// the end, other text overwrites; colour sequences take no room.
std::string as_shown(const std::string& line) {
  std::string shown;
  size_t cursor = 0;
  for (size_t i = 0; i < line.size(); ++i) {
    if (line[i] == '\r') {
      cursor = 0;
    } else if (line.compare(i, 3, "\033[K") == 0) {
      shown.resize(cursor);
      i += 2;
    } else if (line[i] == '\033') {
      while (i < line.size() && line[i] != 'm') ++i;  // a colour: ESC [ ... m
    } else {
      if (cursor < shown.size()) {
        shown[cursor] = line[i];
      } else {
        shown += line[i];
      }
      ++cursor;
    }
  }
  return shown;
}

// On a terminal, the progress bar gives way to every log line, which shows alone on its line,
// with nothing of the bar before or after it: one process, and rank 0 under dtrain-launch
// (which shows the bar rank 0 redraws as it comes). Runs under script(1), which gives the run
// a terminal.
void expect_bar_and_clean_log_lines(const std::string& command) {
  SCOPED_TRACE(command);
  Result r = run("script -qec \"" + command + "\" /dev/null");
  ASSERT_EQ(r.code, 0) << r.output;
  ASSERT_TRUE(std::regex_search(r.output, std::regex("\r(\033\\[K)?(\\[rank 0\\] )?\\[####")))
      << "no progress bar drawn:\n"
      << r.output;
  const std::regex log_line(
      R"(^\[rank 0\] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ info step \d+/12 loss .* MB$)");
  int log_lines = 0;
  size_t start = 0;
  while (start < r.output.size()) {
    size_t end = r.output.find('\n', start);
    if (end == std::string::npos) end = r.output.size();
    std::string shown = as_shown(r.output.substr(start, end - start));
    start = end + 1;
    if (shown.find("/12 loss ") == std::string::npos) continue;
    ++log_lines;
    EXPECT_TRUE(std::regex_match(shown, log_line))
        << "a log line shares its line with the bar: " << shown;
  }
  EXPECT_GE(log_lines, 4) << r.output;
}

TEST(UserMistakes, TheProgressBarNeverRunsIntoALogLine) {
  const std::string args =
      "--set train.steps=12 --set logging.every_steps=3 --set logging.progress_bar=true";
  expect_bar_and_clean_log_lines(train(args));
  expect_bar_and_clean_log_lines(launch2(args));
}

// Loss-scale collapse, from an injected overflow source (rank 1's loss is NaN from step 3 on,
// so every fp16 step is skipped on both ranks and the scale halves each time).
TEST(UserMistakes, ACollapsingLossScaleStopsTheRunNamingTheUnitTheScalesAndTheFix) {
  const std::string fp16 = g_trainer + " --config configs/tiny/ddp_fp16.yaml " +
                           "--set train.steps=40 --set logging.progress_bar=false ";
  const std::string launch =
      "DTRAIN_TEST_NAN_FROM_STEP=3:1 " + g_launcher + " --nproc-per-node 2 --master-port 0 -- ";
  // 65536 halves below min_scale 1 at the 17th skipped step: step 19.
  check({"scale below min_scale",
         launch + fp16,
         1,
         {"step 19: the loss scale collapsed (scale 0.5 is below precision.scaler.min_scale 1)",
          "The first unit with an inf/NaN: ddp.bucket0.grad",
          "Recent scales: step 12: 64, step 13: 32", "step 19: 0.5", "precision.policy: bf16",
          "precision.scaler.init_scale", "the loss scale fell to 512, below 2^10"}});
  Result r = run(launch + fp16);
  size_t first = r.output.find("below 2^10");
  ASSERT_NE(first, std::string::npos) << r.output;
  // Once per rank, not once per step.
  size_t count = 0;
  for (size_t at = first; at != std::string::npos; at = r.output.find("below 2^10", at + 1)) {
    ++count;
  }
  EXPECT_EQ(count, 2u) << r.output;
  // The guards judge steps when their figures are read: at logged steps, then after every
  // step once one was skipped. Logging every 2 steps, the skips from step 3 are seen at step 4
  // and the numerics monitor, switched on then, names the unit at step 5.
  check(
      {"max_consecutive_skips",
       launch + fp16 + "--set precision.scaler.max_consecutive_skips=4 --set logging.every_steps=2",
       1,
       {"step 6: the loss scale collapsed (4 steps skipped in a row, "
        "precision.scaler.max_consecutive_skips: 4)",
        "The first unit with an inf/NaN: ddp.bucket0.grad"}});
  // The same run with the limits off trains to the end, skipping.
  check({"limits off",
         launch + fp16 +
             "--set train.steps=8 --set precision.scaler.min_scale=0 "
             "--set precision.scaler.max_consecutive_skips=0",
         0,
         {"step 8: inf/NaN gradients, step skipped"}});
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

size_t count_of(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// What a failure before the first step must not show: a peer's broken connection.
void expect_no_peer_noise(const Mistake& m) {
  SCOPED_TRACE(m.what);
  const Result r = run(m.command);
  for (const char* noise : {"GLHF", "closed by peer", "Connection closed", "Connection reset"}) {
    EXPECT_EQ(r.output.find(noise), std::string::npos) << noise << "\n" << r.output;
  }
}

// Every path the run writes is checked at startup, on every rank, and the ranks stop together:
// the rank with the problem names the key, the others say whose problem stopped them.
TEST(UserMistakes, OutputPathsAreCheckedBeforeTheFirstStep) {
  const std::string file = write("not_a_folder", "x");
  const std::vector<Mistake> rows{
      {"an unwritable checkpoint.dir under the launcher",
       launch2("--set checkpoint.dir=/proc/dtrain_ckpt --set train.steps=4"),
       2,
       {"checkpoint.dir", "/proc/dtrain_ckpt", "cannot be made"}},
      {"checkpoint.dir is a file",
       launch2("--set checkpoint.dir=" + file + " --set train.steps=4"),
       2,
       {"checkpoint.dir", "is a file; give a folder"}},
      {"an unwritable metrics file under the launcher",
       launch2("--set logging.metrics_file=/proc/dtrain/m.jsonl --set train.steps=4"),
       2,
       {"logging.metrics_file", "/proc/dtrain/m.jsonl", "rank 0 (pid"}},
      {"an unwritable trace file",
       train("--set logging.trace=/proc/dtrain/trace.json --set train.steps=4"),
       2,
       {"logging.trace", "/proc/dtrain/trace.json"}},
  };
  for (const auto& m : rows) {
    check(m);
    expect_no_peer_noise(m);
  }
}

// A resume that leaves nothing to train says so and fails; raising train.steps trains on.
TEST(UserMistakes, AResumePastTrainStepsSaysNothingIsLeft) {
  const std::string dir = tmp("resume_past");
  const std::string base = train("--set checkpoint.dir=" + dir +
                                 " --set checkpoint.every_steps=2 --set logging.progress_bar=false "
                                 "--set parallel.strategy=none ");
  ASSERT_EQ(run(base + "--set train.steps=4").code, 0);
  check({"train.steps below the checkpoint's step",
         base + "--set train.steps=2",
         2,
         {"train.steps is 2", "is at step 4", "nothing is left to train",
          "checkpoint.resume: never"}});
  check({"the same steps again", base + "--set train.steps=4", 2, {"nothing is left to train"}});
  check({"train.steps raised", base + "--set train.steps=6", 0, {"at step 4", "done: 6 steps"}});
}

// dtrain-launch under mpirun or a many-task srun step: every task would launch ranks.
TEST(UserMistakes, TheLauncherRefusesToRunUnderMpirunOrSrun) {
  const std::string launch = g_launcher + " --nproc-per-node 1 --master-port 0 true";
  for (const auto& m : std::vector<Mistake>{
           {"under MPICH's Hydra",
            "PMI_SIZE=2 PMI_RANK=0 " + launch,
            2,
            {"mpirun started it (PMI_SIZE is set)", "run the program directly"}},
           {"srun with two tasks on one node",
            "SLURM_STEP_ID=0 SLURM_STEP_NUM_TASKS=2 SLURM_STEP_NUM_NODES=1 " + launch,
            2,
            {"srun started it as 2 tasks on 1 node(s)", "--ntasks-per-node=1"}},
           {"srun with one task per node (accepted)",
            "SLURM_STEP_ID=0 SLURM_STEP_NUM_TASKS=2 SLURM_STEP_NUM_NODES=2 " + launch,
            0,
            {}},
       }) {
    check(m);
  }
  // The real thing: OpenMPI's mpirun starting two launchers.
  if (run("which mpirun").code != 0) GTEST_SKIP() << "no mpirun here";
  Result r = run("mpirun --allow-run-as-root --oversubscribe -np 2 " + launch);
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("mpirun started it (OMPI_COMM_WORLD_SIZE is set)"), std::string::npos)
      << r.output;
}

// The mistakes of the first hour that used to pass silently or read confusingly.
TEST(UserMistakes, TheFirstHoursQuietSurprisesAreSaid) {
  // data.path without data.source selects the corpus (and a missing one is refused), and the
  // run line names the model, the data and the precision.
  std::string text = read_file("configs/tiny/ddp_fp32.yaml");
  const std::string source = "  source: corpus\n";
  ASSERT_NE(text.find(source), std::string::npos);
  text.erase(text.find(source), source.size());
  const std::string with_path = write("path_only.yaml", text);
  const std::string missing =
      write("missing_path.yaml",
            std::regex_replace(text, std::regex("path: .*"), "path: /nonexistent/mytext.txt"));
  const std::string quick = " --set train.steps=2 --set parallel.strategy=none";
  check({"data.path of a missing file without data.source",
         g_trainer + " --config " + missing + quick,
         2,
         {"data.path", "/nonexistent/mytext.txt", "cannot be read"}});
  check({"data.path without data.source",
         g_trainer + " --config " + with_path + quick,
         0,
         {"run: ", "TransformerLM 0.1M on corpus /usr/share/common-licenses/GPL-3",
          "precision fp32"}});
  // device: cuda on a CPU-only LibTorch names the build, once for both ranks.
  Result cuda = run(launch2("--set device=cuda"));
  EXPECT_EQ(cuda.code, 2) << cuda.output;
  EXPECT_EQ(count_of(cuda.output, "or build dtrain against a CUDA LibTorch"), 1u) << cuda.output;
  EXPECT_EQ(cuda.output.find("backend nccl"), std::string::npos) << cuda.output;
  // Every rank printing the same error line (here both, before either exits): printed once,
  // then counted.
  Result same = run(g_launcher +
                    " --nproc-per-node 2 --master-port 0 -- sh -c 'echo \"2026-12-02 "
                    "10:00:00.000 error config error: x.yaml: train.lr: must be > 0\" >&2; "
                    "sleep 1; exit 2'");
  EXPECT_EQ(same.code, 2) << same.output;
  EXPECT_EQ(count_of(same.output, "error config error: x.yaml: train.lr: must be > 0"), 1u)
      << same.output;
  EXPECT_NE(same.output.find("2 of 2 ranks (0, 1) reported the same error, printed once above: "
                             "config error: x.yaml: train.lr: must be > 0"),
            std::string::npos)
      << same.output;
  // More compute threads than CPUs is a warning with the fix.
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(::sched_getaffinity(0, sizeof(set), &set), 0);
  const int threads = 2 * CPU_COUNT(&set);
  check({"OMP_NUM_THREADS above the CPUs for two ranks",
         "OMP_NUM_THREADS=" + std::to_string(threads) + " " + launch2("--set train.steps=2"),
         0,
         {"2 rank(s) on this node x ", " compute threads each (OMP_NUM_THREADS) is more than its",
          "Set OMP_NUM_THREADS="}});
  // Without a terminal, rank 0 prints progress lines with the rate and the time left.
  check({"progress under the launcher",
         launch2("--set train.steps=6 --set logging.every_steps=100 "
                 "--set logging.progress_every_s=0.001"),
         0,
         {"progress: step 2/6, ", " step/s, ", " left"}});
}

// A rank that fails after the first step is the one named; a rank that stops only because
// its peer went away says so as a warning and exits 3, which dtrain-launch never blames.
TEST(UserMistakes, AFailureMidRunNamesTheRankAndMarksItsConsequences) {
  auto expect_clean = [](const Result& r) {
    for (const char* noise : {"GLHF", "Connection closed", "Connection reset", "rank 1 (pid",
                              "left behind by an aborted backward"}) {
      EXPECT_EQ(r.output.find(noise), std::string::npos) << noise << "\n" << r.output;
    }
  };
  // The first checkpoint cannot be written (a file-size limit): rank 0's error is the cause.
  const std::string dir = tmp("mid_run_full");
  Result full = run("sh -c 'ulimit -f 50; exec " +
                    launch2("--set checkpoint.dir=" + dir +
                            " --set checkpoint.every_steps=2 --set train.steps=6") +
                    "'");
  EXPECT_EQ(full.code, 1) << full.output;
  EXPECT_NE(full.output.find("error checkpoint: writing"), std::string::npos) << full.output;
  EXPECT_NE(full.output.find("rank 0 (pid"), std::string::npos) << full.output;
  expect_clean(full);
  // Without a launcher (a hand-set environment), rank 0 dies after step 2, DDP and FSDP:
  // rank 1 stops in a gradient reduction or an all-gather and says why.
  for (const char* strategy : {"ddp", "fsdp"}) {
    SCOPED_TRACE(strategy);
    const std::string env =
        "OMP_NUM_THREADS=1 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 "
        "MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
        std::to_string(free_port()) + " DTRAIN_TEST_KILL_AT_STEP=3:0 ";
    const std::string cmd = train(std::string("--set train.steps=6 --set parallel.strategy=") +
                                  strategy + " --set logging.metrics_file=");
    Result peer = run("sh -c '" + env + "RANK=0 LOCAL_RANK=0 " + cmd + " >/dev/null 2>&1 & " + env +
                      "RANK=1 LOCAL_RANK=1 " + cmd + "; code=$?; wait; exit $code'");
    EXPECT_EQ(peer.code, 3) << peer.output;
    EXPECT_NE(peer.output.find("warning stopping because another rank failed first: "),
              std::string::npos)
        << peer.output;
    EXPECT_NE(peer.output.find("that rank's error, above or in its log, is the cause"),
              std::string::npos)
        << peer.output;
    EXPECT_EQ(peer.output.find(" error "), std::string::npos) << peer.output;
    expect_clean(peer);
  }
  // The launcher: a consequence (exit 3) that comes first waits for the cause to be named...
  const std::string fake = g_launcher + " --nproc-per-node 2 --master-port 0 -- sh -c ";
  Result order = run(fake + "'if [ $RANK = 1 ]; then exit 3; fi; sleep 0.5; exit 1'");
  EXPECT_EQ(order.code, 1) << order.output;
  EXPECT_NE(order.output.find("rank 0 (pid"), std::string::npos) << order.output;
  EXPECT_EQ(order.output.find("rank 1 (pid"), std::string::npos) << order.output;
  // ... and is named when no cause comes (it may be on another node).
  Result alone = run(fake + "'if [ $RANK = 1 ]; then exit 3; fi; sleep 30'");
  EXPECT_EQ(alone.code, 3) << alone.output;
  EXPECT_NE(alone.output.find("rank 1 (pid"), std::string::npos) << alone.output;
  EXPECT_NE(alone.output.find("stopped because a rank elsewhere failed"), std::string::npos)
      << alone.output;
  // A rank repeating its own error line is not folded: only other ranks' repeats are.
  Result twice = run(fake +
                     "'[ $RANK = 0 ] && for i in 1 2; do echo \"2026-12-02 10:00:00.000 error "
                     "retry failed\" >&2; done; exit 0'");
  EXPECT_EQ(twice.code, 0) << twice.output;
  EXPECT_EQ(count_of(twice.output, "error retry failed"), 2u) << twice.output;
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  using dtrain::testing::flag_value;
  g_launcher = flag_value(argc, argv, "launcher");
  g_trainer = flag_value(argc, argv, "trainer");
  g_comm_bench = flag_value(argc, argv, "comm_bench");
  g_scaler_bench = flag_value(argc, argv, "scaler_bench");
  g_step_bench = flag_value(argc, argv, "step_bench");
  if (g_launcher.empty() || g_trainer.empty() || g_scaler_bench.empty() || g_step_bench.empty()) {
    std::fprintf(stderr,
                 "usage: user_errors_test --launcher=PATH --trainer=PATH --scaler_bench=PATH "
                 "--step_bench=PATH [--comm_bench=PATH]\n");
    return 2;
  }
  return RUN_ALL_TESTS();
}
