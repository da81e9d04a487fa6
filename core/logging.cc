// The only translation unit that includes spdlog (see logging.h for why).
#include "core/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>

namespace dtrain::logging {
namespace {

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
    const std::optional<Level> level =
        env != nullptr ? choice_from_name<Level>(env) : std::optional<Level>();
    g_logger->set_level(to_spdlog(level.value_or(Level::kInfo)));
  }
  return g_logger;
}

spdlog::level::level_enum to_spdlog(Level level) {
  return static_cast<spdlog::level::level_enum>(static_cast<int>(level) +
                                                (level == Level::kOff ? 2 : 0));
}

}  // namespace

Level parse_level(const std::string& name) {
  const std::optional<Level> level = choice_from_name<Level>(name);
  DTRAIN_CHECK_AS(ConfigError, level.has_value(), "unknown log level '", name,
                  "'; expected one of ", choice_list<Level>());
  return *level;
}

void configure(int rank, const Options& options) {
  Level level = options.level;
  if (const char* env = std::getenv("DTRAIN_LOG_LEVEL")) {
    const std::optional<Level> from_env = choice_from_name<Level>(env);
    DTRAIN_CHECK_AS(ConfigError, from_env.has_value(), "DTRAIN_LOG_LEVEL='", env,
                    "' is not a log level; use one of ", choice_list<Level>());
    level = *from_env;
  }
  bool all_ranks = options.all_ranks;
  if (const char* env = std::getenv("DTRAIN_LOG_ALL_RANKS")) all_ranks = std::string(env) == "1";
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
