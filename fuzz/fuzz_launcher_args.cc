// Fuzzes dtrain-launch's command line: launcher::parse_args (CLI11 and the launcher's checks).
//
// Input: one argument per line, in order (argv without argv[0]); empty lines are empty
// arguments, a final '\n' adds none.
// Any input must end in LaunchOptions or a dtrain::Error (UsageError); anything else
// escaping, a crash, a hang or a sanitizer report is a bug. Nothing is launched.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "fuzz/fuzz_common.h"
#include "launcher/launcher.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<std::string> args =
      dtrain::fuzz::lines(dtrain::fuzz::text(data, size), /*keep_empty=*/true);
  try {
    dtrain::launcher::parse_args(args);
    dtrain::fuzz::report("accepted");
  } catch (const dtrain::Error& e) {
    dtrain::fuzz::report(e.what());
    // Refused arguments: what a user sees. Anything else propagates and aborts.
  }
  return 0;
}
