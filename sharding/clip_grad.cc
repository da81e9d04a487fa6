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

at::Tensor total_norm(const std::vector<at::Tensor>& grads, double norm_type,
                      comm::Communicator* comm) {
  c10::NoGradGuard no_grad;
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
    // Combine the shards' norms: (sum_r n_r^p)^(1/p), or max_r n_r for p = inf.
    at::Tensor t = total.to(at::kFloat).reshape({1});
    if (comm->device_type() != t.device().type()) t = t.to(comm->device_type());
    if (std::isinf(norm_type)) {
      comm->all_reduce(t, comm::ReduceOp::kMax).wait();
    } else {
      t = t.pow(norm_type);
      comm->all_reduce(t, comm::ReduceOp::kSum).wait();
      t = t.pow(1.0 / norm_type);
    }
    total = t.reshape({}).to(total.device());
  }
  return total;
}

}  // namespace

at::Tensor grad_norm(const std::vector<at::Tensor>& params, double norm_type,
                     comm::Communicator* comm) {
  return total_norm(grads_of(params), norm_type, comm);
}

double clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm, double norm_type,
                       comm::Communicator* comm, bool error_if_nonfinite) {
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> grads = grads_of(params);
  at::Tensor total = total_norm(grads, norm_type, comm);
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
  return total.item<double>();
}

}  // namespace dtrain::sharding
