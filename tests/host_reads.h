// HostReads: counts the reads of tensor values back to the host (item(), which every
// tensor-to-number conversion runs, and nonzero, whose output size the host must learn) that
// code outside ATen makes, while it lives, on any thread. On a GPU each one waits for the
// stream, so a training step that should never wait shows none. Counted through ATen's
// RecordFunction observers, the hook PyTorch's profiler uses, so it sees every caller: dtrain's
// code, a user's loss, LibTorch's C++ API. Reads an ATen kernel makes inside itself are not
// counted (the CPU fused AdamW reads its CPU step counts; the CUDA kernel reads them on the
// device).
#pragma once

#include <ATen/record_function.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string_view>

namespace dtrain::testing {

class HostReads {
 public:
  HostReads() {
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(&HostReads::enter, &HostReads::leave)
                                        .scopes({at::RecordScope::FUNCTION}));
    count() = 0;
  }
  ~HostReads() { at::removeCallback(handle_); }
  HostReads(const HostReads&) = delete;
  HostReads& operator=(const HostReads&) = delete;

  // Reads since construction or the last reset().
  int64_t reads() const { return count().load(); }
  void reset() { count() = 0; }

 private:
  static std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& fn) {
    const std::string_view name = fn.name();
    if (depth() == 0 &&
        (name == "aten::item" || name == "aten::_local_scalar_dense" || name == "aten::nonzero")) {
      count().fetch_add(1);
    }
    ++depth();
    return nullptr;
  }
  static void leave(const at::RecordFunction& /*fn*/, at::ObserverContext* /*ctx*/) { --depth(); }
  // Ops being run on this thread: an op inside another is ATen's own.
  static int& depth() {
    thread_local int d = 0;
    return d;
  }
  static std::atomic<int64_t>& count() {
    static std::atomic<int64_t> n{0};
    return n;
  }

  at::CallbackHandle handle_ = 0;
};

}  // namespace dtrain::testing
