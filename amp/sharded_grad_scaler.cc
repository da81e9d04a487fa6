#include "amp/sharded_grad_scaler.h"

#include <ATen/ATen.h>

#include "core/error.h"

namespace dtrain::amp {

ShardedGradScaler::ShardedGradScaler(std::shared_ptr<comm::Communicator> comm,
                                     GradScalerOptions options)
    : GradScaler(options), comm_(std::move(comm)) {
  DTRAIN_CHECK_AS(UsageError, comm_ != nullptr, "ShardedGradScaler needs a communicator");
}

void ShardedGradScaler::sync_found_inf(PerDevice& found, const at::Tensor& scale) {
  // A rank whose shard holds no gradient still takes part, with a zero flag on the scale's
  // device, so the collective below never waits for it in vain.
  if (found.empty()) found.emplace(scale.device(), at::zeros({1}, scale.options()));
  // One collective per unscale_, whatever the number of devices on this rank: every rank
  // issues exactly the same sequence. NCCL needs it on the (CUDA) scale's device.
  c10::Device comm_device =
      comm_->device_type() == c10::kCUDA ? scale.device() : c10::Device(c10::kCPU);
  at::Tensor flag = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(comm_device));
  for (auto& [device, f] : found) flag.add_(f.reshape({1}).to(comm_device));
  flag.clamp_max_(1.0);
  comm_->all_reduce(flag, comm::ReduceOp::kMax).wait();
  for (auto& [device, f] : found) f.copy_(flag.reshape(f.sizes()));
}

at::Tensor ShardedGradScaler::finish_scale(const at::Tensor& scaled, const at::Tensor& input) {
  return scaled.to(input.scalar_type());
}

}  // namespace dtrain::amp
