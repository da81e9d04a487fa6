// Checkpoints of a training run: written atomically, verified on load, exact on resume, and
// readable by Python.
//
// One directory per checkpoint, <checkpoint.dir>/step_<00000100>/:
//   model.pt        full: every parameter and buffer by the unwrapped module's name, fp32
//                   (rank 0, written on a thread while the optimizer state is gathered).
//                   torch.load(weights_only=True) reads it; a PyTorch module of the same
//                   architecture loads it with load_state_dict.
//   optim.pt        full: the optimizer state in PyTorch's layout ({"state": {index: {"step",
//                   "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}), gathered likewise
//   shard_<r>.pt    sharded (FSDP): rank r's flat master shard and optimizer-state shards of
//                   every unit; meta.json holds the layout, so a checkpoint written at N ranks
//                   loads at M (each rank reads what old shards hold of its new range)
//   scaler.pt       the GradScaler's state_dict, PyTorch's keys (rank 0)
//   rank_<r>.pt     every rank: its RNG states (CPU, CUDA) and the numerics monitor's history
//   meta.json       rank 0, after every rank's files: format, step, world size, strategy,
//                   mode, the parameters (names, shapes, dtypes), the units' layout, every
//                   file's size and checksum (xxh64), and the trainer's state (step, skipped
//                   steps, data position, learning rate)
//   COMPLETE        rank 0, last, after every rank reported its files: meta.json's size and
//                   checksum. A directory without it is not a checkpoint (a crash mid-write).
// Every file is written to a temporary name, fsynced, renamed, and its directory fsynced. On
// load every file's size and checksum are verified (a flipped byte or a truncated file is
// refused, naming the file), and every tensor's name, shape and dtype is checked against the
// model before a parameter is touched (a mismatch names the tensor and loads nothing).
//
// Resume: the trainer's data, learning rate and schedules are functions of the step, so the
// step plus the state above makes the continuation bitwise equal to an uninterrupted run
// (fp32, same world size). checkpoint.keep newest complete checkpoints are kept.
//
// Collective: every rank calls save() and restore() together. The checkpoint directory must
// be on a filesystem every rank sees (one node: any; several: a shared one).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "framework/config.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}
namespace dtrain::comm {
class Communicator;
}
namespace dtrain::amp {
class GradScaler;
class NumericsMonitor;
}  // namespace dtrain::amp
namespace dtrain::sharding {
class FSDPState;
}

namespace dtrain::framework {

// What a checkpoint saves and restores. `module` always; `fsdp` when the model is FSDP's
// (then the parameters are its masters, the module only contributes buffers).
struct CheckpointParts {
  torch::nn::Module* module = nullptr;
  sharding::FSDPState* fsdp = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  amp::GradScaler* scaler = nullptr;
  amp::NumericsMonitor* monitor = nullptr;
  comm::Communicator* comm = nullptr;  // null: one process
};

struct TrainerProgress {
  int64_t step = 0;  // optimizer steps completed
  int64_t skipped_steps = 0;
  double lr = 0;
  int64_t consecutive_skips = 0;  // the scale-collapse guard's count
  int64_t nonfinite_run = 0;      // steps with a non-finite loss in a row (no scaler)
};

// A module's parameters and buffers by name, as a torch.save file Python's
// `module.load_state_dict(torch.load(path, weights_only=True))` reads; and back: a PyTorch
// `state_dict()` saved with torch.save loads into a dtrain module of the same architecture
// (every name and shape checked before anything is copied).
void save_state_dict(torch::nn::Module& module, const std::string& path);
void load_state_dict(torch::nn::Module& module, const std::string& path);

class Checkpointer {
 public:
  // `config` is the run's (dir, format, keep); `source` names the config in messages.
  Checkpointer(RunConfig config);

  bool enabled() const { return !config_.checkpoint.dir.empty(); }
  // Writes step_<progress.step>/ (collective) and prunes to checkpoint.keep. Returns its path.
  std::string save(const CheckpointParts& parts, const TrainerProgress& progress);
  // Loads what `resume` names ("auto": the newest complete checkpoint in checkpoint.dir that
  // reads back intact, warning about any newer damaged one, which is kept; "never"; or a
  // checkpoint directory) into `parts` (collective: rank 0's choice is everyone's, and a file
  // damaged on one rank is reported by every rank). Returns the progress to continue from,
  // or nothing when starting fresh.
  std::optional<TrainerProgress> restore(const CheckpointParts& parts, const std::string& resume);

  // The newest directory under `dir` that holds a complete checkpoint.
  static std::optional<std::string> newest_complete(const std::string& dir);

 private:
  // restore_from, with a failure on any rank reported on every rank (agreed before anything
  // is applied).
  std::optional<TrainerProgress> restore_agreed(const CheckpointParts& parts,
                                                const std::string& dir);
  std::optional<TrainerProgress> restore_from(const CheckpointParts& parts, const std::string& dir);
  RunConfig config_;
};

}  // namespace dtrain::framework
