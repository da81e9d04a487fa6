// Guards: the checks that stop a run which trains nothing while looking alive.
//   - ScaleCollapseGuard (loss scaling on): the scale keeps halving because the gradients
//     overflow whatever it is, so every step is skipped.
//   - NonFiniteLossGuard (loss scaling off): nothing skips a step whose loss is inf/NaN, so
//     the parameters are corrupt on every rank after it.
// Both raise dtrain::Error naming the step, what they saw, the first unit with an inf/NaN
// (amp::NumericsMonitor) and what to try. They judge steps when the trainer reads the steps'
// figures (at each logged step and checkpoint, and after every step once one went wrong), so
// a run stops there, naming the step where the limit was reached. Their counts travel in
// checkpoints (TrainerProgress), so a resumed run stops where the uninterrupted one would.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "amp/numerics.h"
#include "comm/communicator.h"
#include "framework/config.h"

namespace dtrain::framework {

// After the first skipped step the numerics monitor is switched on (if it was off), so that
// the error can name the unit that went non-finite first; it goes back off after a step that
// stepped. Warns once when the scale falls below 2^10.
class ScaleCollapseGuard {
 public:
  explicit ScaleCollapseGuard(const ScalerConfig& c) : c_(c) {}

  // Steps skipped in a row, for checkpoints; resume() takes it back (with the monitor on, as
  // after_step would have left it).
  int64_t skips() const { return skips_; }
  void resume(int64_t skips, amp::NumericsMonitor& monitor);

  // After each step (0-based `step`): whether it stepped, and the scale for the next one.
  void after_step(int64_t step, bool stepped, double scale, amp::NumericsMonitor& monitor);

 private:
  const ScalerConfig& c_;
  int64_t skips_ = 0;
  bool warned_ = false;
  bool switched_monitor_on_ = false;
  std::string last_unit_;
};

// Stops after train.max_nonfinite_steps steps in a row whose loss was not finite on some rank.
// Every rank takes the same decision (the verdict is all-reduced).
class NonFiniteLossGuard {
 public:
  explicit NonFiniteLossGuard(const TrainConfig& c) : c_(c) {}

  // Non-finite steps in a row, for checkpoints; resume() takes it back.
  int64_t run() const { return run_; }
  void resume(int64_t run) { run_ = run; }

  // After steps first_step, first_step + 1, ... (0-based) with this rank's loss for each, in
  // order. Collective: one all-reduce for all of them.
  void after_steps(int64_t first_step, const std::vector<double>& losses, comm::Communicator* comm,
                   const amp::NumericsMonitor& monitor);

 private:
  void judge(int64_t step, double loss, bool bad, const amp::NumericsMonitor& monitor);

  const TrainConfig& c_;
  int64_t run_ = 0;
};

}  // namespace dtrain::framework
