// Strategy: how the trainer's model is spread over the ranks, behind one interface. One type
// per parallel.strategy:
//   - PlainStrategy: the module as it is (one process; strategy none);
//   - DdpStrategy: sharding::DistributedDataParallel (replicated parameters, bucketed
//     gradient all-reduce in reduce_dtype, autocast to param_dtype);
//   - FsdpStrategy: sharding::FullyShardedDataParallel (sharded fp32 masters, parameters
//     gathered in param_dtype, gradients reduce-scattered; no autocast needed).
// make_strategy picks one from the config, and ddp_options/fsdp_options are the only place
// where the config's parallel and precision sections become sharding options (unit-tested in
// strategy_test.cc). The trainer (framework/trainer.h) sees only Strategy; how a step moves
// through a strategy is in docs/architecture.md.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "amp/grad_scaler.h"
#include "amp/numerics.h"
#include "comm/communicator.h"
#include "framework/config.h"
#include "sharding/ddp.h"
#include "sharding/deferred_init.h"
#include "sharding/fsdp.h"
#include "sharding/tensor_parallel_plan.h"

namespace dtrain::framework {

class PipelineStrategy;  // framework/pipeline_strategy.h

class Strategy {
 public:
  virtual ~Strategy() = default;

  // The module's output for `inputs` through the wrapper (hooks, gathers): every rank calls
  // it alike under FSDP, whose forwards are collective.
  virtual at::Tensor forward(const at::Tensor& inputs) = 0;
  // What the optimizer steps: the module's parameters, or FSDP's fp32 master shards.
  virtual std::vector<at::Tensor> parameters() = 0;
  // Micro-batches before the last accumulate locally (no gradient communication).
  virtual std::optional<sharding::NoSyncGuard> no_sync() { return std::nullopt; }
  // The last backward's communication figures; null for a plain module.
  virtual const sharding::ReducerStats* stats() const { return nullptr; }
  // Whether forwards run under autocast to param_dtype (FSDP's parameters already have it).
  virtual bool uses_autocast() const { return true; }
  // The unwrapped module, and FSDP's state when sharded (checkpoints, parameter checks).
  virtual torch::nn::Module& module() = 0;
  virtual sharding::FSDPState* fsdp() { return nullptr; }
  // DDP's reducer (checkpoints keep its rebuilt bucket order); null for the others.
  virtual sharding::Reducer* ddp_reducer() { return nullptr; }
  // DDP unscales and judges gradients as it writes them back (DDPOptions::grad_scaler);
  // the others leave that to the scaler's own pass.
  virtual void use_grad_scaler(amp::GradScaler* /*scaler*/) {}
  // Pipeline parallelism (parallel.pp > 1): the strategy itself, whose steps run through the
  // pipeline's schedule rather than forward(); null for the others.
  virtual PipelineStrategy* pipeline() { return nullptr; }

  // Clips the gradients to max_norm (> 0) or only measures them; the 2-norm of the whole
  // model's gradients (over the shards under FSDP), a 0-dim tensor on the device (no host read).
  // With the optimizer in backward it measures them as they were when stepped (no clipping).
  virtual at::Tensor clip_grad_norm(double max_norm);

  // FSDP's optimizer in backward (train.optimizer_in_backward; FSDPState::set_step_in_backward):
  // `step` gets each unit's masters as soon as their gradients are reduced, after their norms
  // are kept for clip_grad_norm, and their gradients are dropped after it.
  using StepParams = std::function<void(const std::vector<at::Tensor>& params)>;
  void step_in_backward(StepParams step);

  // Tensor parallelism (parallel.tp > 1; sharding/tensor_parallel_plan.h), applied to the
  // module before it was wrapped. `head` gives the weight whose logits the model returns: under
  // the Llama plan a vocabulary slice, so forward() gives this rank's part of the vocabulary.
  void set_tensor_parallel(std::shared_ptr<sharding::TensorParallelism> tp,
                           std::function<at::Tensor()> head);
  const sharding::TensorParallelism* tensor_parallel() const { return tp_.get(); }
  // After the last micro-batch's backward: under sequence parallelism, the replicated
  // parameters' gradients (each rank's covers its part of the sequence) summed over the TP
  // group. Collective over it; nothing otherwise.
  void finish_backward();
  // The whole output of forward() (the vocabulary gathered over the TP group), for sampling.
  at::Tensor full_output(const at::Tensor& out);
  // The sum of the cross-entropy of `out` [.., V or V/tp] against `targets` over every target
  // but those of -100 (cross_entropy's ignore_index): vocabulary-parallel under tensor
  // parallelism (the logits never gathered).
  at::Tensor cross_entropy_sum(const at::Tensor& out, const at::Tensor& targets);
  // Sequences fed to forward() must have a multiple of this many tokens (tp under sequence
  // parallelism, else 1).
  int64_t sequence_multiple() const;
  // A parameter's full value from this rank's part of it, by its name in the module (TP
  // slices gathered: collective over the TP group); `local` as it is without TP.
  at::Tensor full_parameter(const std::string& name, const at::Tensor& local);

