// OrderedWorker: one background thread that runs tasks in submission order.
//
// MPI and Gloo collectives must be issued in the same order on every rank, and the caller's
// thread must keep computing meanwhile (DDP overlaps all-reduce with backward); a FIFO on
// one thread gives both. A task that blocks forever (a peer never joined an MPI collective)
// cannot be interrupted: shutdown() waits a grace period and then leaves the thread behind,
// reporting that so the owner skips work that would need it (MPI_Finalize).
//
// Hand-off cost. A collective of a few KiB takes a microsecond or two in MPI's shared memory,
// about what a sleeping thread costs to wake. So the worker, its queue empty, polls it for up
// to spin_budget() before sleeping, and a Work's waiter polls for its completion as long (see
// work.h); both yield the core between polls, so on a machine with more threads than cores
// the spin costs little. DTRAIN_COMM_SPIN_US sets the budget (0: sleep at once).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace dtrain::comm {

// DTRAIN_COMM_SPIN_US, read once (default 50 us).
std::chrono::microseconds spin_budget();

// Polls `ready` for up to `budget`, yielding the core between polls; returns ready().
template <class Ready>
bool spin_until(Ready&& ready, std::chrono::microseconds budget) {
  if (ready()) return true;
  if (budget.count() <= 0) return false;
  const auto end = std::chrono::steady_clock::now() + budget;
  do {
    std::this_thread::yield();
    if (ready()) return true;
  } while (std::chrono::steady_clock::now() < end);
  return false;
}

// A move-only task whose callable lives inside it when it fits (a collective's closure does),
// so posting one allocates nothing: std::function would allocate per collective, and the
// worker thread would free it, which costs more than a small collective.
class Task {
 public:
  Task() = default;
  template <class F, class D = std::decay_t<F>,
            class = std::enable_if_t<!std::is_same_v<D, Task> && std::is_invocable_v<D&>>>
  Task(F&& f) {  // NOLINT(google-explicit-constructor): lambdas convert, as to std::function
    if constexpr (sizeof(D) <= kInline && alignof(D) <= alignof(std::max_align_t) &&
                  std::is_nothrow_move_constructible_v<D>) {
      new (buf_) D(std::forward<F>(f));
      ops_ = &kInlineOps<D>;
    } else {
      *reinterpret_cast<D**>(buf_) = new D(std::forward<F>(f));
      ops_ = &kHeapOps<D>;
    }
  }
  Task(Task&& other) noexcept : ops_(other.ops_) {
    if (ops_ != nullptr) ops_->move(other.buf_, buf_);
    other.ops_ = nullptr;
  }
  Task& operator=(Task&& other) noexcept {
    if (this != &other) {
      reset();
      ops_ = other.ops_;
      if (ops_ != nullptr) ops_->move(other.buf_, buf_);
      other.ops_ = nullptr;
    }
    return *this;
  }
  Task(const Task&) = delete;
  Task& operator=(const Task&) = delete;
  ~Task() { reset(); }

  void operator()() { ops_->call(buf_); }
  explicit operator bool() const { return ops_ != nullptr; }
  void reset() {
    if (ops_ != nullptr) ops_->destroy(buf_);
    ops_ = nullptr;
  }

 private:
  static constexpr size_t kInline = 112;
  struct Ops {
    void (*call)(void*);
    void (*move)(void* from, void* to);  // move-constructs at `to`, destroys `from`
    void (*destroy)(void*);
  };
  template <class D>
  static constexpr Ops kInlineOps = {[](void* p) { (*static_cast<D*>(p))(); },
                                     [](void* from, void* to) {
                                       new (to) D(std::move(*static_cast<D*>(from)));
                                       static_cast<D*>(from)->~D();
                                     },
                                     [](void* p) { static_cast<D*>(p)->~D(); }};
  template <class D>
  static constexpr Ops kHeapOps = {
      [](void* p) { (**static_cast<D**>(p))(); },
      [](void* from, void* to) { *static_cast<D**>(to) = *static_cast<D**>(from); },
      [](void* p) { delete *static_cast<D**>(p); }};

  alignas(std::max_align_t) unsigned char buf_[kInline];
  const Ops* ops_ = nullptr;
};

// The worker's FIFO: a ring of Tasks that grows by doubling and never shrinks, so a steady
// stream of collectives allocates nothing (std::deque allocates a block every few Tasks and
// frees it as they are taken, on the two threads in turn).
class TaskQueue {
 public:
  bool empty() const { return count_ == 0; }
  void push(Task task) {
    if (count_ == ring_.size()) grow();
    ring_[(head_ + count_) & (ring_.size() - 1)] = std::move(task);
    ++count_;
  }
  Task pop() {
    Task task = std::move(ring_[head_]);
    head_ = (head_ + 1) & (ring_.size() - 1);
    --count_;
    return task;
  }

 private:
  void grow() {
    std::vector<Task> bigger(ring_.empty() ? 64 : 2 * ring_.size());
    for (size_t i = 0; i < count_; ++i)
      bigger[i] = std::move(ring_[(head_ + i) & (ring_.size() - 1)]);
    ring_.swap(bigger);
    head_ = 0;
  }

  std::vector<Task> ring_;  // size 0 or a power of two
  size_t head_ = 0, count_ = 0;
};

class OrderedWorker {
 public:
  OrderedWorker();
  ~OrderedWorker();
  OrderedWorker(const OrderedWorker&) = delete;
  OrderedWorker& operator=(const OrderedWorker&) = delete;

  // Throws CommError after shutdown(): the task would never run.
  void post(Task task);

  // Runs `task` on the worker and waits for it (for setup calls that must be serialized
  // with the collectives). Rethrows what the task threw.
  void run_sync(std::function<void()> task);

  // Stops after the queue drains. Returns false, leaving the thread detached, if the queue
  // did not drain within `grace`.
  bool shutdown(std::chrono::milliseconds grace);

 private:
  // Co-owned by the thread, so a detached thread never touches a destroyed worker.
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    std::condition_variable idle_cv;
    TaskQueue queue;
    std::atomic<size_t> queued{0};  // queue.size(), for polling without the lock
    bool stop = false;
    bool running = true;
    bool sleeping = false;  // the thread waits on cv: post() must notify it
  };
  static void loop(std::shared_ptr<Shared> shared);

  std::shared_ptr<Shared> shared_;
  std::thread thread_;
};

}  // namespace dtrain::comm
