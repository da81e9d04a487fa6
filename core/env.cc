#include "core/env.h"

#include <cerrno>
#include <cstdlib>

#include "core/error.h"

namespace dtrain {

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
}

long env_int(const EnvLookup& env, const std::string& name, long fallback) {
  auto v = env(name);
  if (!v || v->empty()) return fallback;
  char* end = nullptr;
  errno = 0;
  long out = std::strtol(v->c_str(), &end, 10);
  DTRAIN_CHECK_AS(ConfigError, end != nullptr && *end == '\0', "environment variable ", name, "='",
                  *v, "' is not an integer");
  // strtol saturates out-of-range values at LONG_MIN/LONG_MAX; refuse them instead.
  DTRAIN_CHECK_AS(ConfigError, errno != ERANGE, "environment variable ", name, "='", *v,
                  "' is out of range");
  return out;
}

double env_double(const EnvLookup& env, const std::string& name, double fallback) {
  auto v = env(name);
  if (!v || v->empty()) return fallback;
  char* end = nullptr;
  double out = std::strtod(v->c_str(), &end);
  DTRAIN_CHECK_AS(ConfigError, end != nullptr && *end == '\0', "environment variable ", name, "='",
                  *v, "' is not a number");
  return out;
}

}  // namespace dtrain