 protected:
  // Per entry of parameters(): whether it is a TP slice.
  const std::vector<bool>& tp_sliced();

 private:
  std::shared_ptr<sharding::TensorParallelism> tp_;
  std::function<at::Tensor()> head_;
  std::vector<bool> tp_sliced_;
  bool in_backward_ = false;
  // Each stepped parameter's gradient norm in this step, until clip_grad_norm reads them.
  std::unordered_map<const c10::TensorImpl*, at::Tensor> stepped_norms_;
};

// The config's parallel and precision sections as sharding options.
sharding::DDPOptions ddp_options(const RunConfig& c, amp::NumericsMonitor* monitor);
sharding::FSDPOptions fsdp_options(const RunConfig& c, amp::NumericsMonitor* monitor);

template <typename M>
class PlainStrategy final : public Strategy {
 public:
  explicit PlainStrategy(M module) : module_(std::move(module)) {}
  at::Tensor forward(const at::Tensor& inputs) override { return module_->forward(inputs); }
  std::vector<at::Tensor> parameters() override { return module_->parameters(); }
  torch::nn::Module& module() override { return *module_; }

 private:
  M module_;
};

template <typename M>
class DdpStrategy final : public Strategy {
 public:
  DdpStrategy(M module, std::shared_ptr<comm::Communicator> comm, const sharding::DDPOptions& o)
      : ddp_(std::move(module), std::move(comm), o) {}
  at::Tensor forward(const at::Tensor& inputs) override { return ddp_.forward(inputs); }
  std::vector<at::Tensor> parameters() override { return ddp_.parameters(); }
  std::optional<sharding::NoSyncGuard> no_sync() override { return ddp_.no_sync(); }
  const sharding::ReducerStats* stats() const override { return &ddp_.last_stats(); }
  torch::nn::Module& module() override { return *ddp_.module(); }
  void use_grad_scaler(amp::GradScaler* scaler) override { ddp_.reducer().set_grad_scaler(scaler); }
  sharding::Reducer* ddp_reducer() override { return &ddp_.reducer(); }

 private:
  sharding::DistributedDataParallel<M> ddp_;
};

template <typename M>
class FsdpStrategy final : public Strategy {
 public:
  FsdpStrategy(M module, std::shared_ptr<comm::Communicator> comm, const sharding::FSDPOptions& o)
      : fsdp_(std::move(module), std::move(comm), o) {}
  at::Tensor forward(const at::Tensor& inputs) override { return fsdp_.forward(inputs); }
  std::vector<at::Tensor> parameters() override { return fsdp_.parameters(); }
  std::optional<sharding::NoSyncGuard> no_sync() override { return fsdp_.no_sync(); }
  const sharding::ReducerStats* stats() const override { return &fsdp_.last_stats(); }
  bool uses_autocast() const override { return false; }
  torch::nn::Module& module() override { return *fsdp_.module(); }
  sharding::FSDPState* fsdp() override { return &fsdp_.state(); }

 private:
  sharding::FullyShardedDataParallel<M> fsdp_;
};

// The strategy the config names for `module`. `comm` null (one process) is always plain.
// `init` (deferred initialization, sharding/deferred_init.h): FSDP fills each unit with it as
// the unit is sharded; the other strategies materialize the whole module first.
template <typename M>
std::unique_ptr<Strategy> make_strategy(M module, std::shared_ptr<comm::Communicator> comm,
                                        const RunConfig& c, amp::NumericsMonitor* monitor,
                                        const sharding::ParamInit& init = nullptr) {
  if (comm && c.parallel.strategy == ParallelStrategy::kFsdp) {
    return std::make_unique<FsdpStrategy<M>>(std::move(module), std::move(comm),
                                             fsdp_options(c, monitor).param_init(init));
  }
  if (init) sharding::materialize(*module, init);
  if (comm && c.parallel.strategy == ParallelStrategy::kDdp) {
    return std::make_unique<DdpStrategy<M>>(std::move(module), std::move(comm),
                                            ddp_options(c, monitor));
  }
  return std::make_unique<PlainStrategy<M>>(std::move(module));
}

}  // namespace dtrain::framework
