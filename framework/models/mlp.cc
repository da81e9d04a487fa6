#include "framework/models/mlp.h"

#include <ATen/ATen.h>

namespace dtrain::framework {

MLPImpl::MLPImpl(const MLPOptions& o) {
  layers = register_module("layers", torch::nn::ModuleList());
  int64_t width = o.in_features();
  for (int64_t i = 0; i < o.depth(); ++i) {
    layers->push_back(LinearUnit(width, o.hidden()));
    width = o.hidden();
  }
  out = register_module("out", torch::nn::Linear(width, o.out_features()));
}

at::Tensor MLPImpl::forward(const at::Tensor& x) {
  at::Tensor h = x;
  for (const auto& layer : *layers) {
    h = at::gelu(layer->as<sharding::UnitImpl<torch::nn::LinearImpl>>()->forward(h));
  }
  return out->forward(h);
}

}  // namespace dtrain::framework
