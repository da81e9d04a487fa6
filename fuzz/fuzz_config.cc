// Fuzzes the run configuration: framework::parse_config (YAML text -> RunConfig, every check)
// with `--set key.path=value` overrides, as dtrain-train's `--config x.yaml --set ...` does.
//
// Input: the YAML text up to the first '\0'; after it, one override per line ("key.path=value";
// empty lines are skipped). Without a '\0' the whole input is the YAML and there are none.
// Any input must end in a RunConfig or a dtrain::Error (ConfigError); anything else escaping,
// a crash, a hang or a sanitizer report is a bug.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "framework/config.h"
#include "framework/models/configs.h"
#include "fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // model.type's readers: the built-in models' configurations (no module code).
  dtrain::framework::register_builtin_model_configs();
  const auto [yaml, rest] = dtrain::fuzz::split_nul(dtrain::fuzz::text(data, size));
  const std::vector<std::string> overrides = dtrain::fuzz::lines(rest, /*keep_empty=*/false);
  try {
    dtrain::framework::parse_config(yaml, "fuzz.yaml", overrides);
    dtrain::fuzz::report("accepted");
  } catch (const dtrain::Error& e) {
    dtrain::fuzz::report(e.what());
    // A refused config: what a user sees. Anything else propagates and aborts.
  }
  return 0;
}
