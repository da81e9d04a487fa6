#include "comm/staging.h"

#include <ATen/ops/empty.h>

namespace dtrain::comm {

at::Tensor to_host_flat(const at::Tensor& t) {
  return (t.is_cpu() ? t : t.to(at::kCPU)).reshape({-1});
}

at::Tensor host_flat_like(const at::Tensor& t) {
  return t.is_cpu() ? t.reshape({-1}) : at::empty({t.numel()}, t.options().device(at::kCPU));
}

void copy_back(const at::Tensor& original, const at::Tensor& host) {
  if (original.is_cpu() && original.data_ptr() == host.data_ptr()) return;
  original.copy_(host.view(original.sizes()));
}

}  // namespace dtrain::comm
