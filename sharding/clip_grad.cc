#include "sharding/clip_grad.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <limits>

#include "comm/communicator.h"
#include "core/error.h"

namespace dtrain::sharding {

namespace {

std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  return grads;
}

// Combines every rank's values of `t` (a 1-D fp32 tensor): (sum_r t_r^p)^(1/p), or the
// maximum for p = inf.
at::Tensor combine_over_ranks(at::Tensor t, double norm_type, comm::Communicator& comm) {
  const c10::Device device = t.device();
  if (comm.device_type() != t.device().type()) t = t.to(comm.device_type());
  if (std::isinf(norm_type)) {
    comm.all_reduce(t, comm::ReduceOp::kMax).wait();
  } else {
    t = t.pow(norm_type);
    comm.all_reduce(t, comm::ReduceOp::kSum).wait();
    t = t.pow(1.0 / norm_type);
  }
  return t.to(device);
}

at::Tensor total_norm(const std::vector<at::Tensor>& params, double norm_type,
                      comm::Communicator* comm, ShardNorm rule) {
  c10::NoGradGuard no_grad;
  const std::vector<at::Tensor> grads = grads_of(params);
  if (comm != nullptr && rule == ShardNorm::kPerParameter) {
    // torch.nn.utils.clip_grad_norm_ over DTensor shards (FSDP2): each parameter's norm is
    // reduced across ranks first, then the norm of their stack is taken, on every rank alike.
    // One entry per parameter (0 without a gradient), so every rank all-reduces as many.
    c10::Device device = grads.empty() ? c10::Device(c10::kCPU) : grads.front().device();
    std::vector<at::Tensor> norms;
    norms.reserve(params.size());
    for (const auto& p : params) {
      norms.push_back(p.grad().defined()
                          ? at::linalg_vector_norm(p.grad(), norm_type).to(device, at::kFloat)
                          : at::zeros({}, at::TensorOptions(device).dtype(at::kFloat)));
    }
    if (norms.empty()) return at::zeros({}, at::kFloat);
    at::Tensor per_param = combine_over_ranks(at::stack(norms), norm_type, *comm);
    return at::linalg_vector_norm(per_param, norm_type);
  }
  at::Tensor total;
  if (grads.empty()) {
    total = at::zeros({}, at::kFloat);
  } else {
    std::vector<at::Tensor> norms;
    norms.reserve(grads.size());
    for (const auto& g : grads) norms.push_back(at::linalg_vector_norm(g, norm_type));
    c10::Device first = grads.front().device();
    for (auto& n : norms) n = n.to(first);
    total = at::linalg_vector_norm(at::stack(norms), norm_type);
  }
  if (comm != nullptr) {
    // Each rank's total, combined: (sum_r n_r^p)^(1/p), or max_r n_r for p = inf.
    total = combine_over_ranks(total.to(at::kFloat).reshape({1}), norm_type, *comm)
                .reshape({})
                .to(total.device());
  }
  return total;
}

}  // namespace

at::Tensor grad_norm(const std::vector<at::Tensor>& params, double norm_type,
                     comm::Communicator* comm, ShardNorm rule) {
  return total_norm(params, norm_type, comm, rule);
}

at::Tensor clip_grad_norm_tensor_(const std::vector<at::Tensor>& params, double max_norm,
                                  double norm_type, comm::Communicator* comm,
                                  bool error_if_nonfinite, ShardNorm rule) {
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> grads = grads_of(params);
  at::Tensor total = total_norm(params, norm_type, comm, rule);
  if (error_if_nonfinite) {
    double v = total.item<double>();
    DTRAIN_CHECK_AS(Error, std::isfinite(v), "The total norm of order ", norm_type,
                    " for gradients is non-finite (", v,
                    "), so it cannot be clipped. Pass error_if_nonfinite=false to scale the "
                    "gradients by it anyway.");
  }
  if (!grads.empty()) {
    // Python's `max_norm / (total + 1e-6)` is Tensor.__rtruediv__: reciprocal, then multiply.
    at::Tensor coef = at::clamp((total + 1e-6).reciprocal() * max_norm, std::nullopt, 1.0);
    at::_foreach_mul_(grads, coef.to(grads.front().device()));
  }
  return total;
}

double clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm, double norm_type,
                       comm::Communicator* comm, bool error_if_nonfinite, ShardNorm rule) {
  return clip_grad_norm_tensor_(params, max_norm, norm_type, comm, error_if_nonfinite, rule)
      .item<double>();
}

}  // namespace dtrain::sharding
