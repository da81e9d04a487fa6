// ShardedGradScaler: a GradScaler for sharded (FSDP) or otherwise partitioned gradients,
// with the semantics of torch.distributed.fsdp.ShardedGradScaler:
//   - after each rank unscales its own gradients, the found-inf flag is all-reduced (MAX)
//     over the communicator before any rank decides, so every rank steps or skips together;
//   - a rank whose optimizer holds no gradient at all still contributes a zero flag, so the
//     collective never hangs;
//   - fp16 gradients are accepted (sharded low-precision gradients are normal here);
//   - scale() returns the scaled output in the input's dtype.
// One difference from PyTorch, on CPU only: PyTorch's CPU update path multiplies the scale
// by growth_factor even when the result overflows to inf; dtrain uses
// at::_amp_update_scale_ on every device, which keeps the old scale in that case.
#pragma once

#include <memory>

#include "amp/grad_scaler.h"
#include "comm/communicator.h"

namespace dtrain::amp {

class ShardedGradScaler : public GradScaler {
 public:
  ShardedGradScaler(std::shared_ptr<comm::Communicator> comm, GradScalerOptions options = {});

 protected:
  bool allow_fp16_grads() const override { return true; }
  void sync_found_inf(PerDevice& found, const at::Tensor& scale) override;
  at::Tensor finish_scale(const at::Tensor& scaled, const at::Tensor& input) override;

 private:
  std::shared_ptr<comm::Communicator> comm_;
};

}  // namespace dtrain::amp
