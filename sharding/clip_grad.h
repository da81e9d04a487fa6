// clip_grad_norm_: PyTorch's torch.nn.utils.clip_grad_norm_, operation for operation (a
// per-gradient linalg_vector_norm, the norm of their stack, coef = max_norm / (norm + 1e-6)
// clamped to 1, a foreach multiply), so clipped gradients match Python's bitwise.
// LibTorch's own C++ clip_grad_norm_ takes a different path (Tensor::norm, and no stack for
// a single tensor) and can differ in the last bit.
//
// With a communicator the gradients are shards of one model spread over its ranks (FSDP,
// or any partition): the norm is taken over all shards (sum of |g|^p all-reduced, or MAX
// for p = inf), every rank clips with the same coefficient. Every rank must call it.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace dtrain::comm {
class Communicator;
}

namespace dtrain::sharding {

// The total norm of the gradients of `params` (over all shards with `comm`), as a 0-dim
// tensor on the first gradient's device; gradients untouched.
at::Tensor grad_norm(const std::vector<at::Tensor>& params, double norm_type = 2.0,
                     comm::Communicator* comm = nullptr);

// Clips the gradients of `params` in place; returns the total norm before clipping.
double clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm,
                       double norm_type = 2.0, comm::Communicator* comm = nullptr,
                       bool error_if_nonfinite = false);

}  // namespace dtrain::sharding
