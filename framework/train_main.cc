// dtrain-train: trains a model as a YAML config says.
//   dtrain-train --config configs/tiny/ddp_fp32.yaml [--set train.lr=1e-3 ...]
// Run it under dtrain-launch, mpirun or srun for several ranks; alone for one.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "comm/factory.h"
#include "core/error.h"
#include "core/logging.h"
#include "framework/config.h"
#include "framework/memory.h"
#include "framework/trainer.h"

namespace {

const char* kUsage =
    "usage: dtrain-train --config FILE [--set key.path=value ...] [--resume PATH]\n"
    "  Trains as FILE says (see configs/). --set overrides one key, validated like the file.\n"
    "  --resume continues from a checkpoint directory (checkpoint.resume: auto takes the newest\n"
    "  complete one in checkpoint.dir).";

[[noreturn]] void quit(int code, const std::string& msg) {
  if (!msg.empty()) {
    try {
      dtrain::logging::error(msg);
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

}  // namespace

int main(int argc, char** argv) {
  // A file-size limit (RLIMIT_FSIZE) must fail the write with EFBIG, which the checkpoint
  // reports, not kill the process with SIGXFSZ.
  std::signal(SIGXFSZ, SIG_IGN);
  // Count tensor bytes from the start, for the peak-memory report (framework/memory.h).
  dtrain::framework::TrackedCpuMemory::install();
  std::string config_path;
  std::vector<std::string> overrides;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const std::string& flag) -> std::string {
      if (i + 1 >= argc) {
        std::cerr << "dtrain-train: " << flag << " needs a value\n" << kUsage << std::endl;
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--config") {
      config_path = value(a);
    } else if (a.rfind("--config=", 0) == 0) {
      config_path = a.substr(9);
    } else if (a == "--resume") {
      overrides.push_back("checkpoint.resume=" + value(a));
    } else if (a.rfind("--resume=", 0) == 0) {
      overrides.push_back("checkpoint.resume=" + a.substr(9));
    } else if (a == "--set") {
      overrides.push_back(value(a));
    } else if (a.rfind("--set=", 0) == 0) {
      overrides.push_back(a.substr(6));
    } else if (a == "--help" || a == "-h") {
      std::cout << kUsage << std::endl;
      return 0;
    } else {
      std::cerr << "dtrain-train: unknown argument '" << a << "'\n" << kUsage << std::endl;
      return 2;
    }
  }
  if (config_path.empty()) {
    std::cerr << "dtrain-train: --config is required\n" << kUsage << std::endl;
    return 2;
  }
  try {
    auto config = dtrain::framework::load_config(config_path, overrides);
    dtrain::comm::CommOptions co;
    co.backend = dtrain::comm::parse_backend(config.parallel.backend);
    co.device = config.device == "cuda" ? c10::kCUDA : c10::kCPU;
    // DTRAIN_COMM_TIMEOUT_S, when set, wins over parallel.timeout_s (like DTRAIN_LOG_LEVEL):
    // an operator's knob that needs no config edit.
    if (std::getenv("DTRAIN_COMM_TIMEOUT_S") == nullptr) {
      co.timeout =
          std::chrono::milliseconds(static_cast<int64_t>(config.parallel.timeout_s * 1000));
    }
    auto info = dtrain::comm::detect_rank_info(co.rendezvous);
    dtrain::logging::configure(info.rank, {config.logging.level, config.logging.all_ranks});
    std::shared_ptr<dtrain::comm::Communicator> comm;
    if (config.parallel.strategy != "none" || info.world_size > 1) {
      comm = dtrain::comm::create_world(co);
    }
    dtrain::framework::train(config, comm);
    if (comm) comm->barrier().wait();
    comm.reset();
    return 0;
  } catch (const dtrain::ConfigError& e) {
    quit(2, std::string("config error: ") + e.what());
  } catch (const dtrain::Error& e) {
    quit(1, e.what());
  } catch (const std::exception& e) {
    quit(1, std::string("unexpected error: ") + e.what());
  }
}
