#include "comm/worker.h"

#include <algorithm>
#include <exception>
#include <future>

#include "core/env.h"
#include "core/error.h"

namespace dtrain::comm {

std::chrono::microseconds spin_budget() {
  static const std::chrono::microseconds budget{
      std::max(0L, env_int(process_env(), "DTRAIN_COMM_SPIN_US", 50))};
  return budget;
}

OrderedWorker::OrderedWorker()
    : shared_(std::make_shared<Shared>()), thread_([s = shared_] { loop(s); }) {}

OrderedWorker::~OrderedWorker() { shutdown(std::chrono::hours(24 * 365)); }

void OrderedWorker::post(Task task) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    DTRAIN_CHECK_AS(CommError, !shared_->stop,
                    "a communicator's worker thread was used after it shut down (at process "
                    "exit?); create communicators before, and use them while, the program runs");
    shared_->queue.push(std::move(task));
    shared_->queued.fetch_add(1, std::memory_order_release);
    wake = shared_->sleeping;
  }
  if (wake) shared_->cv.notify_one();  // a polling thread finds the task itself
}

void OrderedWorker::run_sync(std::function<void()> task) {
  std::promise<void> done;
  auto future = done.get_future();
  post([&] {
    try {
      task();
      done.set_value();
    } catch (...) {
      done.set_exception(std::current_exception());
    }
  });
  future.get();
}

bool OrderedWorker::shutdown(std::chrono::milliseconds grace) {
  if (!thread_.joinable()) return true;
  std::unique_lock<std::mutex> lock(shared_->mu);
  shared_->stop = true;
  shared_->cv.notify_all();
  bool drained = shared_->idle_cv.wait_for(lock, grace, [&] { return !shared_->running; });
  lock.unlock();
  if (drained) {
    thread_.join();
  } else {
    thread_.detach();
  }
  return drained;
}

void OrderedWorker::loop(std::shared_ptr<Shared> s) {
  const std::chrono::microseconds spin = spin_budget();
  std::unique_lock<std::mutex> lock(s->mu);
  while (true) {
    if (s->queue.empty() && !s->stop) {
      lock.unlock();
      spin_until([&] { return s->queued.load(std::memory_order_acquire) > 0; }, spin);
      lock.lock();
      s->sleeping = true;
      s->cv.wait(lock, [&] { return s->stop || !s->queue.empty(); });
      s->sleeping = false;
    }
    if (s->queue.empty()) break;
    Task task = s->queue.pop();
    s->queued.fetch_sub(1, std::memory_order_relaxed);
    lock.unlock();
    task();        // tasks report their own failures through their WorkState
    task.reset();  // its captures (tensors) go before the next poll
    lock.lock();
  }
  s->running = false;
  s->idle_cv.notify_all();
}

}  // namespace dtrain::comm
