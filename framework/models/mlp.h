// MLP: Linear -> GELU, `depth` hidden layers, then a Linear to `out_features` (logits).
// A small, fast model for tests and for DDP and FSDP equivalence checks. Each hidden layer
// is an FSDP wrap point (LinearUnit); `out` belongs to the root.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include "sharding/fsdp.h"

namespace dtrain::framework {

struct MLPOptions {
  TORCH_ARG(int64_t, in_features) = 64;
  TORCH_ARG(int64_t, hidden) = 256;
  TORCH_ARG(int64_t, depth) = 3;
  TORCH_ARG(int64_t, out_features) = 10;
};

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

}  // namespace dtrain::framework
