// What every dtrain binary shares on its command line and at its exit:
//   setup/parse    CLI11 with -h/--help (a help screen on stdout, exit 0), --version
//                  ("dtrain-train 0.2.0 (LibTorch 2.13.0)", exit 0), and usage errors on
//                  stderr with exit 2;
//   failure_of     an exception as the one line a user is shown and the exit code: 2 for a
//                  config or usage error, 3 for a rank that stops because another failed
//                  first (PeerLostError; dtrain-launch never names it as the cause), 1 for
//                  anything else. No LibTorch backtrace or
//                  source tag unless DTRAIN_LOG_LEVEL=debug; an allocation failure says how
//                  to need less memory; only a bug reads "internal error".
// Header-only, for main() files. Binaries built with LibTorch print its version too.
#pragma once

#include <CLI/CLI.hpp>
#if __has_include(<torch/csrc/api/include/torch/version.h>)
#include <torch/csrc/api/include/torch/version.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <string>

#include "core/error.h"
#include "core/exit_codes.h"
#include "core/version.h"

namespace dtrain::cli {

inline std::string version_line(const std::string& program) {
#ifdef TORCH_VERSION
  return program + " " + DTRAIN_VERSION + " (LibTorch " + TORCH_VERSION + ")";
#else
  return program + " " + DTRAIN_VERSION;
#endif
}

inline void setup(CLI::App& app, const std::string& program) {
  app.set_version_flag("--version", version_line(program));
}

// dtrain-launch's options, which a program it starts does not take: an error naming one of
// them says where it belongs.
inline const char* launcher_option(const std::string& arg) {
  static const char* const kOptions[] = {
      "--nproc-per-node", "--nproc_per_node", "--nnodes",      "--node-rank",   "--node_rank",
      "--master-addr",    "--master_addr",    "--master-port", "--master_port", "--max-restarts",
      "--max_restarts",   "--run-id",         "--rdzv-id",     "--agent-port",  "--join-timeout",
      "--grace-period",   "--preempt-timeout"};
  const std::string name = arg.substr(0, arg.find('='));
  for (const char* o : kOptions) {
    if (name == o) return o;
  }
  return nullptr;
}

// Parses argv; exits 0 after --help or --version, 2 (with CLI11's message) on a usage error.
inline void parse(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::string program = argc > 0 ? argv[0] : "the program";
    program = program.substr(program.find_last_of('/') + 1);
    for (int i = 1; i < argc; ++i) {
      if (const char* o = launcher_option(argv[i])) {
        std::fprintf(stderr,
                     "%s: %s is an option of dtrain-launch, which starts the ranks, not of %s: "
                     "put it before the program, e.g.\n  dtrain-launch %s 2 -- %s --config "
                     "run.yaml\n",
                     program.c_str(), o, program.c_str(), o, program.c_str());
        std::exit(2);
      }
    }
    const int code = app.exit(e);
    std::exit(code == 0 ? 0 : 2);
  }
}

inline bool debugging() {
  const char* level = std::getenv("DTRAIN_LOG_LEVEL");
  return level != nullptr && (std::string(level) == "debug" || std::string(level) == "trace");
}

// kConsequenceExitCode (3) and kRequeueExitCode (75): core/exit_codes.h.

struct Failure {
  int code;
  std::string message;
};

inline std::string out_of_memory_advice() {
  return "out of memory: an allocation failed. Each rank needs less with a smaller "
         "train.batch_size or model, parallel.strategy: fsdp (shards parameters, gradients and "
         "optimizer state), or precision bf16; the memory estimate logged at startup shows "
         "what a rank needs";
}

inline Failure failure_of(std::exception_ptr error) {
  const bool debug = debugging();
  try {
    std::rethrow_exception(error);
  } catch (const ConfigError& e) {
    return {2, "config error: " + detail::user_message(e.what(), debug)};
  } catch (const UsageError& e) {
    return {2, detail::user_message(e.what(), debug)};
  } catch (const PeerLostError& e) {
    return {kConsequenceExitCode, detail::user_message(e.what(), debug)};
  } catch (const Error& e) {
    return {1, detail::user_message(e.what(), debug)};
  } catch (const std::bad_alloc&) {
    return {1, out_of_memory_advice()};
  } catch (const std::exception& e) {
    const std::string what = detail::user_message(e.what(), debug);
    // LibTorch's allocators: "DefaultCPUAllocator: can't allocate memory ...", "CUDA out of
    // memory ...".
    if (what.find("can't allocate memory") != std::string::npos ||
        what.find("not enough memory") != std::string::npos ||
        what.find("out of memory") != std::string::npos) {
      return {1, out_of_memory_advice() + " (" + what + ")"};
    }
    return {
        1, "internal error (please report it, with the output of DTRAIN_LOG_LEVEL=debug): " + what};
  } catch (...) {
    return {1, "internal error (please report it): an exception of unknown type"};
  }
}

}  // namespace dtrain::cli
