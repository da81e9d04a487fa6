#include "sharding/flat.h"

#include <ATen/ops/empty.h>
#include <c10/core/Storage.h>
#include <c10/util/strides.h>

namespace dtrain::sharding {

at::Tensor flat_slot(const at::Tensor& flat, int64_t offset, at::IntArrayRef shape) {
  return flat_slot(flat, offset, shape, c10::contiguous_strides(shape));
}

at::Tensor flat_slot(const at::Tensor& flat, int64_t offset, at::IntArrayRef shape,
                     at::IntArrayRef strides) {
  at::Tensor t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, shape, strides);
  return t;
}

DivideFactors divide_factors(int64_t world, c10::ScalarType reduce_dtype) {
  DivideFactors f;
  if (reduce_dtype == c10::kHalf || reduce_dtype == c10::kBFloat16) {
    int64_t pre = 1;
    while (world % pre == 0 && world / pre > pre) pre *= 2;
    f.pre = static_cast<double>(pre);
  } else {
    f.pre = static_cast<double>(world);
  }
  f.post = static_cast<double>(world) / f.pre;
  return f;
}

void free_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == 0) return;
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}

void alloc_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.storage_offset() + t.numel()) * t.element_size();
  if (s->nbytes() >= bytes) return;
  s->set_data_ptr_noswap(s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

bool storage_allocated(const at::Tensor& t) { return t.storage().nbytes() > 0; }

}  // namespace dtrain::sharding
