// One all-reduce for many small tensors: flattened into one buffer per dtype (or all in one
// given dtype), reduced in a single collective, and copied back in place. How Megatron-LM
// all-reduces its layer norms' gradients, and how a pipeline stage averages its gradients over
// its data-parallel ranks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <vector>

#include "comm/communicator.h"

namespace dtrain::comm {

// Every defined, non-empty tensor of `tensors` ends as op over the ranks of `comm` (each rank
// passes the same tensors, in the same order). `as`: reduce every tensor in this dtype (a
// reduce dtype), each copied back into its own; otherwise one buffer per dtype.
void all_reduce_coalesced(Communicator& comm, const std::vector<at::Tensor>& tensors,
                          ReduceOp op = ReduceOp::kSum,
                          std::optional<at::ScalarType> as = std::nullopt);

}  // namespace dtrain::comm
