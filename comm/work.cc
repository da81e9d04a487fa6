#include "comm/work.h"

#include <sstream>

#include "comm/flight_recorder.h"
#include "comm/types.h"
#include "comm/worker.h"
#include "core/error.h"
#include "core/logging.h"
#include "core/trace.h"

namespace dtrain::comm {

std::string describe(const CollectiveInfo& info) {
  std::ostringstream os;
  os << info.op << " #" << info.seq << " (" << dtype_name(info.dtype) << ", " << info.numel
     << " elements) on ranks [";
  if (info.ranks) {
    for (size_t i = 0; i < info.ranks->size(); ++i) os << (i ? "," : "") << (*info.ranks)[i];
  }
  os << "] (" << info.backend << ")";
  return os.str();
}

std::exception_ptr backend_failure(const CollectiveInfo& info, const std::string& backend_name,
                                   const std::string& what) {
  // Gloo's pair.cc ("Connection closed by peer [10.0.0.2]:4711", "Read error ...: Connection
  // reset by peer", "Write error ...: Broken pipe") and NCCL's ncclRemoteError.
  static const char* const kPeerLost[] = {"closed by peer", "reset by peer", "Broken pipe",
                                          "remote process exited"};
  for (const char* pattern : kPeerLost) {
    if (what.find(pattern) == std::string::npos) continue;
    std::string peer;
    const size_t at = what.find("by peer [");
    if (at != std::string::npos) {
      const size_t end = what.find_first_of(" .", what.find(']', at));
      peer = " (" + what.substr(at + 8, end == std::string::npos ? end : end - at - 8) + ")";
    }
    return std::make_exception_ptr(
        PeerLostError("stopping because another rank failed first: " + describe(info) +
                      " lost its connection to a peer" + peer +
                      "; that rank's error, above or in its log, is the cause" +
                      (logging::enabled(logging::Level::kDebug)
                           ? " (" + backend_name + ": " + dtrain::detail::clause(what) + ")"
                           : std::string())));
  }
  return std::make_exception_ptr(
      CommError(describe(info) + " failed in " + backend_name + ": " + what));
}

namespace detail {

namespace {

int64_t ns_of(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

}  // namespace

// One clock reading per event (issue, start, end) serves the Work, the step timeline and the
// flight recorder: at a few KiB a reading is a tenth of what the collective itself costs.
WorkState::WorkState(CollectiveInfo info, std::chrono::milliseconds timeout)
    : info_(std::move(info)),
      timeout_(timeout),
      traced_(trace::enabled()),
      enqueued_(std::chrono::steady_clock::now()) {}

int64_t WorkState::enqueued_ns() const { return ns_of(enqueued_); }

void WorkState::record_trace() {
  auto us = [](std::chrono::steady_clock::time_point t) { return trace::to_us(ns_of(t)); };
  const int64_t enqueued = us(enqueued_);
  const int64_t started =
      started_ == std::chrono::steady_clock::time_point{} ? enqueued : us(started_);
  const int64_t finished = us(finished_);
  const int track = trace::track("comm " + std::to_string(info_.comm_id) + " (" +
                                 std::string(info_.backend) + ")");
  const int64_t bytes = info_.numel * static_cast<int64_t>(c10::elementSize(info_.dtype));
  std::string name = std::string(info_.op) + " #" + std::to_string(info_.seq);
  if (!info_.label.empty()) name = info_.label + ": " + name;
  trace::complete(
      name, "comm", track, started, finished,
      "\"op\":\"" + std::string(info_.op) + "\",\"dtype\":\"" + dtype_name(info_.dtype) +
          "\",\"elements\":" + std::to_string(info_.numel) + ",\"bytes\":" + std::to_string(bytes) +
          ",\"queued_us\":" + std::to_string(started - enqueued) +
          ",\"enqueued_ts\":" + std::to_string(enqueued) + ",\"seq\":" + std::to_string(info_.seq));
  trace::flow((info_.comm_id << 40) | info_.seq, trace::kMain, enqueued, track, started);
}

void WorkState::mark_started() {
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    started_ = now;
  }
  flight::started(flight_ticket, ns_of(now));
}

void WorkState::finish() {
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = now;
    done_ = true;
  }
  // Before waking the waiters: a trainer that waits for its last collective finds it recorded.
  flight::ended(flight_ticket, flight::State::kCompleted, ns_of(now));
  if (traced_) record_trace();
  completed_.store(true, std::memory_order_release);
  cv_.notify_all();
}

void WorkState::fail(std::exception_ptr error) {
  bool late;
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return;  // completed (or failed) already: its outcome stands
    error_ = std::move(error);
    finished_ = now;
    done_ = true;
    late = timed_out_;
  }
  flight::ended(flight_ticket, late ? flight::State::kTimedOut : flight::State::kFailed,
                ns_of(now));
  completed_.store(true, std::memory_order_release);
  cv_.notify_all();
}

