#include "framework/metrics.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

#include "core/error.h"
#include "core/json.h"
#include "core/logging.h"
#include "core/trace.h"

namespace dtrain::framework {
namespace {

// Creates `path`'s folder and opens it for writing, or fails naming the config key.
std::ofstream open_for_writing(const RunConfig& c, const char* key, const std::string& path) {
  std::error_code ec;
  auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  std::ofstream f(path, std::ios::trunc);
  DTRAIN_CHECK_AS(ConfigError, static_cast<bool>(f), c.source, ": ", key, ": cannot write '", path,
                  "': ", std::strerror(errno), "; choose a writable place");
  return f;
}

}  // namespace

void JsonObject::key(std::string_view k) {
  if (!body_.empty()) body_ += ',';
  body_ += '"';
  body_ += json::escape(k);
  body_ += "\":";
}

JsonObject& JsonObject::string(std::string_view k, std::string_view value) {
  key(k);
  body_ += '"';
  body_ += json::escape(value);
  body_ += '"';
  return *this;
}

JsonObject& JsonObject::integer(std::string_view k, int64_t value) {
  key(k);
  body_ += std::to_string(value);
  return *this;
}

JsonObject& JsonObject::number(std::string_view k, double value, const char* format) {
  key(k);
  if (!std::isfinite(value)) {
    body_ += "null";
    return *this;
  }
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, value);
  body_ += buf;
  return *this;
}

JsonObject& JsonObject::boolean(std::string_view k, bool value) {
  key(k);
  body_ += value ? "true" : "false";
  return *this;
}

JsonObject& JsonObject::object(std::string_view k, const JsonObject& value) {
  key(k);
  body_ += value.text();
  return *this;
}

MetricsFile::MetricsFile(const RunConfig& c, int rank, int64_t resumed_at, const JsonObject& run) {
  if (rank != 0 || c.logging.metrics_file.empty()) return;
  const std::string& path = c.logging.metrics_file;
  std::vector<std::string> kept;
  if (resumed_at > 0) {
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) {
      const auto at = line.find("\"step\":");
      if (at != std::string::npos && std::atoll(line.c_str() + at + 7) <= resumed_at) {
        kept.push_back(line);
      }
    }
  }
  out_ = open_for_writing(c, "logging.metrics_file", path);
  out_ << JsonObject().object("run", run).text() << "\n";
  for (const auto& line : kept) out_ << line << "\n";
}

void MetricsFile::write(const JsonObject& row) {
  if (out_.is_open()) out_ << row.text() << "\n" << std::flush;
}

std::string progress_bar(int64_t done, int64_t total, int width) {
  int filled = static_cast<int>(width * done / std::max<int64_t>(1, total));
  return "[" + std::string(filled, '#') + std::string(width - filled, '.') + "] " +
         std::to_string(done) + "/" + std::to_string(total);
}

void write_trace(const RunConfig& c, comm::Communicator* comm, int rank, int world) {
  const std::string mine = trace::take_events_json();
  std::vector<std::string> all{mine};
  if (comm != nullptr && world > 1) {
    const auto on = [&](at::ScalarType t) { return at::TensorOptions(t).device(comm->device()); };
    at::Tensor lens = at::empty({world}, on(at::kLong));
    comm->all_gather(at::full({1}, static_cast<int64_t>(mine.size()), on(at::kLong)), lens).wait();
    lens = lens.cpu();
    const int64_t longest = lens.max().item<int64_t>();
    at::Tensor buf = at::zeros({std::max<int64_t>(1, longest)}, at::kByte);
    std::memcpy(buf.data_ptr(), mine.data(), mine.size());
    at::Tensor out = at::empty({buf.numel() * world}, on(at::kByte));
    comm->all_gather(buf.to(comm->device()), out).wait();
    out = out.cpu();
    all.clear();
    for (int r = 0; r < world; ++r) {
      all.emplace_back(static_cast<const char*>(out.data_ptr()) + r * buf.numel(),
                       lens[r].item<int64_t>());
    }
  }
  if (rank != 0) return;
  const std::string& path = c.logging.trace;
  std::ofstream f = open_for_writing(c, "logging.trace", path);
  f << "{\"traceEvents\":[";
  for (int r = 0; r < world; ++r) f << (r ? "," : "") << all[r];
  f << "],\"displayTimeUnit\":\"ms\",\"otherData\":"
    << JsonObject()
           .string("config", c.source)
           .string("strategy", name_of(c.parallel.strategy))
           .string("precision", name_of(c.precision.policy))
           .integer("ranks", world)
           .integer("first_step", c.logging.trace_start)
           .integer("steps", c.logging.trace_steps)
           .text()
    << "}\n";
  f.close();
  logging::info("trace: ", path, " (steps ", c.logging.trace_start, "-",
                c.logging.trace_start + c.logging.trace_steps - 1,
                ", every rank; open it in Perfetto or chrome://tracing, or scripts/plot it)");
}

}  // namespace dtrain::framework
