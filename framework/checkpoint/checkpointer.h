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
//                   Under tensor parallelism both hold the whole tensors, so a checkpoint of
//                   one mesh (dp x tp) restores at another.
//   shard_<r>.pt    sharded (FSDP): rank r's flat master shard and optimizer-state shards of
//                   every unit; meta.json holds the layout, so a checkpoint written at N ranks
//                   loads at M (each rank reads what old shards hold of its new range)
//   scaler.pt       the GradScaler's state_dict, PyTorch's keys (rank 0)
//   rank_<r>.pt     every rank: its RNG states (CPU, CUDA) and the numerics monitor's history
//   meta.json       rank 0, after every rank's files: format, step, world size, strategy,
//                   mode, the parameters (names, shapes, dtypes), the units' layout, every
//                   file's size and checksum (xxh64), and the trainer's state (step, skipped
//                   steps, data position, learning rate)
//   COMPLETE        rank 0, last, after every rank listed its files (files_<r>.txt, removed
//                   then): meta.json's size and checksum. A directory without it is not a
//                   checkpoint (a crash mid-write).
// Every file is written to a temporary name, fsynced, renamed, and its directory fsynced. On
// load every file's size and checksum are verified (a flipped byte or a truncated file is
// refused, naming the file), and every tensor's name, shape and dtype is checked against the
// model before a parameter is touched (a mismatch names the tensor and loads nothing).
//
// Resume: the trainer's data, learning rate and schedules are functions of the step, so the
// step plus the state above makes the continuation bitwise equal to an uninterrupted run
// (fp32, same world size). checkpoint.keep newest complete checkpoints are kept.
//
// Asynchronous (checkpoint.async, as PyTorch DCP's async_save): save() blocks only while the
// state is copied into staging buffers (pinned host memory for GPU tensors, reused by every
// save); the files are pickled, checksummed, fsynced and committed on a thread while training
// goes on. The ranks then meet through the files alone (each rank's list of what it wrote),
// never through the communicator training uses. A save due while the previous one is still
// writing waits for it (and the log says how long); a crash mid-write leaves the previous
// complete checkpoint, exactly as a crash of a synchronous save.
//
// What the run trains on (set_job: the data's and tokenizer's fingerprints, the model, the
// mesh) goes into meta.json. A restore refuses, with a ConfigError naming what changed, a
// checkpoint of other data or another tokenizer (unless checkpoint.allow_data_change) or of
// another model (names and shapes of its parameters), before anything is read or changed.
//
// Collective: every rank calls save() and restore() together. The checkpoint directory must
// be on a filesystem every rank sees (one node: any; several: a shared one).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "framework/checkpoint/progress.h"
#include "framework/config.h"

namespace at {
class Tensor;
}

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
class Reducer;
class TensorParallelism;
}  // namespace dtrain::sharding

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
  // Tensor parallelism: the parameters (and their optimizer state) are this rank's slices. A
  // full checkpoint holds the whole tensors (gathered over the TP group, collectively) and a
  // restore takes this rank's slices of them, so it restores at any tp. Sharded ones are
  // refused under TP.
  const sharding::TensorParallelism* tp = nullptr;
  // DDP: its rebuilt bucket order goes into every rank's rank_<r>.pt and comes back on a
  // resume at the same world size, so the resumed run sums in the same order (bitwise).
  sharding::Reducer* ddp = nullptr;
};

// A module's parameters and buffers by name, as a torch.save file Python's
// `module.load_state_dict(torch.load(path, weights_only=True))` reads; and back: a PyTorch
// `state_dict()` saved with torch.save loads into a dtrain module of the same architecture
// (every name and shape checked before anything is copied).
void save_state_dict(torch::nn::Module& module, const std::string& path);
void load_state_dict(torch::nn::Module& module, const std::string& path);

// The model's tensors in the checkpoint `dir`, whole and by name, whatever its format: a full
// checkpoint's model.pt, or a sharded one's parameters put together from every shard file as
// its meta.json lays them out (fp32) and its buffers. Every file is verified. For a trained
// model used without its training setup (dtrain-generate).
std::vector<std::pair<std::string, at::Tensor>> read_model_tensors(const std::string& dir);

class Checkpointer {
 public:
  // `config` is the run's (dir, format, keep, async); `source` names the config in messages.
  Checkpointer(RunConfig config);
  ~Checkpointer();  // waits for a save still being written
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  bool enabled() const { return !config_.checkpoint.dir.empty(); }
  // What the run trains on, by key ("data", "tokenizer", "model", "mesh"), for meta.json and
  // the checks of restore().
  void set_job(std::map<std::string, std::string> job) { job_ = std::move(job); }
  // Writes step_<progress.step>/ (collective) and prunes to checkpoint.keep. Returns its path.
  // Under checkpoint.async and with `background`, returns once the state is staged and writes
  // the files on a thread (after waiting for the previous save); otherwise the checkpoint is
  // complete on return.
  std::string save(const CheckpointParts& parts, const TrainerProgress& progress,
                   bool background = true);
  // Waits for the save being written, if any; rethrows its failure. Seconds waited.
  double finish();
  // Bytes of the staging buffers (checkpoint.async), once a save has staged.
  int64_t staging_bytes() const;
  // After restore(): whether the checkpoint was trained on other data or another tokenizer
  // (resumed so under checkpoint.allow_data_change).
  bool data_changed() const { return data_changed_; }
  // After restore(): the checkpoint directory it restored.
  const std::string& restored_dir() const { return restored_dir_; }
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
  // The refusals of set_job's comment, from the checkpoint's metadata (the same on every rank).
  void check_same_job(
      const CheckpointParts& parts, const std::string& dir,
      const std::map<std::string, std::string>& saved_job,
      const std::vector<std::pair<std::string, std::vector<int64_t>>>& saved_params);
  struct Staged;
  struct Async;
  Staged stage(const CheckpointParts& parts, const TrainerProgress& progress,
               std::map<std::string, at::Tensor>* buffers) const;
  void write(const Staged& staged) const;
  RunConfig config_;
  std::map<std::string, std::string> job_;
  bool data_changed_ = false;
  std::string restored_dir_;
  std::unique_ptr<Async> async_;
};

}  // namespace dtrain::framework
