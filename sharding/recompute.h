// Activation recompute (activation checkpointing), as PyTorch's checkpoint_wrapper and
// torch.utils.checkpoint give it: a region's forward runs without keeping its activations
// for backward, only its inputs; backward runs the region's forward again, with gradients
// on, and takes the gradients from that.
//
// LibTorch has no torch.utils.checkpoint, so this is a custom autograd Function. It differs
// from PyTorch's reentrant checkpoint in one way that matters here: the region's trainable
// parameters are inputs of the Function too, so their gradients leave its backward and are
// accumulated by the outer backward, where DDP's and FSDP's gradient hooks and
// end-of-backward callbacks belong (a reentrant backward would accumulate them inside a
// nested graph task, whose end is not the backward's end). The inner gradients come from
// torch::autograd::grad, which accumulates nothing.
//
// - The RNG state (CPU, and the current CUDA device's when CUDA is initialized) is saved at
//   the forward and restored around the recompute, then put back: dropout draws the same
//   masks, and the RNG stream after the backward is what it would be without recompute.
// - Autocast's state at the forward (CPU and CUDA: enabled, dtype) is restored around the
//   recompute. The cast cache is off in the no-grad forward (a cast cached there would carry
//   no gradient to a later use of the same weight) and on in the recompute, as in a plain
//   forward. A weight used both inside and outside a region under autocast is cast once for
//   each side, so its two gradient parts are summed in fp32 rather than in the low
//   precision: not bitwise the plain forward's there (and not less accurate).
// - Under FSDP the region is a wrap point's own forward: FSDP gathers the unit for its
//   backward (the pre-backward hook on the region's outputs) before the recompute runs, and
//   the recompute reads the gathered parameters. Nothing of the unit stays gathered after
//   the forward.
// - Gradients are bitwise those without recompute: the same kernels on the same values, in
//   the same order (tests/recompute_test.cc, framework/trainer_test.cc).
// - Grad mode off, or no input or parameter requiring grad: the region just runs.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace dtrain::sharding {

using RegionFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Runs `fn(inputs)` keeping only `inputs` for backward; `params`: the tensors `fn` reads that
// may need gradients (a module's parameters; those not requiring grad are skipped). `fn`
// must compute the same function of the same tensors when run again in backward.
std::vector<at::Tensor> recompute(RegionFn fn, const std::vector<at::Tensor>& inputs,
                                  const std::vector<at::Tensor>& params);

}  // namespace dtrain::sharding
