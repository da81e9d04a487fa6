// Host staging for backends that only reach host memory (MPI without CUDA awareness, Gloo):
// a CUDA tensor is copied to the host before the collective and back after it.
#pragma once

#include <ATen/core/Tensor.h>

namespace dtrain::comm {

// `t` itself when on the host, else a host copy.
at::Tensor to_host(const at::Tensor& t);

// Copies `host` back into `original` when they are different tensors (original on CUDA).
void copy_back(const at::Tensor& original, const at::Tensor& host);

// Host buffer shaped like `t` (uninitialized), or `t` itself when on the host.
at::Tensor host_like(const at::Tensor& t);

}  // namespace dtrain::comm
