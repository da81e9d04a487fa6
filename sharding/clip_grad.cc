#include "sharding/clip_grad.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
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
  std::vector<at::Tensor> norms;
  norms.reserve(params.size());
  for (const auto& p : params) norms.push_back(local_grad_norm(p, norm_type));
  return norm_of_grad_norms(norms, norm_type, comm, rule);
}

}  // namespace

at::Tensor local_grad_norm(const at::Tensor& p, double norm_type) {
  return p.grad().defined() ? at::linalg_vector_norm(p.grad(), norm_type) : at::Tensor();
}

at::Tensor norm_of_grad_norms(const std::vector<at::Tensor>& norms, double norm_type,
                              comm::Communicator* comm, ShardNorm rule) {
  c10::NoGradGuard no_grad;
  const auto first =
      std::find_if(norms.begin(), norms.end(), [](const at::Tensor& n) { return n.defined(); });
  if (comm != nullptr && rule == ShardNorm::kPerParameter) {
    // torch.nn.utils.clip_grad_norm_ over DTensor shards (FSDP2): each parameter's norm is
    // reduced across ranks first, then the norm of their stack is taken, on every rank alike.
    // One entry per parameter (0 without a gradient), so every rank all-reduces as many.
    if (norms.empty()) return at::zeros({}, at::kFloat);
    const c10::Device device = first == norms.end() ? c10::Device(c10::kCPU) : first->device();
    std::vector<at::Tensor> all;
    all.reserve(norms.size());
    for (const auto& n : norms) {
      all.push_back(n.defined() ? n.to(device, at::kFloat)
                                : at::zeros({}, at::TensorOptions(device).dtype(at::kFloat)));
    }
    at::Tensor per_param = combine_over_ranks(at::stack(all), norm_type, *comm);
    return at::linalg_vector_norm(per_param, norm_type);
  }
  at::Tensor total;
  if (first == norms.end()) {
    total = at::zeros({}, at::kFloat);
  } else {
    std::vector<at::Tensor> defined;
    for (const auto& n : norms) {
      if (n.defined()) defined.push_back(n.to(first->device()));
    }
    total = at::linalg_vector_norm(at::stack(defined), norm_type);
  }
  if (comm != nullptr) {
    // Each rank's total, combined: (sum_r n_r^p)^(1/p), or max_r n_r for p = inf.
    total = combine_over_ranks(total.to(at::kFloat).reshape({1}), norm_type, *comm)
                .reshape({})
                .to(total.device());
  }
  return total;
}

at::Tensor norm_of_grad_norms_tp(const std::vector<at::Tensor>& norms, double norm_type,
                                 comm::Communicator* shards, comm::Communicator* tp,
                                 const std::vector<bool>& tp_sliced) {
  c10::NoGradGuard no_grad;
  DTRAIN_CHECK(tp_sliced.size() == norms.size(), "norm_of_grad_norms_tp: ", tp_sliced.size(),
               " flags for ", norms.size(), " parameters");
  if (norms.empty()) return at::zeros({}, at::kFloat);
  const auto first =
      std::find_if(norms.begin(), norms.end(), [](const at::Tensor& n) { return n.defined(); });
  const c10::Device device = first == norms.end() ? c10::Device(c10::kCPU) : first->device();
  std::vector<at::Tensor> all;
  for (const auto& n : norms) {
    all.push_back(n.defined() ? n.to(device, at::kFloat)
                              : at::zeros({}, at::TensorOptions(device).dtype(at::kFloat)));
  }
  at::Tensor per_param = at::stack(all);
  if (shards != nullptr && shards->size() > 1) {
    per_param = combine_over_ranks(per_param, norm_type, *shards);
  }
  if (tp != nullptr && tp->size() > 1) {
    std::vector<int64_t> idx;
    for (size_t i = 0; i < tp_sliced.size(); ++i) {
      if (tp_sliced[i]) idx.push_back(static_cast<int64_t>(i));
    }
    if (!idx.empty()) {
      at::Tensor index = at::tensor(idx, at::kLong).to(device);
      at::Tensor sliced = combine_over_ranks(per_param.index_select(0, index), norm_type, *tp);
      per_param = per_param.index_copy(0, index, sliced);
    }
  }
  return at::linalg_vector_norm(per_param, norm_type);
}

at::Tensor clip_grad_norm_tp_(const std::vector<at::Tensor>& params, double max_norm,
                              double norm_type, comm::Communicator* shards, comm::Communicator* tp,
                              const std::vector<bool>& tp_sliced) {
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> norms;
  for (const auto& p : params) norms.push_back(local_grad_norm(p, norm_type));
  at::Tensor total = norm_of_grad_norms_tp(norms, norm_type, shards, tp, tp_sliced);
  std::vector<at::Tensor> grads = grads_of(params);
  if (max_norm > 0 && !grads.empty()) {
    at::Tensor coef = at::clamp((total + 1e-6).reciprocal() * max_norm, std::nullopt, 1.0);
    at::_foreach_mul_(grads, coef.to(grads.front().device()));
  }
  return total;
}

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
