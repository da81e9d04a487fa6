// Fuzzes dtrain-launch's command line: launcher::parse_args (CLI11 and the launcher's checks).
//
// Input: one argument per line, in order (argv without argv[0]); empty lines are empty
// arguments, a final '\n' adds none.
// Any input must end in LaunchOptions or a dtrain::Error (UsageError); anything else
// escaping, a crash, a hang or a sanitizer report is a bug, and so are accepted options that
// launcher::run() cannot use (check_usable). Nothing is launched.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "fuzz/fuzz_common.h"
#include "launcher/launcher.h"

namespace {

// What launcher::run() computes from accepted options must be well defined: the ranks'
// WORLD_SIZE (nproc_per_node * nnodes) is an int, and the grace period becomes a deadline in
// nanoseconds on the steady clock. An accepted input that breaks this aborts, like a crash.
void check_usable(const dtrain::launcher::LaunchOptions& o) {
  const int64_t world = static_cast<int64_t>(o.nproc_per_node) * o.nnodes;
  const bool ok = !o.command.empty() && o.nproc_per_node >= 1 && o.nnodes >= 1 &&
                  world <= INT32_MAX && o.node_rank >= 0 && o.node_rank < o.nnodes &&
                  o.master_port >= 0 && o.master_port < 65536 && o.max_restarts >= 0 &&
                  std::isfinite(o.grace_period_s) && o.grace_period_s >= 0 &&
                  o.grace_period_s * 1e9 < 1e18;
  if (!ok) {
    std::fprintf(stderr,
                 "fuzz_launcher_args: accepted options run() cannot use: nproc_per_node %d, "
                 "nnodes %d, node_rank %d, master_port %d, max_restarts %d, grace_period_s %g, "
                 "%zu command words\n",
                 o.nproc_per_node, o.nnodes, o.node_rank, o.master_port, o.max_restarts,
                 o.grace_period_s, o.command.size());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<std::string> args =
      dtrain::fuzz::lines(dtrain::fuzz::text(data, size), /*keep_empty=*/true);
  try {
    const dtrain::launcher::LaunchOptions o = dtrain::launcher::parse_args(args);
    dtrain::fuzz::report("accepted");
    if (o.print_and_exit.empty()) check_usable(o);
  } catch (const dtrain::Error& e) {
    dtrain::fuzz::report(e.what());
    // Refused arguments: what a user sees. Anything else propagates and aborts.
  }
  return 0;
}
