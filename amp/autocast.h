// AutocastGuard: RAII over LibTorch's autocast state, with the semantics of Python's
// `torch.autocast(device_type, dtype, enabled, cache_enabled)`:
//   - entering saves the device's enabled flag and dtype and the cache flag, then sets them;
//   - guards nest: the innermost wins, and each exit restores what its entry saw;
//   - the cache of low-precision casts of fp32 leaf weights is cleared when the outermost
//     region exits (so an optimizer step between iterations never meets stale casts);
//   - enabled=false opens an fp32 region inside an autocast region.
// LibTorch keeps this state per thread, so a guard covers only its own thread.
//
// Where Python warns and disables autocast for a dtype the device cannot autocast to, the
// guard throws UsageError (CPU and CUDA take bf16 and fp16).
//
// CustomOpRegion gives C++ ops the effect of `custom_fwd(cast_inputs=dtype)`: inside it,
// autocast is off, and `cast()` converts floating inputs to the dtype if autocast was on
// when the region opened.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace dtrain::amp {

class AutocastGuard {
 public:
  // dtype unset: the device's current autocast dtype (CPU bf16, CUDA fp16 by default).
  explicit AutocastGuard(c10::DeviceType device, std::optional<c10::ScalarType> dtype = {},
                         bool enabled = true, bool cache_enabled = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

  static AutocastGuard disabled(c10::DeviceType device) {
    return AutocastGuard(device, std::nullopt, /*enabled=*/false);
  }
  AutocastGuard(AutocastGuard&& other) noexcept;

 private:
  c10::DeviceType device_;
  bool active_ = true;
  bool prev_enabled_;
  c10::ScalarType prev_dtype_;
  bool prev_cache_enabled_;
};

// Whether autocast is on for `device` on this thread.
bool autocast_enabled(c10::DeviceType device);
c10::ScalarType autocast_dtype(c10::DeviceType device);

class CustomOpRegion {
 public:
  CustomOpRegion(c10::DeviceType device, c10::ScalarType cast_to);

  // `t` cast to the region's dtype when autocast was on at entry and `t` is a floating
  // tensor on the region's device; otherwise `t` unchanged.
  at::Tensor cast(const at::Tensor& t) const;
  bool casting() const { return cast_; }

 private:
  c10::DeviceType device_;
  c10::ScalarType cast_to_;
  bool cast_;
  AutocastGuard off_;
};

}  // namespace dtrain::amp
