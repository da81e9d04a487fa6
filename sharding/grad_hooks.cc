#include "sharding/grad_hooks.h"

#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <memory>

namespace dtrain::sharding {

GradReadyHooks::GradReadyHooks(const std::vector<at::Tensor>& params, Callback on_ready) {
  nodes_.resize(params.size());
  keys_.assign(params.size(), 0);
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].requires_grad()) continue;
    auto node = torch::autograd::impl::grad_accumulator(params[i]);
    const int64_t index = static_cast<int64_t>(i);
    keys_[i] = node->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [on_ready, index](const torch::autograd::variable_list& outputs,
                          const torch::autograd::variable_list& /*inputs*/) {
          on_ready(index);
          return outputs;
        }));
    nodes_[i] = std::move(node);
  }
}

GradReadyHooks::~GradReadyHooks() {
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (nodes_[i]) nodes_[i]->del_post_hook(keys_[i]);
  }
}

}  // namespace dtrain::sharding
