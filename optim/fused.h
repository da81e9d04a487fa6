// dtrain::optim::AdamW and SGD: the optimizers LibTorch users know (torch::optim's, with their
// options, parameter groups and state), stepped by ATen's fused kernels, the ones Python's
// `AdamW(fused=True)` and `SGD(fused=True)` run: one pass over each group's tensors instead
// of about ten ops per parameter.
//
// Numbers: the same as Python's fused optimizers, bit for bit (optim/fused_test.cc compares
// parameters and state after K steps with PyTorch's, recorded in the same run). LibTorch's
// own C++ AdamW rounds differently (mul_().add_() where the kernel uses lerp), so it matches
// neither.
//
// With a GradScaler (amp::ScalingAwareOptimizer): GradScaler::step hands the optimizer the
// scale and the found-inf flag, and the kernel unscales the gradients and skips the update in
// the same pass, as PyTorch does for fused optimizers (`_step_supports_amp_scaling`); no
// separate unscale pass, no host decision. A skipped step leaves parameters and state,
// including the step count, unchanged.
//
// State: torch::optim's AdamWParamState / SGDParamState, so checkpoints save and restore it in
// PyTorch's layout (framework/checkpoint/optim_state.h). AdamW keeps its step count where
// Python keeps it: a 0-d fp32 tensor on the parameter's device (AdamWState::step_count, exact
// below 2^24 steps), incremented before the kernel and decremented by the found-inf flag after
// it, as Python's _fused_adamw does. Nothing in a step reads a value back to the host, so a
// GPU stream never waits for the CPU. The int that torch::optim's step() holds is the count
// when the state was created or loaded; read step_count() for the current one. Parameters and
// gradients must share a device and a floating dtype per group (as Python's fused path
// requires); sparse gradients are refused.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <unordered_set>
#include <utility>
#include <vector>

#include "amp/grad_scaler.h"

namespace dtrain::optim {

// The GradScaler's hand-off, kept for the next step, and stepping part of the parameters
// (both optimizers below).
class GradScaling : public amp::ScalingAwareOptimizer {
 public:
  void set_grad_scaling(at::Tensor grad_scale, at::Tensor found_inf) override;

  // step() for `params` alone (of this optimizer's, those with a gradient); the others keep
  // their gradients for a later step. The kernels are elementwise, so each parameter gets the
  // bits step() would give it: FSDP's optimizer in backward steps each unit this way as its
  // gradients are reduced (FSDPState::set_step_in_backward).
  void step_only(const std::vector<at::Tensor>& params);

 protected:
  // Whether step() takes `p`: always, but inside step_only only its parameters.
  bool selected(const at::Tensor& p) const {
    return only_ == nullptr || only_->count(p.unsafeGetTensorImpl()) > 0;
  }
  at::Tensor grad_scale_, found_inf_;

 private:
  const std::unordered_set<const c10::TensorImpl*>* only_ = nullptr;
};

// AdamW's per-parameter state: torch::optim's, with the step count as a device tensor. A state
// loaded as a plain AdamWParamState (a checkpoint) becomes one at the next step, its count
// taken from step().
class AdamWState : public torch::optim::AdamWParamState {
 public:
  // The 0-d fp32 count on the parameter's device; the kernel reads it.
  const at::Tensor& step_count() const { return step_count_; }
  void set_step_count(at::Tensor count) { step_count_ = std::move(count); }

  // torch::save(optimizer) and copies carry the current count: the archive's "step" is
  // step_count() (read back to the host here, at save time only), and a copy is an AdamWState
  // (the base's clone() would slice it to the count at creation). torch::load gives plain
  // states, which the next step takes over.
  using torch::optim::AdamWParamState::serialize;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  std::unique_ptr<torch::optim::OptimizerParamState> clone() const override;

 private:
  at::Tensor step_count_;
};

class AdamW : public torch::optim::AdamW, public GradScaling {
 public:
  explicit AdamW(std::vector<at::Tensor> params, torch::optim::AdamWOptions defaults = {});
  explicit AdamW(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                 torch::optim::AdamWOptions defaults = {});

  at::Tensor step(LossClosure closure = nullptr) override;
};

class SGD : public torch::optim::SGD, public GradScaling {
 public:
  explicit SGD(std::vector<at::Tensor> params, torch::optim::SGDOptions defaults);
  explicit SGD(const std::vector<torch::optim::OptimizerParamGroup>& groups,
               torch::optim::SGDOptions defaults);

  at::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace dtrain::optim
