// clip_grad_norm_: PyTorch's torch.nn.utils.clip_grad_norm_, operation for operation (a
// per-gradient linalg_vector_norm, the norm of their stack, coef = max_norm / (norm + 1e-6)
// clamped to 1, a foreach multiply), so clipped gradients match Python's bitwise.
// LibTorch's own C++ clip_grad_norm_ takes a different path (Tensor::norm, and no stack for
// a single tensor) and can differ in the last bit.
//
// With a communicator the gradients are shards of one model spread over its ranks (FSDP,
// or any partition): the norm is taken over all shards, and every rank clips with the same
// coefficient. Every rank must call it. How the shards combine (ShardNorm):
//   kPerParameter (default, PyTorch's over FSDP2's DTensor shards): each parameter's norm is
//     reduced across ranks ((sum_r n_r^p)^(1/p), or MAX for p = inf), then the norm of their
//     stack is taken: bitwise fully_shard's. Every rank must pass the same parameters, in
//     the same order (FSDP's masters are).
//   kPerRank: each rank's total norm, combined once: any partition of the parameters over
//     the ranks, one value all-reduced; may differ from PyTorch in the last bit.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace dtrain::comm {
class Communicator;
}

namespace dtrain::sharding {

enum class ShardNorm { kPerParameter, kPerRank };

// The total norm of the gradients of `params` (over all shards with `comm`), as a 0-dim
// tensor on the first gradient's device; gradients untouched.
at::Tensor grad_norm(const std::vector<at::Tensor>& params, double norm_type = 2.0,
                     comm::Communicator* comm = nullptr, ShardNorm rule = ShardNorm::kPerParameter);

// The norm grad_norm takes of one parameter's local gradient (this rank's shard), before
// combining: linalg_vector_norm(grad, norm_type); undefined when `p` has no gradient.
at::Tensor local_grad_norm(const at::Tensor& p, double norm_type = 2.0);

// grad_norm from each parameter's local_grad_norm, given in the order grad_norm would take
// the parameters: for when the gradients are gone by the time the norm is wanted (FSDP's
// optimizer in backward records each unit's before stepping it). Every rank must call it, as
// grad_norm.
at::Tensor norm_of_grad_norms(const std::vector<at::Tensor>& norms, double norm_type = 2.0,
                              comm::Communicator* comm = nullptr,
                              ShardNorm rule = ShardNorm::kPerParameter);

// Tensor parallelism beside the shards: the parameters `tp_sliced` marks (one flag per entry)
// are slices over the `tp` group too, so their norms also combine over it (as PyTorch's
// clip_grad_norm_ over DTensors sharded on a 2-D mesh); the others are whole on every TP rank
// and count once. Per parameter, then the norm of their stack, as kPerParameter.
at::Tensor norm_of_grad_norms_tp(const std::vector<at::Tensor>& norms, double norm_type,
                                 comm::Communicator* shards, comm::Communicator* tp,
                                 const std::vector<bool>& tp_sliced);
at::Tensor clip_grad_norm_tp_(const std::vector<at::Tensor>& params, double max_norm,
                              double norm_type, comm::Communicator* shards, comm::Communicator* tp,
                              const std::vector<bool>& tp_sliced);

// Clips the gradients of `params` in place; returns the total norm before clipping as a 0-dim
// fp32 tensor on the first gradient's device, as PyTorch's does: nothing waits for the
// device unless error_if_nonfinite (which must read the norm to decide).
at::Tensor clip_grad_norm_tensor_(const std::vector<at::Tensor>& params, double max_norm,
                                  double norm_type = 2.0, comm::Communicator* comm = nullptr,
                                  bool error_if_nonfinite = false,
                                  ShardNorm rule = ShardNorm::kPerParameter);

// The same, the norm read back to the host (a sync on a GPU).
double clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm,
                       double norm_type = 2.0, comm::Communicator* comm = nullptr,
                       bool error_if_nonfinite = false, ShardNorm rule = ShardNorm::kPerParameter);

}  // namespace dtrain::sharding
