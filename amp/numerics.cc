#include "amp/numerics.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cstdio>
#include <sstream>

namespace dtrain::amp {

TensorStats tensor_stats(const at::Tensor& t) {
  c10::NoGradGuard no_grad;
  TensorStats s;
  s.numel = t.numel();
  if (s.numel == 0) return s;
  at::Tensor x = t.detach().to(at::kFloat).abs().reshape({-1});
  at::Tensor finite = at::isfinite(x);
  int64_t n_finite = finite.sum().item<int64_t>();
  s.nonfinite = s.numel - n_finite;
  if (n_finite == 0) return s;
  at::Tensor f = x.masked_select(finite);
  s.max_abs = f.max().item<double>();
  s.frac_above_fp16_max = (f > kFp16Max).sum().item<double>() / n_finite;
  s.frac_below_fp16_normal = ((f > 0) & (f < kFp16MinNormal)).sum().item<double>() / n_finite;
  return s;
}

void NumericsMonitor::begin_step(int64_t step) {
  step_ = step;
  records_.clear();
  first_nonfinite_.reset();
}

void NumericsMonitor::record(const std::string& unit, const at::Tensor& t) {
  if (!enabled_) return;
  TensorStats s = tensor_stats(t);
  if (s.nonfinite > 0 && !first_nonfinite_) first_nonfinite_ = unit;
  records_.emplace_back(unit, s);
}

void NumericsMonitor::record_scale(int64_t step, double scale) {
  if (!enabled_) return;
  scales_.emplace_back(step, scale);
}

std::string NumericsMonitor::report() const {
  std::ostringstream os;
  char line[256];
  std::snprintf(line, sizeof(line), "%-32s %12s %10s %10s %10s\n", "unit", "max|x|", ">fp16max",
                "<fp16norm", "nonfinite");
  os << "numerics at step " << step_ << "\n" << line;
  for (const auto& [unit, s] : records_) {
    std::snprintf(line, sizeof(line), "%-32s %12.4g %9.4f%% %9.4f%% %10lld\n", unit.c_str(),
                  s.max_abs, 100 * s.frac_above_fp16_max, 100 * s.frac_below_fp16_normal,
                  static_cast<long long>(s.nonfinite));
    os << line;
  }
  if (first_nonfinite_) os << "first non-finite value produced by: " << *first_nonfinite_ << "\n";
  return os.str();
}

}  // namespace dtrain::amp