void WorkState::time_out(const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (timed_out_ || done_) return;
    timed_out_ = true;
  }
  // The communicator breaks first: a waiter that wakes on the failure finds it broken.
  notify_break(message);
  fail(std::make_exception_ptr(TimeoutError(message)));
}

namespace {

std::string late_message(const CollectiveInfo& info, std::chrono::milliseconds timeout) {
  std::ostringstream msg;
  msg << describe(info) << " did not complete within " << timeout.count() / 1000.0 << " s on rank "
      << info.rank
      << ". Another rank skipped this collective, issued a different one, or died: check "
         "the other ranks' logs. If the op is legitimately slow, raise the timeout "
         "(parallel.timeout_s or DTRAIN_COMM_TIMEOUT_S).";
  return msg.str();
}

}  // namespace

void WorkState::wait(std::chrono::milliseconds timeout) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!done_ && stream_wait) {
      // NCCL: order the caller's stream after the op and return; the watchdog reports a
      // late or failed op through this state and the communicator.
      lock.unlock();
      stream_wait();
      return;
    }
  }
  synchronize(timeout);
}

namespace {
std::atomic<int64_t> g_wait_ns{0};
}  // namespace

void WorkState::synchronize(std::chrono::milliseconds timeout) {
  if (completed_.load(std::memory_order_acquire)) {
    if (error_) std::rethrow_exception(error_);
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  struct Count {
    std::chrono::steady_clock::time_point t0;
    ~Count() {
      g_wait_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::steady_clock::now() - t0)
                              .count(),
                          std::memory_order_relaxed);
    }
  } count{t0};
  spin_until([&] { return completed_.load(std::memory_order_acquire); }, spin_budget());
  std::unique_lock<std::mutex> lock(mu_);
  bool ok = cv_.wait_for(lock, timeout, [&] { return done_; });
  if (!ok) {
    bool first = !timed_out_;
    timed_out_ = true;
    lock.unlock();
    std::string msg = late_message(info_, timeout);
    if (first) {
      // This op fails for good (a later wait rethrows at once); then the communicator fails
      // every other pending op, since the ranks are out of step.
      fail(std::make_exception_ptr(TimeoutError(msg)));
      notify_break(msg);
    }
    DTRAIN_FAIL(TimeoutError, msg);
  }
  if (error_) std::rethrow_exception(error_);
}

bool WorkState::is_completed() const { return completed_.load(std::memory_order_acquire); }

double WorkState::busy_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!done_) return 0.0;
  if (device_seconds_ >= 0) return device_seconds_;
  if (started_ == std::chrono::steady_clock::time_point{}) return 0.0;
  return std::chrono::duration<double>(finished_ - started_).count();
}

void WorkState::set_busy_seconds(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  device_seconds_ = seconds;
}

}  // namespace detail

double host_wait_seconds() { return static_cast<double>(detail::g_wait_ns.load()) * 1e-9; }

void Work::wait() const {
  if (state_) state_->wait(state_->default_timeout());
}

void Work::wait(std::chrono::milliseconds timeout) const {
  if (state_) state_->wait(timeout);
}

void Work::synchronize() const {
  if (state_) state_->synchronize(state_->default_timeout());
}

bool Work::is_completed() const { return !state_ || state_->is_completed(); }

double Work::busy_seconds() const { return state_ ? state_->busy_seconds() : 0.0; }

CollectiveInfo Work::info() const { return state_ ? state_->info() : CollectiveInfo{}; }

}  // namespace dtrain::comm
