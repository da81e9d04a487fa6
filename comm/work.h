// Work: the handle a collective returns. Backends complete it from their own thread (MPI and
// Gloo: an ordered worker; NCCL: a watchdog polling CUDA events); `wait()` blocks the caller
// until then and rethrows the backend's failure.
//
// A waiter polls for completion for up to DTRAIN_COMM_SPIN_US (default 50 us) before it
// sleeps, so a small collective's result is seen without a thread wake-up (worker.h).
//
// A wait never hangs: past its timeout it throws TimeoutError naming the collective, its
// sequence number on the communicator, dtype, element count and the ranks involved, and it
// tells the communicator, which then refuses further collectives (the ranks are out of step).
#pragma once

#include <c10/core/ScalarType.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::comm {

// What a collective was, for messages and statistics.
struct CollectiveInfo {
  // `op` and `backend` view NUL-terminated strings that live as long as the process
  // (literals, or comm::interned_name's), so a Work, the flight recorder (which keeps the
  // pointer alone) and a late message may keep them without a copy per collective.
  std::string_view op;  // "all_reduce", "reduce_scatter", ...
  int64_t seq = 0;      // 1-based count of collectives issued on this communicator
  c10::ScalarType dtype = c10::kFloat;
  int64_t numel = 0;
  std::string_view backend;
  int rank = 0;  // this process's rank in the communicator
  // Members, as world ranks (the communicator's list, shared by all its collectives).
  std::shared_ptr<const std::vector<int>> ranks;
  // For the step timeline (core/trace.h): which communicator of this process, and what issued
  // the collective ("ddp bucket 3"; empty when not traced or unlabelled).
  int64_t comm_id = 0;
  std::string label;
};

// "all_reduce #17 (bf16, 1048576 elements) on ranks [0,1,2,3] (mpi)"
std::string describe(const CollectiveInfo& info);

// Seconds this process's threads have spent blocked in Work::wait/synchronize, in total: what
// a rank waited for its peers (and the network). The trainer's straggler report subtracts it
// from the step time. NCCL's wait() does not block the host, so it counts only synchronize().
double host_wait_seconds();

// A backend's failure `what` as the error a user reads: PeerLostError when it says a peer
// closed or reset its connection (the consequence of another rank's failure: that rank's
// error is the one to read), else CommError. Both name the collective.
std::exception_ptr backend_failure(const CollectiveInfo& info, const std::string& backend_name,
                                   const std::string& what);

namespace detail {

// Shared between the backend that completes a collective and the Works that wait for it.
class WorkState {
 public:
  WorkState(CollectiveInfo info, std::chrono::milliseconds timeout);

  void mark_started();
  void finish();
  void fail(std::exception_ptr error);
  // Fails with TimeoutError(message) and tells the communicator (on_break), once. For
  // backends that detect lateness themselves (NCCL's watchdog).
  void time_out(const std::string& message);

  // Makes the result visible to the caller: blocks until completion or timeout (MPI, Gloo),
  // or orders the caller's CUDA stream after the op (NCCL). On timeout calls on_break
  // (once) and throws.
  void wait(std::chrono::milliseconds timeout);
  // Blocks the host until the op completed on every backend (NCCL too), or times out.
  void synchronize(std::chrono::milliseconds timeout);
  bool is_completed() const;

  const CollectiveInfo& info() const { return info_; }
  std::chrono::milliseconds default_timeout() const { return timeout_; }
  // When it was issued (this state's construction): the steady clock's nanoseconds.
  int64_t enqueued_ns() const;
  // Seconds the backend spent executing the collective (0 until completed).
  double busy_seconds() const;
  // Backends that time the op on the device (NCCL: CUDA events) report it here; it replaces
  // the host-clock figure.
  void set_busy_seconds(double seconds);

  // Called once if a wait times out (the communicator marks itself broken). One handler per
  // communicator, shared by its collectives (no allocation per collective).
  using BreakHandler = std::function<void(const std::string&)>;
  std::shared_ptr<const BreakHandler> on_break;
  void notify_break(const std::string& why) const {
    if (on_break && *on_break) (*on_break)(why);
  }
  // NCCL: instead of blocking the host, make the caller's current stream wait for the op
  // (c10d's semantics). Called by wait() while the op is still running on the device; once
  // completed, wait() returns at once.
  std::function<void()> stream_wait;
  // This collective's entry in the flight recorder (comm/flight_recorder.h); -1: none.
  int64_t flight_ticket = -1;

 private:
  CollectiveInfo info_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::atomic<bool> completed_{false};  // done_, readable without the lock (polling, is_completed)
  bool timed_out_ = false;
  std::exception_ptr error_;
  std::chrono::steady_clock::time_point started_{}, finished_{};
  double device_seconds_ = -1;
  // Submitted while the step timeline was recording: finish() records the op.
  bool traced_ = false;
  std::chrono::steady_clock::time_point enqueued_;
  void record_trace();
};

}  // namespace detail

class Work {
 public:
  // A default Work is already complete (what a zero-element collective returns).
  Work() = default;
  explicit Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

  // Waits with the communicator's timeout. Throws the backend's error or TimeoutError.
  // Under NCCL the host does not block: the caller's current CUDA stream waits instead, as
  // with c10d's Work::wait. MPI and Gloo block the host.
  void wait() const;
  void wait(std::chrono::milliseconds timeout) const;
  // Blocks the host until the op completed, on every backend (e.g. before reading its
  // device-side duration).
  void synchronize() const;
  bool is_completed() const;
  // Seconds the backend spent executing the collective (0 until completed / for no-ops).
  double busy_seconds() const;
  // Description of the collective; empty op for a no-op Work.
  CollectiveInfo info() const;

 private:
  std::shared_ptr<detail::WorkState> state_;
};

}  // namespace dtrain::comm
