// The trainer's own state that a checkpoint carries besides the model, the optimizer and the
// scaler (meta.json's "trainer" object), kept free of LibTorch so the format's parser
// (meta.h) and the trainer share it.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace dtrain::framework {

// The loss-spike guard's state (framework/guards.h SpikeGuard), so a resumed run judges,
// skips and stops where an uninterrupted one would.
struct SpikeRecord {
  // The agreed loss of the last train.spike_guard.window judged steps that were not spikes:
  // (1-based step, loss), oldest first.
  std::vector<std::pair<int64_t, double>> history;
  // Judged steps in a row above the threshold, and the first of them (1-based; 0: none).
  int64_t streak = 0;
  int64_t streak_start = 0;
  // Batches never to train on again (0-based data steps, ascending): training step s takes the
  // s-th data step not listed (SpikeGuard::data_step).
  std::vector<int64_t> skipped_batches;
  // Every spike rolled back past: its first and last step (1-based).
  std::vector<std::pair<int64_t, int64_t>> spikes;
};

// Where a data stream stands between two samples: the epoch, and how many positions of that
// epoch's global order (the permutation the ranks stride through, framework/data.h) lie
// behind it. The same on every rank and meaningful at any world size: a run resumed at
// another one continues from it, so every sample of the epoch is still drawn once.
struct DataPosition {
  int64_t epoch = 0;
  int64_t position = 0;  // in [0, the source's sample count)
};

struct TrainerProgress {
  int64_t step = 0;  // optimizer steps completed
  int64_t skipped_steps = 0;
  double lr = 0;
  int64_t consecutive_skips = 0;  // the scale-collapse guard's count
  int64_t nonfinite_run = 0;      // steps with a non-finite loss in a row (no scaler)
  SpikeRecord spike = {};
  // Where the data stood before data step `data_step` (the next step's, past any skipped
  // batches); absent for data that follows from the step alone, in checkpoints written before
  // it was kept, and on a resume onto other data (checkpoint.allow_data_change).
  std::optional<DataPosition> data = std::nullopt;
  int64_t data_step = 0;
};

}  // namespace dtrain::framework
