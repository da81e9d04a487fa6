#include "framework/models/mlp.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "core/logging.h"
#include "framework/task.h"

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

void build_mlp(const BuildContext& ctx, BuiltModel& out) {
  const auto& m = ctx.config.model.as<MLPSettings>();
  MLP mlp(m.options());
  mlp->to(ctx.device);
  int64_t n = 0;
  for (const auto& p : mlp->parameters()) n += p.numel();
  out.task.description = "MLP " + logging::fixed(static_cast<double>(n) / 1e6, 2) + "M";
  out.task.loss = cross_entropy;
  out.task.per_token_validation = true;
  out.task.make_strategy = [mlp, comm = ctx.comm, c = &ctx.config](amp::NumericsMonitor* mon) {
    return make_strategy(mlp, comm, *c, mon);
  };
  out.data = std::make_unique<SyntheticClassificationSource>(
      m.in_features, m.out_features, ctx.micro_batch, ctx.rank, ctx.data_seed);
}

}  // namespace dtrain::framework
