// Logging for every dtrain component, backed by spdlog; each line is prefixed "[rank k]".
//
// By default rank 0 logs at the configured level and other ranks log warnings and errors
// only (a failure on any rank is always visible). `all_ranks` lets every rank log at the
// configured level. DTRAIN_LOG_LEVEL (trace|debug|info|warn|error|off) overrides the
// configured level; DTRAIN_LOG_ALL_RANKS=1 overrides all_ranks.
//
// The API streams its arguments (`logging::info("step ", step, " loss ", loss)`) so that no
// spdlog or fmt header reaches code that includes LibTorch: LibTorch bundles a newer fmt
// than the system spdlog was built with, and the two cannot meet in one translation unit.
#pragma once

#include <array>
#include <string>
#include <utility>

#include "core/choices.h"
#include "core/error.h"

namespace dtrain::logging {

enum class Level { kTrace, kDebug, kInfo, kWarn, kError, kOff };
inline constexpr std::array<std::pair<Level, const char*>, 6> kLevels{{{Level::kTrace, "trace"},
                                                                       {Level::kDebug, "debug"},
                                                                       {Level::kInfo, "info"},
                                                                       {Level::kWarn, "warn"},
                                                                       {Level::kError, "error"},
                                                                       {Level::kOff, "off"}}};
constexpr const auto& choices(Level) { return kLevels; }

struct Options {
  Level level = Level::kInfo;
  bool all_ranks = false;
};

// (Re)configures the process-wide logger. Safe to call again once the rank is known.
void configure(int rank, const Options& options = {});

// Parses a level name; throws ConfigError for an unknown one.
Level parse_level(const std::string& name);

bool enabled(Level level);
void write(Level level, const std::string& message);

// `value` with `digits` digits after the point ("%.{digits}f").
std::string fixed(double value, int digits);

template <typename... Args>
void trace(Args&&... args) {
  if (enabled(Level::kTrace)) write(Level::kTrace, detail::str(std::forward<Args>(args)...));
}
template <typename... Args>
void debug(Args&&... args) {
  if (enabled(Level::kDebug)) write(Level::kDebug, detail::str(std::forward<Args>(args)...));
}
template <typename... Args>
void info(Args&&... args) {
  if (enabled(Level::kInfo)) write(Level::kInfo, detail::str(std::forward<Args>(args)...));
}
template <typename... Args>
void warn(Args&&... args) {
  if (enabled(Level::kWarn)) write(Level::kWarn, detail::str(std::forward<Args>(args)...));
}
template <typename... Args>
void error(Args&&... args) {
  if (enabled(Level::kError)) write(Level::kError, detail::str(std::forward<Args>(args)...));
}

}  // namespace dtrain::logging
