#include "comm/staging.h"

#include <ATen/ops/empty.h>

namespace dtrain::comm {

at::Tensor to_host(const at::Tensor& t) { return t.is_cpu() ? t : t.to(at::kCPU); }

void copy_back(const at::Tensor& original, const at::Tensor& host) {
  if (!original.is_same(host)) original.copy_(host);
}

at::Tensor host_like(const at::Tensor& t) {
  return t.is_cpu() ? t : at::empty(t.sizes(), t.options().device(at::kCPU));
}

}  // namespace dtrain::comm
