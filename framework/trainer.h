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
// Every logging.every_steps it logs loss (mean over ranks), loss scale, gradient norm,
// skipped steps, tokens/s, step time and peak memory, writes the same as a JSON line to
// logging.metrics_file (rank 0), and redraws a progress bar on rank 0's terminal.
//
// Strategies: none (one process), ddp (autocast in param_dtype, reduce in reduce_dtype), fsdp
// (sharded parameters in param_dtype, the ShardedGradScaler for fp16, clipping over shards).
//
// A user's module: a torch::nn::ModuleHolder (TORCH_MODULE) whose forward takes one tensor,
// Batch::inputs, and returns one tensor, the `output` the loss function receives. Under DDP
// rank 0's initial parameters are broadcast, under FSDP they are synced too
// (sync_module_states), so ranks may construct the module from different seeds. Under FSDP
// the module's auto-wrap points (sharding/fsdp.h) decide the units; without any, the whole
// module is one unit. The loss runs under the same autocast as the forward: return it in
// fp32 (`output.to(at::kFloat)` first), as PyTorch's autocast does for its losses.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "amp/numerics.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "framework/config.h"
#include "framework/data.h"
#include "sharding/clip_grad.h"
#include "sharding/ddp.h"
#include "sharding/fsdp.h"

namespace dtrain::framework {

struct TrainResult {
  int64_t steps = 0;
  int64_t skipped_steps = 0;
  double first_loss = 0;  // mean over ranks, first logged step
  double last_loss = 0;   // mean over ranks, last step
  double final_scale = 1;
};

// The loss of one micro-batch from the module's output: a scalar tensor, the mean over the
// batch (the trainer divides by micro_batches itself).
using LossFn = std::function<at::Tensor(const at::Tensor& output, const Batch& batch)>;

// The process's communicator as the config says (parallel.backend, parallel.timeout_s, or
// DTRAIN_COMM_TIMEOUT_S; the rank from dtrain-launch, mpirun or srun), with logging set up for
// this rank (logging.level, logging.all_ranks). Null for strategy none on one process.
std::shared_ptr<comm::Communicator> connect(const RunConfig& config);

// Trains the model the config names. `comm` may be null for strategy none on one process.
TrainResult train(const RunConfig& config, std::shared_ptr<comm::Communicator> comm);

namespace internal {

// The model behind a uniform forward and loss: plain, DDP or FSDP.
class Model {
 public:
  virtual ~Model() = default;
  virtual at::Tensor loss(const Batch& b) = 0;
  // Validation: the loss summed over the batch's items, and how many items (means over the
  // whole validation set are then the same at any world size).
  virtual std::pair<at::Tensor, double> loss_sum(const Batch& b) = 0;
  // What the optimizer steps: the module's parameters, or FSDP's fp32 master shards.
  virtual std::vector<at::Tensor> parameters() = 0;
  virtual std::optional<sharding::NoSyncGuard> no_sync() = 0;
  virtual const sharding::ReducerStats* stats() const = 0;
  // Clips to max_norm (> 0) or only measures; the norm of the whole model's gradients.
  virtual double clip_grad_norm(double max_norm) = 0;
  // DDP and plain modules compute in param_dtype under autocast; FSDP's parameters already
  // have it.
  virtual bool uses_autocast() const = 0;
  // The unwrapped module, and FSDP's state when sharded (for checkpoints).
  virtual torch::nn::Module& module() = 0;
  virtual sharding::FSDPState* fsdp() = 0;
  // The output for `inputs` (no loss), through the wrapper: every rank must call it alike.
  virtual at::Tensor logits(const at::Tensor& inputs) = 0;
  // The loss scaler, for DDP to unscale gradients as it writes them back
  // (DDPOptions::grad_scaler). FSDP and plain modules leave that to the scaler.
  virtual void use_grad_scaler(amp::GradScaler* scaler) = 0;
};

// Cross-entropy in fp32 over the last dimension (classes or vocabulary): the config models'
// loss, and a ready LossFn for users.
at::Tensor cross_entropy(const at::Tensor& output, const Batch& batch);

// A module holder M wrapped as the config's strategy says.
template <typename M>
class Wrapped : public Model {
 public:
  Wrapped(M module, std::shared_ptr<comm::Communicator> comm, const RunConfig& c,
          amp::NumericsMonitor* monitor, LossFn loss, bool sum_is_cross_entropy)
      : monitor_(monitor), loss_(std::move(loss)), ce_sum_(sum_is_cross_entropy) {
    const auto& p = c.parallel;
    if (comm && p.strategy == "ddp") {
      sharding::DDPOptions o;
      o.bucket_cap_mb(p.bucket_cap_mb)
          .find_unused_parameters(p.find_unused_parameters)
          .broadcast_buffers(p.broadcast_buffers)
          .reduce_dtype(c.precision.mixed.effective_reduce_dtype())
          .monitor(monitor);
      ddp_.emplace(std::move(module), std::move(comm), o);
    } else if (comm && p.strategy == "fsdp") {
      sharding::FSDPOptions o;
      o.sharding_strategy(sharding::parse_sharding_strategy(p.sharding_strategy))
          .mixed_precision(c.precision.mixed)
          .auto_wrap(
              sharding::AutoWrapPolicy().module_types(p.wrap_modules).min_params(p.wrap_min_params))
          .forward_prefetch(p.forward_prefetch)
          .backward_prefetch(p.backward_prefetch)
          .limit_all_gathers(p.limit_all_gathers)
          .hybrid_group_size(p.hybrid_group_size)
          .monitor(monitor);
      fsdp_.emplace(std::move(module), std::move(comm), o);
    } else {
      plain_ = std::move(module);
    }
  }

