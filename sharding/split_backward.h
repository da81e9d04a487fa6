// A stage's backward in two halves, for the zero-bubble pipeline schedules (Qi et al., "Zero
// Bubble Pipeline Parallelism"; PyTorch's stage_backward_input and stage_backward_weight):
// backward_input computes the gradient of the stage's input, which the previous stage waits
// for, and leaves the parameters' gradients to WeightGrad::run, which a schedule puts where a
// rank would otherwise idle.
//
// How the graph is split. The input half runs the autograd nodes on a path from the output to
// the input (the "activation" nodes), each computing only its outputs toward the input: a
// linear layer's matmul gives the input's gradient and leaves the weight's. It records what
// flowed into each activation node that has an edge into the weight-only part of the graph.
// The weight half runs each such node again on what it recorded, now computing only its
// outputs toward the weights (one autograd call per node, so that no activation path is run
// twice), then runs the weight-only part from there in one call that accumulates into .grad as
// a plain backward does (AccumulateGrad, its hooks included). Every kernel runs once, on the
// values a plain backward gives it: the gradients are those of output.backward(grad).
//
// Not split (their parameters' gradients are taken in the input half, at no extra cost, and
// handed to the parameters' own AccumulateGrad in the weight half, so that .grad's layout,
// sparse gradients and post-accumulate hooks are a plain backward's): edges out of custom
// autograd Functions (recompute's, tensor parallelism's collectives: run again they would
// recompute or communicate twice), and weight-only subgraphs two edges share (a weight used
// twice, cast once under autocast), where one node's second run would reach the other's part
// through the activation path.
//
// Not split at all, the whole backward run in the input half: a graph whose split would run a
// hook twice (hooks of any kind on a node run again, or tensor hooks and retain_grad on a
// gradient captured in one half and fed in the other). A stage with no input gradient (the
// first) runs its whole backward in the weight half.
#pragma once

#include <ATen/ATen.h>

#include <memory>

namespace dtrain::sharding {

class WeightGrad {
 public:
  WeightGrad();
  ~WeightGrad();
  WeightGrad(WeightGrad&&) noexcept;
  WeightGrad& operator=(WeightGrad&&) noexcept;

  // Accumulates the parameters' gradients into their .grad, once; frees the graph.
  void run();
  // The number of graph nodes whose weight half was deferred (a test's view of the split).
  int deferred_nodes() const;

  struct State;  // sharding/split_backward.cc
  explicit WeightGrad(std::unique_ptr<State> state);

 private:
  std::unique_ptr<State> state_;
};

// The input half of output.backward(grad_output) (grad_output undefined: a one-element output,
// the loss, whose gradient is one; UsageError otherwise). `input`: a leaf that requires grad
// (the stage's received activation; a non-leaf is a UsageError, as the gradients of what made
// it would be lost), or undefined for a stage with none. Sets *grad_input to the input's gradient
// (zeros when none reaches it; undefined when `input` is) and returns the weight half.
WeightGrad backward_input(const at::Tensor& output, const at::Tensor& grad_output,
                          const at::Tensor& input, at::Tensor* grad_input);

}  // namespace dtrain::sharding
