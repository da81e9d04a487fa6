#include "core/trace.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <sstream>
#include <utility>
#include <vector>

#include "core/json.h"

namespace dtrain::trace {
namespace {

struct Recorder {
  std::mutex mu;
  int rank = 0;
  std::chrono::steady_clock::time_point origin = std::chrono::steady_clock::now();
  std::vector<std::string> tracks{"main"};
  std::vector<std::string> events;  // serialized JSON objects
};

Recorder& recorder() {
  static Recorder* r = new Recorder();  // never destroyed: comm threads may outlive main()
  return *r;
}

std::atomic<bool> g_recording{false};
thread_local std::string t_label;

}  // namespace

bool enabled() { return g_recording.load(std::memory_order_relaxed); }

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                               recorder().origin)
      .count();
}

int64_t to_us(int64_t steady_clock_ns) {
  const auto origin_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(recorder().origin.time_since_epoch())
          .count();
  return (steady_clock_ns - origin_ns) / 1000;
}

void configure(int rank) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  r.rank = rank;
  r.origin = std::chrono::steady_clock::now();
  r.events.clear();
}

void set_recording(bool on) { g_recording.store(on, std::memory_order_relaxed); }

int track(const std::string& name) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  for (size_t i = 0; i < r.tracks.size(); ++i) {
    if (r.tracks[i] == name) return static_cast<int>(i);
  }
  r.tracks.push_back(name);
  return static_cast<int>(r.tracks.size() - 1);
}

void complete(const std::string& name, const char* category, int track, int64_t start_us,
              int64_t end_us, const std::string& args_json) {
  Recorder& r = recorder();
  std::ostringstream os;
  os << "{\"name\":\"" << json::escape(name) << "\",\"cat\":\"" << category
     << "\",\"ph\":\"X\",\"ts\":" << start_us << ",\"dur\":" << (end_us - start_us)
     << ",\"pid\":" << r.rank << ",\"tid\":" << track;
  if (!args_json.empty()) os << ",\"args\":{" << args_json << "}";
  os << "}";
  std::lock_guard<std::mutex> lock(r.mu);
  r.events.push_back(os.str());
}

void flow(int64_t id, int from_track, int64_t from_us, int to_track, int64_t to_us) {
  Recorder& r = recorder();
  std::ostringstream os;
  os << "{\"name\":\"enqueue\",\"cat\":\"comm\",\"ph\":\"s\",\"id\":" << id << ",\"ts\":" << from_us
     << ",\"pid\":" << r.rank << ",\"tid\":" << from_track << "},"
     << "{\"name\":\"enqueue\",\"cat\":\"comm\",\"ph\":\"f\",\"bp\":\"e\",\"id\":" << id
     << ",\"ts\":" << to_us << ",\"pid\":" << r.rank << ",\"tid\":" << to_track << "}";
  std::lock_guard<std::mutex> lock(r.mu);
  r.events.push_back(os.str());
}

Label::Label(std::string label) : previous_(std::exchange(t_label, std::move(label))) {}
Label::~Label() { t_label = std::move(previous_); }
const std::string& current_label() { return t_label; }

Scope::Scope(std::string name, const char* category, int track)
    : name_(std::move(name)), category_(category), track_(track) {
  if (enabled()) start_ = now_us();
}

Scope::~Scope() {
  if (start_ >= 0) complete(name_, category_, track_, start_, now_us());
}

std::string take_events_json() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  std::ostringstream os;
  os << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << r.rank
     << ",\"args\":{\"name\":\"rank " << r.rank << "\"}},"
     << "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" << r.rank
     << ",\"args\":{\"sort_index\":" << r.rank << "}}";
  for (size_t i = 0; i < r.tracks.size(); ++i) {
    os << ",{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << r.rank << ",\"tid\":" << i
       << ",\"args\":{\"name\":\"" << json::escape(r.tracks[i]) << "\"}}"
       << ",{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":" << r.rank << ",\"tid\":" << i
       << ",\"args\":{\"sort_index\":" << i << "}}";
  }
  for (const auto& e : r.events) os << "," << e;
  r.events.clear();
  return os.str();
}

}  // namespace dtrain::trace