  at::Tensor logits(const at::Tensor& inputs) override {
    return ddp_ ? ddp_->forward(inputs) : fsdp_ ? fsdp_->forward(inputs) : plain_->forward(inputs);
  }
  at::Tensor loss(const Batch& b) override {
    at::Tensor out = logits(b.inputs);
    if (monitor_ != nullptr) monitor_->record("model.output", out);
    return loss_(out, b);
  }
  std::pair<at::Tensor, double> loss_sum(const Batch& b) override {
    at::Tensor out = logits(b.inputs);
    if (ce_sum_) {  // per token: the mean over every target of the set
      at::Tensor flat = out.to(at::kFloat);
      flat = flat.reshape({-1, flat.size(-1)});
      return {at::cross_entropy_loss(flat, b.targets.reshape(-1), {}, at::Reduction::Sum),
              static_cast<double>(b.targets.numel())};
    }
    const double n = static_cast<double>(b.inputs.size(0));
    return {loss_(out, b).to(at::kFloat) * n, n};
  }
  torch::nn::Module& module() override {
    return ddp_ ? *ddp_->module() : fsdp_ ? *fsdp_->module() : *plain_;
  }
  sharding::FSDPState* fsdp() override { return fsdp_ ? &fsdp_->state() : nullptr; }
  std::vector<at::Tensor> parameters() override {
    return ddp_ ? ddp_->parameters() : fsdp_ ? fsdp_->parameters() : plain_->parameters();
  }
  std::optional<sharding::NoSyncGuard> no_sync() override {
    if (ddp_) return ddp_->no_sync();
    if (fsdp_) return fsdp_->no_sync();
    return std::nullopt;
  }
  const sharding::ReducerStats* stats() const override {
    return ddp_ ? &ddp_->last_stats() : fsdp_ ? &fsdp_->last_stats() : nullptr;
  }
  double clip_grad_norm(double max_norm) override {
    comm::Communicator* shards = fsdp_ ? fsdp_->state().shard_group() : nullptr;
    if (max_norm > 0) return sharding::clip_grad_norm_(parameters(), max_norm, 2.0, shards);
    return sharding::grad_norm(parameters(), 2.0, shards).template item<double>();
  }
  bool uses_autocast() const override { return !fsdp_; }
  void use_grad_scaler(amp::GradScaler* scaler) override {
    if (ddp_) ddp_->reducer().set_grad_scaler(scaler);
  }

 private:
  amp::NumericsMonitor* monitor_;
  LossFn loss_;
  bool ce_sum_;
  std::optional<sharding::DistributedDataParallel<M>> ddp_;
  std::optional<sharding::FullyShardedDataParallel<M>> fsdp_;
  M plain_{nullptr};
};

// Builds the wrapped model once the trainer's numerics monitor exists.
using ModelFactory = std::function<std::unique_ptr<Model>(amp::NumericsMonitor* monitor)>;

// The loop shared by both train()s. `description` names the model in logs and metrics.
TrainResult run(const RunConfig& config, std::shared_ptr<comm::Communicator> comm,
                const ModelFactory& make_model, std::unique_ptr<BatchSource> data,
                const std::string& description);

}  // namespace internal

using internal::cross_entropy;

// Trains the user's `module` on `data` with `loss`, as `config` says (model.type: custom).
// `description` names the model in the log and the metrics file ("custom" if empty).
template <typename M>
TrainResult train(M module, std::unique_ptr<BatchSource> data, LossFn loss, const RunConfig& config,
                  std::shared_ptr<comm::Communicator> comm, std::string description = "") {
  DTRAIN_CHECK_AS(ConfigError, config.model.type == "custom", config.source, ": model.type is '",
                  config.model.type,
                  "', but this run passes its own model to framework::train: set model.type: "
                  "custom");
  DTRAIN_CHECK_AS(ConfigError, data != nullptr && loss != nullptr,
                  "framework::train: the data source and the loss function must not be null");
  int64_t n = 0;
  for (const auto& p : module->parameters()) n += p.numel();
  if (description.empty()) description = "custom";
  description += " " + std::to_string(n) + " parameters";
  auto make = [&](amp::NumericsMonitor* monitor) -> std::unique_ptr<internal::Model> {
    return std::make_unique<internal::Wrapped<M>>(std::move(module), comm, config, monitor,
                                                  std::move(loss), false);
  };
  return internal::run(config, comm, make, std::move(data), description);
}

}  // namespace dtrain::framework
