#include "comm/work.h"

#include <sstream>

#include "comm/types.h"
#include "core/error.h"

namespace dtrain::comm {

std::string describe(const CollectiveInfo& info) {
  std::ostringstream os;
  os << info.op << " #" << info.seq << " (" << dtype_name(info.dtype) << ", " << info.numel
     << " elements) on ranks [";
  for (size_t i = 0; i < info.ranks.size(); ++i) os << (i ? "," : "") << info.ranks[i];
  os << "] (" << info.backend << ")";
  return os.str();
}

namespace detail {

WorkState::WorkState(CollectiveInfo info, std::chrono::milliseconds timeout)
    : info_(std::move(info)), timeout_(timeout) {}

void WorkState::mark_started() {
  std::lock_guard<std::mutex> lock(mu_);
  started_ = std::chrono::steady_clock::now();
}

void WorkState::finish() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = std::chrono::steady_clock::now();
    done_ = true;
  }
  cv_.notify_all();
}

void WorkState::fail(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_) error_ = std::move(error);
    finished_ = std::chrono::steady_clock::now();
    done_ = true;
  }
  cv_.notify_all();
}

void WorkState::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  bool ok = cv_.wait_for(lock, timeout, [&] { return done_; });
  if (!ok) {
    bool first = !timed_out_;
    timed_out_ = true;
    lock.unlock();
    std::ostringstream msg;
    msg << describe(info_) << " did not complete within " << timeout.count() / 1000.0
        << " s on rank " << info_.rank
        << ". Another rank skipped this collective, issued a different one, or died: check "
           "the other ranks' logs. If the op is legitimately slow, raise the timeout "
           "(parallel.timeout_s or DTRAIN_COMM_TIMEOUT_S).";
    if (first && on_timeout) on_timeout(msg.str());
    DTRAIN_FAIL(TimeoutError, msg.str());
  }
  if (error_) std::rethrow_exception(error_);
  lock.unlock();
  if (after_wait) after_wait();
}

bool WorkState::is_completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

double WorkState::busy_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!done_ || started_ == std::chrono::steady_clock::time_point{}) return 0.0;
  return std::chrono::duration<double>(finished_ - started_).count();
}

}  // namespace detail

void Work::wait() const {
  if (state_) state_->wait(state_->default_timeout());
}

void Work::wait(std::chrono::milliseconds timeout) const {
  if (state_) state_->wait(timeout);
}

bool Work::is_completed() const { return !state_ || state_->is_completed(); }

double Work::busy_seconds() const { return state_ ? state_->busy_seconds() : 0.0; }

CollectiveInfo Work::info() const { return state_ ? state_->info() : CollectiveInfo{}; }

}  // namespace dtrain::comm
