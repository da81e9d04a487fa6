// Trainer: the dtype-agnostic training loop, driven by a RunConfig.
//
// Two ways in:
//   - train(config, comm): the model and data the config names (model.type transformer or
//     mlp; what dtrain-train runs);
//   - train(module, data, loss, config, comm): any module of the user's, with the user's data
//     and loss function (model.type: custom; the config's model section is not used). This is
//     PyTorch Lightning's Trainer.fit or HF's Trainer for dtrain: the loop below, the
//     strategy, precision, logging and checkpoints all come from the config.
//
// Per step: zero_grad(set_to_none) -> for each micro-batch (all but the last under DDP's
// no_sync): forward under autocast (the policy's param_dtype; off for fp32) -> loss /
// micro_batches -> scaler.scale(loss).backward() -> scaler.unscale_ -> clip_grad_norm_ ->
// scaler.step (skipped on inf/NaN) -> scaler.update -> LR schedule (linear warmup, cosine
// to 10%). One loop serves fp32, bf16 and fp16: a disabled GradScaler passes through.
//
// Nothing in a step reads a value back to the host (a GPU stream never waits for the CPU):
// the loss, gradient norm, loss scale and the scaler's verdict stay on the device, and the
// loop reads them all at once when it logs or checkpoints, and after every step once a step
// was skipped or its loss was not finite (until one is clean again). The guards judge them
// then, step by step. train_step(), for a loop of the caller's, reads each step's at once.
//
// Every logging.every_steps it logs loss (mean over ranks), loss scale, gradient norm,
// skipped steps, tokens/s, step time and peak memory, writes the same as a JSON line to
// logging.metrics_file (rank 0), and redraws a progress bar on rank 0's terminal.
//
// Strategies (framework/strategy.h): none (one process), ddp (autocast in param_dtype, reduce
// in reduce_dtype), fsdp (sharded parameters in param_dtype, the ShardedGradScaler for fp16,
// clipping over shards). The guards (framework/guards.h) stop a run whose loss or loss scale
// went bad; the end-of-run report is framework/report.h. docs/architecture.md follows one
// step through these layers.
//
// A user's module: a torch::nn::ModuleHolder (TORCH_MODULE) whose forward takes one tensor,
// Batch::inputs, and returns one tensor, the `output` the loss function receives. It is moved
// to the config's `device` first, where the batches go. Under DDP
// rank 0's initial parameters are broadcast, under FSDP they are synced too
// (sync_module_states), so ranks may construct the module from different seeds. Under FSDP
// the module's auto-wrap points (sharding/fsdp.h) decide the units; without any, the whole
// module is one unit. The loss runs under the same autocast as the forward: return it in
// fp32 (`output.to(at::kFloat)` first), as PyTorch's autocast does for its losses.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "amp/numerics.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "core/faults.h"
#include "framework/checkpoint/checkpointer.h"
#include "framework/config.h"
#include "framework/data.h"
#include "framework/guards.h"
#include "framework/metrics.h"
#include "framework/preemption.h"
#include "framework/strategy.h"
#include "framework/task.h"

namespace dtrain::framework {

struct TrainResult {
  int64_t steps = 0;
  // A signal (framework/preemption.h) stopped the run after `steps`, saved: exit with
  // kRequeueExitCode. 0: it ran to train.steps.
  int preempted_by = 0;
  int64_t skipped_steps = 0;
  double first_loss = 0;  // mean over ranks, first logged step
  double last_loss = 0;   // mean over ranks, last step
  double final_scale = 1;
};

// The process's communicator as the config says (parallel.backend, parallel.timeout_s, or
// DTRAIN_COMM_TIMEOUT_S; the rank from dtrain-launch, mpirun or srun), with logging set up for
// this rank (logging.level, logging.all_ranks). Null for strategy none on one process.
std::shared_ptr<comm::Communicator> connect(const RunConfig& config);

// Trains the model the config names. `comm` may be null for strategy none on one process.
TrainResult train(const RunConfig& config, std::shared_ptr<comm::Communicator> comm);

// One optimizer step's figures, as train_step returns them.
struct StepStats {
  int64_t step = 0;      // 1-based: the step just taken
  double loss = 0;       // this rank's loss, summed over the micro-batches
  double grad_norm = 0;  // before clipping
  double lr = 0;
  double scale_used = 1;  // the loss scale the step ran at
  double scale = 1;       // the loss scale after the step's update (for the next step)
  bool stepped = true;    // false: inf/NaN gradients, the optimizer step was skipped
  double seconds = 0;
  // train.spike_guard rolled the run back past a loss spike while reading these figures: the
  // run is at `step` now (the checkpoint's), and steps_done() says so too.
  bool rolled_back = false;
};

// The training loop (what both train()s run). setup() builds the strategy, optimizer and
// scaler, restores a checkpoint and opens the metrics file; train_step() takes one optimizer
// step over train.micro_batches micro-batches, reads its figures and applies the guards (a
// host read per step); train() steps to
// train.steps with validation, logging, checkpoints and the trace, then reports. Every rank
// constructs one and calls the same methods in the same order.
class Trainer {
 public:
  Trainer(const RunConfig& config, std::shared_ptr<comm::Communicator> comm, Task task,
          std::unique_ptr<BatchSource> data);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  void setup();
  StepStats train_step();
  TrainResult train();

