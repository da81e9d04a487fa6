#include "comm/coalesced.h"

#include <ATen/ATen.h>

#include <map>

namespace dtrain::comm {

void all_reduce_coalesced(Communicator& comm, const std::vector<at::Tensor>& tensors, ReduceOp op,
                          std::optional<at::ScalarType> as) {
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) by_dtype[as.value_or(t.scalar_type())].push_back(t);
  }
  for (auto& [dtype, list] : by_dtype) {
    std::vector<at::Tensor> flat;
    for (const auto& t : list) flat.push_back(t.reshape({-1}).to(dtype));
    at::Tensor buffer = at::cat(flat);
    comm.all_reduce(buffer, op).wait();
    int64_t offset = 0;
    for (auto& t : list) {
      t.copy_(buffer.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace dtrain::comm
