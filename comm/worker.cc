#include "comm/worker.h"

#include <exception>
#include <future>

#include "core/error.h"

namespace dtrain::comm {

OrderedWorker::OrderedWorker()
    : shared_(std::make_shared<Shared>()), thread_([s = shared_] { loop(s); }) {}

OrderedWorker::~OrderedWorker() { shutdown(std::chrono::hours(24 * 365)); }

void OrderedWorker::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    DTRAIN_CHECK_AS(CommError, !shared_->stop,
                    "a communicator's worker thread was used after it shut down (at process "
                    "exit?); create communicators before, and use them while, the program runs");
    shared_->queue.push_back(std::move(task));
  }
  shared_->cv.notify_one();
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
  std::unique_lock<std::mutex> lock(s->mu);
  while (true) {
    s->cv.wait(lock, [&] { return s->stop || !s->queue.empty(); });
    if (s->queue.empty()) break;
    auto task = std::move(s->queue.front());
    s->queue.pop_front();
    lock.unlock();
    task();  // tasks report their own failures through their WorkState
    lock.lock();
  }
  s->running = false;
  s->idle_cv.notify_all();
}

}  // namespace dtrain::comm
