// Flat-buffer pieces that DDP's buckets and FSDP's units share.
//
//   flat_slot        a tensor shaped like a parameter over a range of a flat buffer; it
//                    shares the buffer's storage but is not an autograd view, because
//                    LibTorch's Optimizer::zero_grad() calls detach_() on every gradient and
//                    autograd refuses detach_() on views
//   divide_factors   how a gradient reduction averages: before and after the collective
//   ParamPlace,      where a unit's shards hold each parameter's elements (ShardLayout),
//   locate           for the unit itself and for sharded checkpoints read at another size
//   free_storage /   drop and re-create a buffer's memory while keeping its Storage object,
//   alloc_storage    so every tensor that views it (parameters, tensors autograd saved in
//                    forward) sees the data again once it is refilled (FSDP's reshard and
//                    unshard)
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "sharding/sharding_strategy.h"

namespace dtrain::sharding {

// One parameter of a unit sharded over N ranks, each holding a shard of S elements.
struct ParamPlace {
  int64_t offset = 0;  // first element in the unit's parameters flattened and concatenated
  int64_t numel = 0;
  int64_t chunk = 0;     // per_parameter: elements per rank, padding included
  int64_t shard_at = 0;  // per_parameter: where its chunk starts in every rank's shard
};

// Places the parameters (their shapes, in order) for a shard group of n ranks; returns S.
// per_parameter: chunk = ceil(dim0 / n) rows (a 0-dim parameter is one row).
int64_t place_params(ShardLayout layout, const std::vector<std::vector<int64_t>>& shapes, int64_t n,
                     std::vector<ParamPlace>& out);

// Element e of a parameter: the rank holding it, its position in that rank's shard, and how
// many of the parameter's elements from e on follow it there (at least 1).
struct Located {
  int64_t rank = 0;
  int64_t pos = 0;
  int64_t run = 0;
};
Located locate(ShardLayout layout, const ParamPlace& p, int64_t shard_size, int64_t e);

// The parameter's elements that rank r holds: [begin, begin + count) of the parameter, at
// `pos` in r's shard (count may be 0).
struct Held {
  int64_t begin = 0;
  int64_t count = 0;
  int64_t pos = 0;
};
Held held_by(ShardLayout layout, const ParamPlace& p, int64_t shard_size, int64_t r);

at::Tensor flat_slot(const at::Tensor& flat, int64_t offset, at::IntArrayRef shape);
// The same with explicit strides (a non-contiguous parameter's own layout).
at::Tensor flat_slot(const at::Tensor& flat, int64_t offset, at::IntArrayRef shape,
                     at::IntArrayRef strides);

// Gradients are averaged over `world` ranks as grad / pre, reduced (SUM), then / post, with
// pre * post = world. fp32/fp64: pre = world, post = 1 (PyTorch's DDP). 16-bit reduce dtypes
// split it as PyTorch's FSDP does, so the sum neither overflows nor underflows: pre starts at
// 1 and doubles while world % pre == 0 and world / pre > pre; post = world / pre, which is not
// an integer at world sizes like 3 (pre 2, post 1.5).
struct DivideFactors {
  double pre = 1;
  double post = 1;
};
DivideFactors divide_factors(int64_t world, c10::ScalarType reduce_dtype);

// FSDP2's rule (_get_gradient_divide_factors): fp32 and bf16 gradients are summed, then
// divided once after the collective (ReduceOp.AVG); fp16 takes divide_factors' pre/post split.
inline bool fsdp_averages_after(c10::ScalarType reduce_dtype) {
  return reduce_dtype == c10::kFloat || reduce_dtype == c10::kBFloat16;
}

class BufferPool;

// Releases t's memory; t and its views keep their shapes, and must not be read until
// alloc_storage. The Storage object stays the same.
void free_storage(const at::Tensor& t);
// Gives t's storage memory for t's elements again (uninitialized), on t's device; from
// `pool` when given and t is on the CPU.
void alloc_storage(const at::Tensor& t, BufferPool* pool = nullptr);
bool storage_allocated(const at::Tensor& t);

// Keeps freed CPU buffers of the sizes a training step allocates again and again (FSDP's
// gathered units and gradient buffers) for the next step, instead of returning them to
// malloc, which hands large blocks back to the kernel and faults fresh pages in on the next
// allocation. CUDA's caching allocator does this already; CPU tensors have no cache. A
// buffer handed out returns to the pool when its last user lets go (a collective on a worker
// thread too). At most `per_size` buffers of each size are kept; pooled bytes stay
// allocated (and count as tracked memory).
class BufferPool {
 public:
  explicit BufferPool(int64_t per_size);
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // An uninitialized 1-D CPU tensor of `numel` elements whose memory comes from the pool.
  at::Tensor empty(int64_t numel, at::TensorOptions options);
  // Memory for `bytes`, pooled or fresh.
  at::DataPtr take(size_t bytes);
  int64_t pooled_bytes() const;

  struct Shared;  // shared with the buffers handed out, which may outlive the pool

 private:
  std::shared_ptr<Shared> shared_;
};

}  // namespace dtrain::sharding
