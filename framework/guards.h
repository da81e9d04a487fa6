// Guards: the checks that stop a run which trains nothing while looking alive.
//   - ScaleCollapseGuard (loss scaling on): the scale keeps halving because the gradients
//     overflow whatever it is, so every step is skipped.
//   - NonFiniteLossGuard (loss scaling off): nothing skips a step whose loss is inf/NaN, so
//     the parameters are corrupt on every rank after it.
//   - SpikeGuard (train.spike_guard): the loss jumps far above where it was and stays there;
//     it warns, or has the trainer roll back past the spike and skip its batches.
// The first two raise dtrain::Error naming the step, what they saw, the first unit with an inf/NaN
// (amp::NumericsMonitor) and what to try. They judge steps when the trainer reads the steps'
// figures (at each logged step and checkpoint, and after every step once one went wrong), so
// a run stops there, naming the step where the limit was reached. Their counts travel in
// checkpoints (TrainerProgress), so a resumed run stops where the uninterrupted one would.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "amp/numerics.h"
#include "comm/communicator.h"
#include "framework/checkpoint/progress.h"
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

// Loss spikes (train.spike_guard). Each step's loss is agreed over the ranks (their mean)
// and judged in order: a spike step's loss is above `factor` times the median of the history
// (the last `window` steps that were not spike steps; judged once it holds kMinHistory), or is
// not finite on a step that stepped (a step a loss scaler skipped is the scaler's business and
// is not judged). `steps` spike steps in a row make a spike. The state travels in checkpoints
// (SpikeRecord), so a resumed run judges as the uninterrupted one would.
//
// The data: training step s trains on the s-th data step not in the skipped batches
// (data_step), so skipping a spike's batches shifts the rest of the stream, in order, and no
// other batch is lost or repeated.
class SpikeGuard {
 public:
  static constexpr int64_t kMinHistory = 5;

  struct Spike {
    int64_t first = 0;  // the first and last step of the run above the threshold (1-based)
    int64_t last = 0;
    double loss = 0;    // the agreed loss at `last`
    double median = 0;  // the history's median it was judged against
  };

  explicit SpikeGuard(const SpikeGuardConfig& c) : c_(c) {}

  bool on() const { return c_.action != SpikeAction::kOff; }
  bool rolls_back() const { return c_.action == SpikeAction::kRollback; }
  // Inside a run of spike steps that may yet become a spike (a checkpoint now could hold it).
  bool in_streak() const { return record_.streak > 0; }
  int64_t streak_start() const { return record_.streak_start; }
  const SpikeRecord& record() const { return record_; }

  // Steps first_step, first_step + 1, ... (1-based), with this rank's loss and whether the
  // step stepped. Collective: one all-reduce for all of them. Returns each spike found, when
  // its `steps`-th step is judged; under rollback the first one ends the judging (the steps
  // after it are rolled back with it).
  std::vector<Spike> after_steps(int64_t first_step, const std::vector<double>& losses,
                                 const std::vector<bool>& stepped, comm::Communicator* comm);

  // The data step (0-based) that training step `step` (0-based) trains on.
  int64_t data_step(int64_t step) const;

  // Before the rollback past `spike`: records it and skips the batches of its steps; returns
  // those data steps (0-based). Error naming every spike's steps when this one is more than
  // max_rollbacks allow.
  std::vector<int64_t> roll_back_past(const Spike& spike);
  // A restored checkpoint's state. `rollback`: the checkpoint is the one rolled back to, so
  // this run's skipped batches and spikes (newer than it) stay; otherwise (a resume) the
  // checkpoint's replace them.
  void resume(const SpikeRecord& saved, bool rollback);
  // Batches skipped before any step (a test's reference run: a run that never saw them).
  void skip_batches(int64_t first, int64_t count);

  // "steps 12-13, 40-41"
  std::string spikes_text() const;

 private:
  double median() const;
  // Adds `data_steps` to the skipped batches, kept ascending and without repeats.
  void skip(const std::vector<int64_t>& data_steps);

  const SpikeGuardConfig& c_;
  SpikeRecord record_;
};

}  // namespace dtrain::framework
