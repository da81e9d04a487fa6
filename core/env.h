// Reading the process environment in one place, so tests can substitute a fake one.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace dtrain {

// Looks up one variable; std::nullopt when unset. Tests pass a lambda over a map.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

// The real environment (getenv).
EnvLookup process_env();

// Integer value of `name`, or `fallback` when unset; throws ConfigError naming the variable
// when set to something that is not an integer.
long env_int(const EnvLookup& env, const std::string& name, long fallback);
// The same for a floating-point value.
double env_double(const EnvLookup& env, const std::string& name, double fallback);

}  // namespace dtrain
