// GradReadyHooks: "this parameter's gradient is ready" callbacks, the trigger DDP's buckets
// and FSDP's units both count down to their collectives.
//
// A post-hook on each parameter's AccumulateGrad node (as c10d's Reducer registers them)
// fires after autograd has written the parameter's .grad for this backward. The hooks hold
// strong references to the nodes: autograd keeps only a weak one, and a new node (without
// the hook) would be created for the next graph. They run on the thread that runs backward.
//
// A parameter's node changes when its TensorImpl's dtype or device changes through set_data
// (autograd drops the cached accumulator): owners that re-point parameters keep dtype and
// device fixed, as FSDP does, or register anew.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace dtrain::sharding {

// std::shared_ptr<Node> up to LibTorch 2.12, c10::intrusive_ptr<Node> from 2.13 on.
using GradAccumulatorPtr =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

class GradReadyHooks {
 public:
  using Callback = std::function<void(int64_t index)>;

  // Hooks every params[i] that requires grad; `on_ready(i)` runs once per backward that
  // produced a gradient for it.
  GradReadyHooks(const std::vector<at::Tensor>& params, Callback on_ready);
  ~GradReadyHooks();
  GradReadyHooks(const GradReadyHooks&) = delete;
  GradReadyHooks& operator=(const GradReadyHooks&) = delete;

  // Whether params[i] is hooked (it requires grad).
  bool hooked(int64_t i) const { return nodes_[i] != nullptr; }
  // params[i]'s AccumulateGrad node (null when not hooked), to find it in a graph.
  const torch::autograd::Node* node(int64_t i) const { return nodes_[i].get(); }
  size_t size() const { return nodes_.size(); }

 private:
  std::vector<GradAccumulatorPtr> nodes_;
  std::vector<uintptr_t> keys_;
};

}  // namespace dtrain::sharding
