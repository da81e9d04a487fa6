// Host staging for backends that only reach host memory (MPI without CUDA awareness, Gloo):
// a CUDA tensor is copied to the host before the collective and back after it.
//
// Backends see every tensor as a flat 1-D buffer of its elements, whatever shape the caller
// passed (0-d to n-d): the API promises element-order semantics only, and Gloo otherwise
// refuses or crashes on shapes it does not expect (0-d shards, [world, n] flats).
#pragma once

#include <ATen/core/Tensor.h>

namespace dtrain::comm {

// A 1-D host tensor over t's elements: a view of t when t is on the host, else a copy.
at::Tensor to_host_flat(const at::Tensor& t);

// A 1-D host buffer for t's elements: a view of t when t is on the host, else uninitialized.
at::Tensor host_flat_like(const at::Tensor& t);

// Copies `host` back into `original` unless they already share memory (original on CUDA).
void copy_back(const at::Tensor& original, const at::Tensor& host);

}  // namespace dtrain::comm
