// Fuzzes rank detection: comm::detect_rank_info(options, env), which reads torchrun's,
// OpenMPI's and Slurm's variables (and MASTER_ADDR/MASTER_PORT) and checks them.
//
// Input: one entry per line. "KEY=VALUE" sets an environment variable (the first '=' splits;
// a later line for the same KEY replaces it). Lines starting with '@' set an explicit option:
// "@rank=N", "@world_size=N", "@local_rank=N", "@local_world_size=N", "@master_port=N"
// (N outside int's range leaves it unset) and "@master_addr=S".
// Any input must end in a RankInfo or a dtrain::Error (ConfigError); anything else escaping,
// a crash or a sanitizer report is a bug.
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>

#include "comm/rendezvous.h"
#include "core/error.h"
#include "fuzz/fuzz_common.h"

namespace {

std::optional<int> as_int(const std::string& s) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end == s.c_str() || *end != '\0' || v < INT_MIN || v > INT_MAX) {
    return std::nullopt;
  }
  return static_cast<int>(v);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::map<std::string, std::string> vars;
  dtrain::comm::RendezvousOptions options;
  for (const std::string& line :
       dtrain::fuzz::lines(dtrain::fuzz::text(data, size), /*keep_empty=*/false)) {
    const size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = line.substr(0, eq), value = line.substr(eq + 1);
    if (key == "@rank") {
      options.rank = as_int(value);
    } else if (key == "@world_size") {
      options.world_size = as_int(value);
    } else if (key == "@local_rank") {
      options.local_rank = as_int(value);
    } else if (key == "@local_world_size") {
      options.local_world_size = as_int(value);
    } else if (key == "@master_port") {
      options.master_port = as_int(value);
    } else if (key == "@master_addr") {
      options.master_addr = value;
    } else {
      vars[key] = value;
    }
  }
  const dtrain::EnvLookup env = [&vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
  try {
    dtrain::comm::detect_rank_info(options, env);
    dtrain::fuzz::report("accepted");
  } catch (const dtrain::Error& e) {
    dtrain::fuzz::report(e.what());
    // Refused variables: what a user sees. Anything else propagates and aborts.
  }
  return 0;
}
