// OrderedWorker: one background thread that runs tasks in submission order.
//
// MPI and Gloo collectives must be issued in the same order on every rank, and the caller's
// thread must keep computing meanwhile (DDP overlaps all-reduce with backward); a FIFO on
// one thread gives both. A task that blocks forever (a peer never joined an MPI collective)
// cannot be interrupted: shutdown() waits a grace period and then leaves the thread behind,
// reporting that so the owner skips work that would need it (MPI_Finalize).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace dtrain::comm {

class OrderedWorker {
 public:
  OrderedWorker();
  ~OrderedWorker();
  OrderedWorker(const OrderedWorker&) = delete;
  OrderedWorker& operator=(const OrderedWorker&) = delete;

  // Throws CommError after shutdown(): the task would never run.
  void post(std::function<void()> task);

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
    std::deque<std::function<void()>> queue;
    bool stop = false;
    bool running = true;
  };
  static void loop(std::shared_ptr<Shared> shared);

  std::shared_ptr<Shared> shared_;
  std::thread thread_;
};

}  // namespace dtrain::comm
