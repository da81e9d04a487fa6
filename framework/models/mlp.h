// MLP: Linear -> GELU, `depth` hidden layers, then a Linear to `out_features` (logits).
// A small, fast model for tests and for DDP and FSDP equivalence checks. Each hidden layer
// is an FSDP wrap point (LinearUnit); `out` belongs to the root.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include "framework/models/configs.h"
#include "framework/task.h"
#include "sharding/fsdp.h"

namespace dtrain::framework {

using LinearUnit = sharding::Unit<torch::nn::LinearImpl>;

class MLPImpl : public torch::nn::Module {
 public:
  explicit MLPImpl(const MLPOptions& options);
  // x [B, in_features] -> [B, out_features]
  at::Tensor forward(const at::Tensor& x);

  torch::nn::ModuleList layers{nullptr};
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(MLP);

// model.type: mlp's builder (framework/models/builtin.h registers it).
void build_mlp(const BuildContext& ctx, BuiltModel& out);

}  // namespace dtrain::framework
