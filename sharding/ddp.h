// DistributedDataParallel: PyTorch's DDP for LibTorch modules.
//
//   auto comm = dtrain::comm::create_world();
//   dtrain::sharding::DistributedDataParallel<TransformerLM> model(TransformerLM(opts), comm);
//   at::Tensor logits = model.forward(tokens);  // or model(tokens)
//   loss.backward();                           // gradients are averaged over ranks on return
//   optimizer.step();                          // torch::optim over model.module()->parameters()
//
// LibTorch modules have no forward hooks, so the wrapper is typed: change the declaration,
// keep calling forward(...) with the module's own arguments and result type. At
// construction every rank checks it holds the same parameters (UsageError naming the first
// mismatch) and takes rank 0's parameters and buffers. Each forward re-broadcasts buffers
// (broadcast_buffers) and arms the gradient hooks of the Reducer (sharding/reducer.h), which
// buckets, overlaps and averages the all-reduce.
//
// Gradient accumulation: forwards under `auto guard = model.no_sync();` leave gradients
// local; the first forward+backward outside it reduces everything accumulated.
//
// As in PyTorch, every forward broadcasts buffers (when the module has any and
// broadcast_buffers is on), so all ranks must run it: evaluate on one rank through
// model.module(), not through the wrapper.
//
// Choices where PyTorch is silent or dtrain differs: gradient_as_bucket_view defaults to on
// (no copy; PyTorch defaults it off); there is no "module." prefix on parameter names
// (model.module() is the plain module); forward outputs given to find_unused_parameters may
// be at::Tensor, std::vector<at::Tensor> or std::tuple of tensors.
#pragma once

#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "sharding/no_sync.h"
#include "sharding/outputs.h"
#include "sharding/reducer.h"

namespace dtrain::sharding {

namespace detail {

inline Reducer::NamedTensors named(const torch::OrderedDict<std::string, at::Tensor>& d) {
  Reducer::NamedTensors out;
  for (const auto& item : d) out.emplace_back(item.key(), item.value());
  return out;
}

}  // namespace detail

template <typename ModuleHolder>
class DistributedDataParallel {
 public:
  DistributedDataParallel(ModuleHolder module, std::shared_ptr<comm::Communicator> comm,
                          DDPOptions options = {})
      : module_(std::move(module)),
        reducer_(std::make_unique<Reducer>(detail::named(module_->named_parameters()),
                                           detail::named(module_->named_buffers()), std::move(comm),
                                           options)) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    const bool will_sync = reducer_->require_sync() && c10::GradMode::is_enabled();
    reducer_->prepare_for_forward(will_sync);
    auto out = module_->forward(std::forward<Args>(args)...);
    if (will_sync) {
      std::vector<at::Tensor> outputs;
      detail::collect(out, outputs);
      reducer_->prepare_for_backward(outputs);
    }
    return out;
  }

  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // The wrapped module (PyTorch's `ddp.module`).
  ModuleHolder& module() { return module_; }
  const ModuleHolder& module() const { return module_; }
  std::vector<at::Tensor> parameters() const { return module_->parameters(); }

  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*reducer_); }

  Reducer& reducer() { return *reducer_; }
  const ReducerStats& last_stats() const { return reducer_->last_stats(); }
  // DDPOptions::check_finite: whether the last synchronizing backward reduced an inf/NaN
  // gradient, for GradScaler::step(optimizer, ddp.found_inf()).
  const at::Tensor& found_inf() const { return reducer_->found_inf(); }

 private:
  ModuleHolder module_;
  std::unique_ptr<Reducer> reducer_;
};

}  // namespace dtrain::sharding
