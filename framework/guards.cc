#include "framework/guards.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <set>
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

std::vector<SpikeGuard::Spike> SpikeGuard::after_steps(int64_t first_step,
                                                       const std::vector<double>& losses,
                                                       const std::vector<bool>& stepped,
                                                       comm::Communicator* comm) {
  std::vector<Spike> found;
  if (!on() || losses.empty()) return found;
  // The mean over the ranks (a rank's non-finite loss makes it non-finite): every rank judges
  // the same numbers, so every rank takes the same decision.
  at::Tensor agreed = at::tensor(losses, at::TensorOptions(at::kDouble));
  if (comm != nullptr && comm->size() > 1) {
    agreed = agreed.to(comm->device());
    comm->all_reduce(agreed, comm::ReduceOp::kSum).wait();
    agreed = agreed.cpu() / static_cast<double>(comm->size());
  }
  const double* loss = agreed.data_ptr<double>();
  for (size_t i = 0; i < losses.size(); ++i) {
    const int64_t step = first_step + static_cast<int64_t>(i);
    if (!stepped[i]) continue;  // the loss scaler skipped it
    const bool judged = static_cast<int64_t>(record_.history.size()) >= kMinHistory;
    const double med = judged ? median() : 0;
    const bool spike = !std::isfinite(loss[i]) || (judged && loss[i] > c_.factor * med);
    if (!spike) {
      record_.streak = record_.streak_start = 0;
      record_.history.emplace_back(step, loss[i]);
      if (static_cast<int64_t>(record_.history.size()) > c_.window) {
        record_.history.erase(record_.history.begin());
      }
      continue;
    }
    if (record_.streak == 0) record_.streak_start = step;
    ++record_.streak;
    if (record_.streak != c_.steps) continue;  // once per run of spike steps
    found.push_back(Spike{record_.streak_start, step, loss[i], med});
    if (rolls_back()) break;
  }
  return found;
}

double SpikeGuard::median() const {
  std::vector<double> v;
  v.reserve(record_.history.size());
  for (const auto& h : record_.history) v.push_back(h.second);
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int64_t SpikeGuard::data_step(int64_t step) const {
  int64_t d = step;
  for (int64_t skipped : record_.skipped_batches) {  // ascending
    if (skipped <= d) ++d;
  }
  return d;
}

std::vector<int64_t> SpikeGuard::roll_back_past(const Spike& spike) {
  std::vector<int64_t> batches;
  for (int64_t step = spike.first; step <= spike.last; ++step)
    batches.push_back(data_step(step - 1));
  skip(batches);
  record_.spikes.emplace_back(spike.first, spike.last);
  const auto rollbacks = static_cast<int64_t>(record_.spikes.size());
  DTRAIN_CHECK(rollbacks <= c_.max_rollbacks, "the loss keeps spiking: ", rollbacks,
               " spikes, over ", spikes_text(), ", one more than train.spike_guard.max_rollbacks (",
               c_.max_rollbacks,
               ") allows; stopping. The batches of every spike were skipped, so the data alone "
               "does not explain it: try a lower train.lr, a longer train.warmup_steps or "
               "train.clip_grad_norm");
  return batches;
}

void SpikeGuard::resume(const SpikeRecord& saved, bool rollback) {
  SpikeRecord kept = record_;
  record_ = saved;
  if (rollback) {
    record_.skipped_batches = kept.skipped_batches;
    record_.spikes = kept.spikes;
  }
}

void SpikeGuard::skip_batches(int64_t first, int64_t count) {
  std::vector<int64_t> batches;
  for (int64_t d = first; d < first + count; ++d) batches.push_back(d);
  skip(batches);
}

void SpikeGuard::skip(const std::vector<int64_t>& data_steps) {
  std::set<int64_t> skipped(record_.skipped_batches.begin(), record_.skipped_batches.end());
  skipped.insert(data_steps.begin(), data_steps.end());
  record_.skipped_batches.assign(skipped.begin(), skipped.end());
}

std::string SpikeGuard::spikes_text() const {
  std::string out = "steps ";
  for (size_t i = 0; i < record_.spikes.size(); ++i) {
    const auto& [first, last] = record_.spikes[i];
    out += (i ? ", " : "") + std::to_string(first) +
           (last > first ? "-" + std::to_string(last) : std::string());
  }
  return out;
}

}  // namespace dtrain::framework
