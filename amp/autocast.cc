#include "amp/autocast.h"

#include <ATen/autocast_mode.h>

#include "comm/types.h"
#include "core/error.h"

namespace dtrain::amp {

AutocastGuard::AutocastGuard(c10::DeviceType device, std::optional<c10::ScalarType> dtype,
                             bool enabled, bool cache_enabled)
    : device_(device) {
  DTRAIN_CHECK_AS(UsageError, device == c10::kCPU || device == c10::kCUDA, "AutocastGuard: device ",
                  device, " is not supported (cpu or cuda)");
  c10::ScalarType target = dtype.value_or(at::autocast::get_autocast_dtype(device));
  DTRAIN_CHECK_AS(UsageError, !enabled || target == c10::kBFloat16 || target == c10::kHalf,
                  "AutocastGuard: ", device, " autocast runs in bf16 or fp16, not ",
                  comm::dtype_name(target), "; use enabled=false for an fp32 region");
  prev_enabled_ = at::autocast::is_autocast_enabled(device);
  prev_dtype_ = at::autocast::get_autocast_dtype(device);
  prev_cache_enabled_ = at::autocast::is_autocast_cache_enabled();
  at::autocast::set_autocast_enabled(device, enabled);
  at::autocast::set_autocast_dtype(device, target);
  at::autocast::increment_nesting();
  at::autocast::set_autocast_cache_enabled(cache_enabled);
}

AutocastGuard::AutocastGuard(AutocastGuard&& other) noexcept
    : device_(other.device_),
      active_(other.active_),
      prev_enabled_(other.prev_enabled_),
      prev_dtype_(other.prev_dtype_),
      prev_cache_enabled_(other.prev_cache_enabled_) {
  other.active_ = false;
}

AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_, prev_enabled_);
  at::autocast::set_autocast_dtype(device_, prev_dtype_);
  at::autocast::set_autocast_cache_enabled(prev_cache_enabled_);
}

bool autocast_enabled(c10::DeviceType device) { return at::autocast::is_autocast_enabled(device); }

c10::ScalarType autocast_dtype(c10::DeviceType device) {
  return at::autocast::get_autocast_dtype(device);
}

CustomOpRegion::CustomOpRegion(c10::DeviceType device, c10::ScalarType cast_to)
    : device_(device),
      cast_to_(cast_to),
      cast_(at::autocast::is_autocast_enabled(device)),
      off_(AutocastGuard::disabled(device)) {}

at::Tensor CustomOpRegion::cast(const at::Tensor& t) const {
  if (!cast_ || !t.defined() || !t.is_floating_point() || t.device().type() != device_) return t;
  return t.to(cast_to_);
}

}  // namespace dtrain::amp
