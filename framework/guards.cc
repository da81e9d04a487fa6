#include "framework/guards.h"

#include <ATen/ATen.h>

#include <cmath>
#include <sstream>

#include "core/error.h"
#include "core/logging.h"

namespace dtrain::framework {
namespace {

std::string collapse_advice() {
  return "Try precision.policy: bf16 (no loss scaling needed), a lower "
         "precision.scaler.init_scale, a lower train.lr, or fp32 for the unstable part "
         "(amp::CustomOpRegion).";
}

}  // namespace

void ScaleCollapseGuard::resume(int64_t skips, amp::NumericsMonitor& monitor) {
  skips_ = skips;
  if (skips_ > 0 && !monitor.enabled()) {
    monitor.set_enabled(true);
    switched_monitor_on_ = true;
  }
}

void ScaleCollapseGuard::after_step(int64_t step, bool stepped, double scale,
                                    amp::NumericsMonitor& monitor) {
  if (const auto& unit = monitor.first_nonfinite_unit()) last_unit_ = *unit;
  if (stepped) {
    skips_ = 0;
    if (switched_monitor_on_) {
      monitor.set_enabled(false);
      switched_monitor_on_ = false;
    }
  } else {
    ++skips_;
    if (!monitor.enabled()) {
      monitor.set_enabled(true);
      switched_monitor_on_ = true;
    }
  }
  if (scale < 1024 && !warned_) {
    warned_ = true;
    logging::warn("step ", step + 1, ": the loss scale fell to ", scale,
                  ", below 2^10: fp16 gradients are overflowing often. ", collapse_advice());
  }
  const bool too_small = scale < c_.min_scale;
  const bool too_many = c_.max_consecutive_skips > 0 && skips_ >= c_.max_consecutive_skips;
  if (!too_small && !too_many) return;
  std::ostringstream history;
  const auto& h = monitor.scale_history();
  for (size_t i = h.size() > 8 ? h.size() - 8 : 0; i < h.size(); ++i) {
    history << "step " << h[i].first + 1 << ": " << h[i].second << (i + 1 < h.size() ? ", " : "");
  }
  DTRAIN_FAIL(Error, "step ", step + 1, ": the loss scale collapsed (",
              too_small ? detail::str("scale ", scale, " is below precision.scaler.min_scale ",
                                      c_.min_scale)
                        : detail::str(skips_,
                                      " steps skipped in a row, precision.scaler."
                                      "max_consecutive_skips: ",
                                      c_.max_consecutive_skips),
              "); stopping. The first unit with an inf/NaN: ",
              last_unit_.empty() ? std::string("none recorded") : last_unit_,
              ". Recent scales: ", history.str(), ". ", collapse_advice());
}

void NonFiniteLossGuard::after_steps(int64_t first_step, const std::vector<double>& losses,
                                     comm::Communicator* comm,
                                     const amp::NumericsMonitor& monitor) {
  if (losses.empty()) return;
  std::vector<double> flags;
  for (double loss : losses) flags.push_back(std::isfinite(loss) ? 0.0 : 1.0);
  at::Tensor bad = at::tensor(flags, at::TensorOptions(at::kDouble));
  if (comm != nullptr && comm->size() > 1) {
    bad = bad.to(comm->device());
    comm->all_reduce(bad, comm::ReduceOp::kMax).wait();
    bad = bad.cpu();
  }
  const double* verdict = bad.data_ptr<double>();
  for (size_t i = 0; i < losses.size(); ++i) {
    judge(first_step + static_cast<int64_t>(i), losses[i], verdict[i] > 0, monitor);
  }
}

void NonFiniteLossGuard::judge(int64_t step, double loss, bool bad,
                               const amp::NumericsMonitor& monitor) {
  run_ = bad ? run_ + 1 : 0;
  if (run_ < c_.max_nonfinite_steps) return;
  const auto& unit = monitor.first_nonfinite_unit();
  DTRAIN_FAIL(Error, "step ", step + 1, ": the loss is not finite (this rank's: ", loss, ") for ",
              run_, " consecutive step(s) (train.max_nonfinite_steps: ", c_.max_nonfinite_steps,
              "); stopping. ",
              unit ? "The first unit with an inf/NaN: " + *unit + ". "
                   : std::string("logging.numerics: true names the first unit with an inf/NaN. "),
              "Try a lower train.lr, train.clip_grad_norm, or fp32 for the unstable part.");
}

}  // namespace dtrain::framework
