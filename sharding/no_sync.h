// no_sync(): gradient accumulation without communication, for DDP and FSDP alike.
//
//   {
//     auto guard = model.no_sync();          // forwards and backwards keep gradients local
//     loss(model(micro[0])).backward();
//   }
//   loss(model(micro[1])).backward();        // this one reduces everything accumulated
//
// Under FSDP the accumulated gradients are unsharded (full size, param_dtype) until the
// synchronizing backward, as in PyTorch: the memory cost of accumulating without sync.
#pragma once

namespace dtrain::sharding {

// What a no_sync guard switches: DDP's Reducer and FSDP's state implement it.
class GradientSync {
 public:
  virtual ~GradientSync() = default;
  virtual bool require_sync() const = 0;
  virtual void set_require_sync(bool on) = 0;
};

// Turns gradient synchronization off for its lifetime, then restores what it found.
class NoSyncGuard {
 public:
  explicit NoSyncGuard(GradientSync& s) : sync_(&s), previous_(s.require_sync()) {
    s.set_require_sync(false);
  }
  NoSyncGuard(NoSyncGuard&& other) noexcept : sync_(other.sync_), previous_(other.previous_) {
    other.sync_ = nullptr;
  }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;
  ~NoSyncGuard() {
    if (sync_ != nullptr) sync_->set_require_sync(previous_);
  }

 private:
  GradientSync* sync_;
  bool previous_;
};

}  // namespace dtrain::sharding
