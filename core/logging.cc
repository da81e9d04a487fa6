// The only translation unit that includes spdlog (see logging.h for why).
#include "core/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>

namespace dtrain::logging {
namespace {

const char* const kLevelNames[] = {"trace", "debug", "info", "warn", "error", "off"};

spdlog::level::level_enum to_spdlog(Level level);

std::mutex g_mu;
std::shared_ptr<spdlog::logger> g_logger;

std::shared_ptr<spdlog::logger> make_logger(const std::string& prefix) {
  auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>("dtrain", sink);
  logger->set_pattern(prefix + "%Y-%m-%d %H:%M:%S.%e %^%l%$ %v");
  logger->flush_on(spdlog::level::trace);
  return logger;
}

std::shared_ptr<spdlog::logger> logger() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_logger) {
    g_logger = make_logger("");
    // An unknown DTRAIN_LOG_LEVEL is reported by configure() (a ConfigError); until then,
    // info.
    const char* env = std::getenv("DTRAIN_LOG_LEVEL");
    Level level = Level::kInfo;
    if (env != nullptr) {
      for (int i = 0; i < 6; ++i) {
        if (std::string(env) == kLevelNames[i]) level = static_cast<Level>(i);
      }
    }
    g_logger->set_level(to_spdlog(level));
  }
  return g_logger;
}

spdlog::level::level_enum to_spdlog(Level level) {
  return static_cast<spdlog::level::level_enum>(static_cast<int>(level) +
                                                (level == Level::kOff ? 2 : 0));
}

}  // namespace

Level parse_level(const std::string& name) {
  for (int i = 0; i < 6; ++i) {
    if (name == kLevelNames[i]) return static_cast<Level>(i);
  }
  DTRAIN_FAIL(ConfigError, "unknown log level '", name,
              "'; expected one of trace, debug, info, warn, error, off");
}

void configure(int rank, const Options& options) {
  std::string level_name = options.level;
  if (const char* env = std::getenv("DTRAIN_LOG_LEVEL")) {
    level_name = env;
    try {
      parse_level(level_name);
    } catch (const ConfigError&) {
      DTRAIN_FAIL(ConfigError, "DTRAIN_LOG_LEVEL='", level_name,
                  "' is not a log level; use one of trace, debug, info, warn, error, off");
    }
  }
  bool all_ranks = options.all_ranks;
  if (const char* env = std::getenv("DTRAIN_LOG_ALL_RANKS")) all_ranks = std::string(env) == "1";
  Level level = parse_level(level_name);
  if (rank != 0 && !all_ranks && level < Level::kWarn) level = Level::kWarn;
  // Under dtrain-launch every line already gets "[rank k] " from the launcher.
  const char* launched = std::getenv("DTRAIN_LAUNCHER");
  bool prefixed = launched != nullptr && std::string(launched) == "1";
  auto fresh = make_logger(prefixed ? "" : "[rank " + std::to_string(rank) + "] ");
  fresh->set_level(to_spdlog(level));
  std::lock_guard<std::mutex> lock(g_mu);
  g_logger = std::move(fresh);
}

bool enabled(Level level) { return logger()->should_log(to_spdlog(level)); }

void write(Level level, const std::string& message) {
  auto l = logger();
  // Below debug, users see messages without LibTorch backtraces and source tags.
  const bool debug = l->should_log(spdlog::level::debug);
  l->log(to_spdlog(level), debug ? message : detail::user_message(message, false));
}

std::string fixed(double value, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, value);
  return buf;
}

}  // namespace dtrain::logging
