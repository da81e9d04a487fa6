// The trainer's output besides the log: the metrics file (JSON lines, what scripts/plot
// draws), the progress bar, and the step timeline (logging.trace).
//
// Every JSON line is built with JsonObject, which escapes keys and strings (json::escape,
// core/json.h) and writes a non-finite number (a diverged loss) as null, since JSON has no nan or
// inf.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>

#include "comm/communicator.h"
#include "framework/config.h"

namespace dtrain::framework {

// One JSON object, field by field, in the order given:
//   JsonObject().integer("step", 3).number("loss", 2.5).text()  ->  {"step":3,"loss":2.5}
class JsonObject {
 public:
  JsonObject& string(std::string_view key, std::string_view value);
  JsonObject& integer(std::string_view key, int64_t value);
  // `format` is printf's; the default keeps every digit (losses are compared bitwise).
  JsonObject& number(std::string_view key, double value, const char* format = "%.17g");
  JsonObject& boolean(std::string_view key, bool value);
  JsonObject& object(std::string_view key, const JsonObject& value);
  std::string text() const { return "{" + body_ + "}"; }

 private:
  void key(std::string_view k);
  std::string body_;
};

// Rank 0's logging.metrics_file: a first row {"run": {...}} that describes the run (plot
// titles and legends), then one row per logged step. A resumed run keeps the rows up to its
// checkpoint's step (a crashed attempt may have logged beyond it) and appends. On other ranks,
// or without a metrics file, it writes nothing. ConfigError when the file cannot be written.
class MetricsFile {
 public:
  MetricsFile(const RunConfig& c, int rank, int64_t resumed_at, const JsonObject& run);
  void write(const JsonObject& row);

 private:
  std::ofstream out_;
};

// "[####......] 12/40"
std::string progress_bar(int64_t done, int64_t total, int width = 30);

// The step timeline: every rank's events gathered to rank 0, which writes one Chrome
// trace-event file (core/trace.h) at logging.trace. Collective: every rank calls it.
void write_trace(const RunConfig& c, comm::Communicator* comm, int rank, int world);

}  // namespace dtrain::framework