  // Optimizer steps taken (restored ones included).
  int64_t steps_done() const { return step_; }
  Strategy& strategy() { return *model_; }

 private:
  // A step's figures while they are on the device.
  struct PendingStep {
    int64_t step = 0;  // 1-based
    double lr = 0;
    double seconds = 0;
    at::Tensor figures;  // fp64 {loss, grad_norm, scale_used, found_inf, scale after}
  };
  // One optimizer step, nothing read back.
  PendingStep run_step();
  // Reads the pending steps' figures in one transfer and judges them in order (guards, skip
  // warnings, the log window); returns the last one's. Collective when the scaler is off.
  StepStats settle();
  bool trouble() const;
  // train.spike_guard's rollback past `spike`: back to this run's newest checkpoint, its
  // batches skipped from now on. Collective.
  void resume_data(const TrainerProgress& p);
  void roll_back(const SpikeGuard::Spike& spike);
  std::string spike_text(const SpikeGuard::Spike& spike) const;

  CheckpointParts checkpoint_parts();
  amp::AutocastGuard autocast() const;
  at::Tensor to_device(const at::Tensor& t) const;
  at::Tensor forward_loss(const Batch& b);
  double validation_loss();
  void restore();
  void log_step(const StepStats& s, std::optional<double> val_loss);
  bool language_model() const;
  std::string perplexity_text(double val_loss) const;
  void save_checkpoint(const StepStats& s, bool background = true);
  // The agreed stop on a signal: saves within checkpoint.on_signal and marks the result.
  void stop_on_signal(int sig, const StepStats& s, bool saved_already);
  std::map<std::string, std::string> job_record() const;
  void show_progress(int64_t step, bool logged);
  void report();

  const RunConfig& c_;
  std::shared_ptr<comm::Communicator> comm_;
  Task task_;
  std::unique_ptr<BatchSource> data_;
  int rank_ = 0, world_ = 1;
  c10::DeviceType device_ = c10::kCPU;
  bool tty_ = false;
  bool autocast_ = false;

  amp::NumericsMonitor monitor_;
  std::unique_ptr<Strategy> model_;
  std::unique_ptr<torch::optim::Optimizer> opt_;
  std::unique_ptr<amp::GradScaler> scaler_;
  Checkpointer checkpointer_;
  std::optional<MetricsFile> metrics_;
  ScaleCollapseGuard collapse_;
  NonFiniteLossGuard nonfinite_;
  SpikeGuard spike_;
  std::optional<faults::StepRank> kill_at_, nan_from_, stop_at_, slow_;
  std::optional<faults::Range> bad_batches_;
  std::unique_ptr<StopAgreement> stop_;  // checkpoint.on_signal: when to stop, agreed

  int64_t step_ = 0;        // steps done
  int64_t first_step_ = 0;  // where this process started (a restored step, or 0)
  // The collective check (comm/communicator.h) is on by default through setup and this many
  // steps after first_step_, while the schedule settles (DDP rebuilds its buckets after the
  // first step); DTRAIN_COMM_CHECK=1 keeps it on, 0 off.
  static constexpr int64_t kCheckedSteps = 2;
  bool checking_calls_ = false;
  TrainResult result_;
  bool first_logged_ = false;
  double window_loss_ = 0, window_time_ = 0;  // since the last logged step
  double window_wait_ = 0;                    // of window_time_, blocked in collective waits
  int64_t window_steps_ = 0;
  std::vector<PendingStep> pending_;  // taken, not yet read
  bool settle_each_step_ = false;     // the last step read was skipped or not finite
  // train.spike_guard rollback: a checkpoint due inside a possible spike waits for the first
  // step that is not one (so every checkpoint precedes any spike), and the newest checkpoint
  // of this run (the one a rollback goes back to).
  bool save_owed_ = false;
  std::string newest_checkpoint_;
  // Progress without a terminal (logging.progress_bar): a line when this long has passed
  // since the last line rank 0 printed.
  std::chrono::steady_clock::time_point train_start_, last_line_;
};

// Trains the user's `module` on `data` with `loss`, as `config` says (model.type: custom).
// `description` names the model in the log and the metrics file ("custom" if empty).
template <typename M>
TrainResult train(M module, std::unique_ptr<BatchSource> data, LossFn loss, const RunConfig& config,
                  std::shared_ptr<comm::Communicator> comm, std::string description = "") {
  DTRAIN_CHECK_AS(ConfigError, config.model.custom(), config.source, ": model.type is '",
                  config.model.type,
                  "', but this run passes its own model to framework::train: set model.type: "
                  "custom");
  DTRAIN_CHECK_AS(ConfigError, data != nullptr && loss != nullptr,
                  "framework::train: the data source and the loss function must not be null");
  // The config's device is the run's: the batches go there, so the module goes there too
  // (a module left on the CPU under `device: cuda` would fail inside its first forward).
  module->to(torch_device(config.device));
  int64_t n = 0;
  for (const auto& p : module->parameters()) n += p.numel();
  if (description.empty()) description = "custom";
  description += " " + std::to_string(n) + " parameters";
  Task task;
  task.make_strategy = [&](amp::NumericsMonitor* monitor) {
    return make_strategy(std::move(module), comm, config, monitor);
  };
  task.loss = std::move(loss);
  task.description = std::move(description);
  return Trainer(config, comm, std::move(task), std::move(data)).train();
}

}  // namespace dtrain::framework
