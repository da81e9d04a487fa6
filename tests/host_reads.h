// HostReads: counts what makes the host wait for a device, while it lives:
//   - reads of tensor values that code outside ATen makes (item(), which every
//     tensor-to-number conversion runs, and nonzero, whose output size the host must learn),
//     on any thread;
//   - with a CUDA LibTorch, every synchronizing CUDA call c10 reports in its sync debug mode
//     (torch.cuda.set_sync_debug_mode("warn")) on the thread that made the HostReads: a
//     blocking copy between host and GPU, a stream or device synchronization, a read.
// A training step that should never wait shows none; where() names the first waits (the read,
// or the outermost ATen op running when a synchronizing call was made) for a failure message.
// The reads are counted through ATen's RecordFunction observers, the hook PyTorch's profiler uses,
// so they are seen whoever makes them: dtrain's code, a user's loss, LibTorch's C++ API. Reads an
// ATen kernel makes inside itself are not counted (the CPU fused AdamW reads its CPU step counts;
// the CUDA kernel reads them on the device).
#pragma once

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#ifdef DTRAIN_TORCH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace dtrain::testing {

class HostReads {
 public:
  HostReads() : previous_(c10::WarningUtils::get_warning_handler()) {
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(&HostReads::enter, &HostReads::leave)
                                        .scopes({at::RecordScope::FUNCTION}));
    count() = 0;
#ifdef DTRAIN_TORCH_CUDA
    sync_handler_.previous = previous_;
    c10::WarningUtils::set_warning_handler(&sync_handler_);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
#endif
  }
  ~HostReads() {
#ifdef DTRAIN_TORCH_CUDA
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    c10::WarningUtils::set_warning_handler(previous_);
#endif
    at::removeCallback(handle_);
  }
  HostReads(const HostReads&) = delete;
  HostReads& operator=(const HostReads&) = delete;

  // Waits since construction or the last reset().
  int64_t reads() const { return count().load(); }
  void reset() {
    count() = 0;
    std::lock_guard<std::mutex> lock(log_mutex());
    log().clear();
  }
  // The first waits counted, as "aten::item" or "sync in aten::copy_", comma-separated.
  std::string where() const {
    std::lock_guard<std::mutex> lock(log_mutex());
    std::string out;
    for (const auto& w : log()) out += (out.empty() ? "" : ", ") + w;
    return out.empty() ? "none" : out;
  }

 private:
  static std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& fn) {
    const std::string_view name = fn.name();
    if (depth() == 0 &&
        (name == "aten::item" || name == "aten::_local_scalar_dense" || name == "aten::nonzero")) {
      count().fetch_add(1);
      note(std::string(name));
    }
    if (depth() == 0) outermost() = name;
    ++depth();
    return nullptr;
  }
  static void leave(const at::RecordFunction& /*fn*/, at::ObserverContext* /*ctx*/) { --depth(); }
  // Ops being run on this thread: an op inside another is ATen's own.
  static int& depth() {
    thread_local int d = 0;
    return d;
  }
  // The outermost op this thread entered last (a name RecordFunction keeps for the process).
  static std::string_view& outermost() {
    thread_local std::string_view name;
    return name;
  }
  static void note(std::string what) {
    std::lock_guard<std::mutex> lock(log_mutex());
    if (log().size() < 8) log().push_back(std::move(what));
  }
  static std::mutex& log_mutex() {
    static std::mutex m;
    return m;
  }
  static std::vector<std::string>& log() {
    static std::vector<std::string> l;
    return l;
  }
  static std::atomic<int64_t>& count() {
    static std::atomic<int64_t> n{0};
    return n;
  }

  // c10's sync debug warnings on the owner's thread counted (a communicator's thread staging
  // CUDA tensors through the host waits by design); any other warning goes where it went.
  struct SyncWarnings : c10::WarningHandler {
    c10::WarningHandler* previous = nullptr;
    std::thread::id owner = std::this_thread::get_id();
    void process(const c10::Warning& w) override {
      if (w.msg().find("synchronizing CUDA operation") != std::string::npos &&
          std::this_thread::get_id() == owner) {
        count().fetch_add(1);
        note("sync in " + (depth() > 0 ? std::string(outermost()) : std::string("no ATen op")));
      } else if (previous != nullptr) {
        previous->process(w);
      }
    }
  };

  c10::WarningHandler* previous_;
  SyncWarnings sync_handler_;
  at::CallbackHandle handle_ = 0;
};

}  // namespace dtrain::testing
