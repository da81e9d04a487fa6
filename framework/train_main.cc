// dtrain-train: trains a model as a YAML config says.
//   dtrain-train --config configs/tiny/ddp_fp32.yaml [--set train.lr=1e-3 ...] [--resume DIR]
// Run it under dtrain-launch, mpirun or srun for several ranks; alone for one.
//   dtrain-train --config X --estimate [--ranks N] [--ranks-per-node M]
// prints the memory estimate per rank (framework/memory_estimate.h) and trains nothing.
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "comm/factory.h"
#include "comm/flight_recorder.h"
#include "core/cli.h"
#include "core/error.h"
#include "core/faults.h"
#include "core/logging.h"
#include "framework/config.h"
#include "framework/memory.h"
#include "framework/memory_estimate.h"
#include "framework/models/builtin.h"
#include "framework/trainer.h"

namespace {

// A rank that stops only because another failed says so as a warning: the error to read is
// the other rank's.
[[noreturn]] void quit(int code, const std::string& msg) {
  if (!msg.empty()) {
    try {
      if (code == dtrain::cli::kConsequenceExitCode) {
        dtrain::logging::warn(msg);
      } else {
        dtrain::logging::error(msg);
      }
    } catch (...) {
      std::fprintf(stderr, "%s\n", msg.c_str());
    }
  }
  std::fflush(stdout);
  std::fflush(stderr);
  // A communicator that timed out may hold threads blocked in a collective: leave without
  // running destructors that would wait for them. The launcher or mpirun ends the peers.
  std::_Exit(code);
}

// Fault injection (core/faults.h, tests/faults_test.py): DTRAIN_TEST_CHILD="program args..."
// starts that program as a child of this rank, run by argv, like a user's data-loader helper.
// The fault tests check it does not outlive the job.
void start_test_child() {
  std::vector<std::string> words = dtrain::faults::words("CHILD");
  if (words.empty() || ::fork() != 0) return;
  std::vector<char*> argv;
  for (auto& s : words) argv.push_back(s.data());
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  ::_exit(127);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "dtrain-train: trains a model as a YAML config says (see configs/README.md).\n"
      "Run it under dtrain-launch, mpirun or srun for several ranks; alone for one."};
  dtrain::cli::setup(app, "dtrain-train");
  std::string config_path, resume;
  std::vector<std::string> overrides;
  app.add_option("--config", config_path, "the run's YAML file, e.g. configs/default.yaml")
      ->required();
  app.add_option("--set", overrides,
                 "override one key, validated like the file: --set train.lr=1e-3 (repeatable)")
      ->allow_extra_args(false);
  app.add_option("--resume", resume,
                 "continue from this checkpoint directory (checkpoint.resume: auto takes the "
                 "newest complete one in checkpoint.dir)");
  bool estimate = false;
  int ranks = 0, ranks_per_node = 0;
  app.add_flag("--estimate", estimate,
               "print the memory each rank needs (parameters, gradients, optimizer state, "
               "activations with and without recompute, ...) and the deepest model of this "
               "width that fits, then exit without training");
  app.add_option("--ranks", ranks, "with --estimate: the job's ranks (default WORLD_SIZE, or 1)")
      ->check(CLI::Range(1, 1 << 24));
  app.add_option("--ranks-per-node", ranks_per_node,
                 "with --estimate: ranks sharing this node's memory (default LOCAL_WORLD_SIZE, "
                 "or --ranks)")
      ->check(CLI::Range(1, 1 << 24));
  dtrain::cli::parse(app, argc, argv);
  dtrain::framework::register_builtin_models();  // model.type: transformer, mlp, llama
  if (estimate) {
    try {
      auto config = dtrain::framework::load_config(config_path, overrides);
      auto env_int = [](const char* name, int fallback) {
        const char* v = std::getenv(name);
        return v != nullptr && std::atoi(v) > 0 ? std::atoi(v) : fallback;
      };
      if (ranks == 0) ranks = env_int("WORLD_SIZE", 1);
      if (ranks_per_node == 0) ranks_per_node = env_int("LOCAL_WORLD_SIZE", ranks);
      std::cout << dtrain::framework::estimate_report(config, ranks,
                                                      std::min(ranks, ranks_per_node),
                                                      dtrain::framework::available_memory_bytes())
                << std::endl;
      return 0;
    } catch (...) {
      auto failure = dtrain::cli::failure_of(std::current_exception());
      quit(failure.code, failure.message);
    }
  }
  if (!resume.empty()) overrides.push_back("checkpoint.resume=" + resume);
  // A file-size limit (RLIMIT_FSIZE) must fail the write with EFBIG, which the checkpoint
  // reports, not kill the process with SIGXFSZ.
  std::signal(SIGXFSZ, SIG_IGN);
  // Slurm's --signal warning (SIGUSR1) would end the process by default: ignored unless
  // checkpoint.on_signal takes it (framework/preemption.h).
  std::signal(SIGUSR1, SIG_IGN);
  // Count tensor bytes from the start, for the peak-memory report (framework/memory.h).
  dtrain::framework::TrackedCpuMemory::install();
  start_test_child();
  // SIGUSR2 dumps the flight recorder; SIGTERM (dtrain-launch ending the job) dumps it first
  // (with checkpoint.on_signal, the trainer then takes SIGTERM and SIGUSR1:
  // framework/preemption.h).
  dtrain::comm::flight::install_signal_dumps();
  try {
    auto config = dtrain::framework::load_config(config_path, overrides);
    std::shared_ptr<dtrain::comm::Communicator> comm = dtrain::framework::connect(config);
    const dtrain::framework::TrainResult result = dtrain::framework::train(config, comm);
    // Stopped on SIGTERM or SIGUSR1 with a checkpoint saved: the code that asks for a requeue.
    if (result.preempted_by != 0) quit(dtrain::framework::kRequeueExitCode, "");
    if (comm) comm->barrier().wait();
    comm.reset();
    return 0;
  } catch (...) {
    auto failure = dtrain::cli::failure_of(std::current_exception());
    try {
      std::rethrow_exception(std::current_exception());
    } catch (const dtrain::CommError&) {
      // A collective timed out or failed: the recorder shows where this rank stood.
      const std::string path = dtrain::comm::flight::dump(failure.message);
      if (!path.empty()) {
        dtrain::logging::info("flight recorder: ", path, " (scripts/flight reads every rank's)");
      }
    } catch (...) {
    }
    quit(failure.code, failure.message);
  }
}
