// Numerics monitor: answers "why did my fp16 run blow up" without print statements.
//
// At each unit boundary (a DDP module's output, an FSDP unit, a gradient bucket) the owner
// calls record(unit, tensor). When enabled, it keeps per-unit statistics for the current
// step: max |x|, the share of finite values above fp16's largest finite value (65504), the
// share of nonzero values below fp16's smallest normal (6.1035e-5, where fp16 loses
// precision and then flushes to zero), and the count of inf/NaN; and it remembers the first
// unit of the step that produced a non-finite value. It also records the loss scale's
// trajectory. Off by default; when off, record() is a branch and nothing else.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::amp {

struct TensorStats {
  int64_t numel = 0;
  double max_abs = 0;                 // over finite values
  double frac_above_fp16_max = 0;     // |x| > 65504, among finite values
  double frac_below_fp16_normal = 0;  // 0 < |x| < 6.1035e-5, among finite values
  int64_t nonfinite = 0;              // inf or NaN
};

constexpr double kFp16Max = 65504.0;
constexpr double kFp16MinNormal = 6.103515625e-05;

// The statistics above for one tensor (a few reductions; a host sync).
TensorStats tensor_stats(const at::Tensor& t);

class NumericsMonitor {
 public:
  explicit NumericsMonitor(bool enabled = false) : enabled_(enabled) {}

  bool enabled() const { return enabled_; }
  void set_enabled(bool on) { enabled_ = on; }

  // Starts a new step: forgets the previous step's unit records.
  void begin_step(int64_t step);
  // Records `t`'s statistics under `unit` (nothing when disabled).
  void record(const std::string& unit, const at::Tensor& t);
  // Appends the loss scale after `step` to the scale history.
  void record_scale(int64_t step, double scale);

  int64_t step() const { return step_; }
  const std::vector<std::pair<std::string, TensorStats>>& records() const { return records_; }
  // The first unit this step whose tensor held an inf or NaN.
  const std::optional<std::string>& first_nonfinite_unit() const { return first_nonfinite_; }
  const std::vector<std::pair<int64_t, double>>& scale_history() const { return scales_; }
  // A resumed run continues the history its checkpoint saved.
  void restore_scale_history(std::vector<std::pair<int64_t, double>> h) { scales_ = std::move(h); }

  // A table of this step's records, for the log.
  std::string report() const;

 private:
  bool enabled_;
  int64_t step_ = 0;
  std::vector<std::pair<std::string, TensorStats>> records_;
  std::optional<std::string> first_nonfinite_;
  std::vector<std::pair<int64_t, double>> scales_;
};

}  // namespace dtrain::amp
