#include "sharding/flat.h"

#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/Storage.h>
#include <c10/util/strides.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <vector>

namespace dtrain::sharding {

int64_t place_params(ShardLayout layout, const std::vector<std::vector<int64_t>>& shapes, int64_t n,
                     std::vector<ParamPlace>& out) {
  out.clear();
  int64_t total = 0, used = 0;
  for (const auto& shape : shapes) {
    ParamPlace p;
    p.offset = total;
    p.numel = 1;
    for (int64_t d : shape) p.numel *= d;
    if (layout == ShardLayout::kPerParameter) {
      const int64_t rows = shape.empty() ? 1 : shape[0];
      const int64_t row_numel = rows > 0 ? p.numel / rows : 0;
      p.chunk = (rows + n - 1) / n * row_numel;
      p.shard_at = used;
      used += p.chunk;
    }
    total += p.numel;
    out.push_back(p);
  }
  if (layout == ShardLayout::kFlat) used = (total + n - 1) / n;
  return std::max<int64_t>(1, used);
}

Located locate(ShardLayout layout, const ParamPlace& p, int64_t shard_size, int64_t e) {
  Located l;
  if (layout == ShardLayout::kPerParameter) {
    l.rank = e / p.chunk;
    const int64_t in = e - l.rank * p.chunk;
    l.pos = p.shard_at + in;
    l.run = std::min(p.chunk - in, p.numel - e);
  } else {
    const int64_t u = p.offset + e;
    l.rank = u / shard_size;
    l.pos = u - l.rank * shard_size;
    l.run = std::min(shard_size - l.pos, p.numel - e);
  }
  return l;
}

Held held_by(ShardLayout layout, const ParamPlace& p, int64_t shard_size, int64_t r) {
  Held h;
  if (layout == ShardLayout::kPerParameter) {
    h.begin = std::min(r * p.chunk, p.numel);
    h.count = std::min(p.chunk, p.numel - h.begin);
    h.pos = p.shard_at;
  } else {
    const int64_t lo = r * shard_size;
    const int64_t begin = std::max(p.offset, lo);
    const int64_t end = std::min(p.offset + p.numel, lo + shard_size);
    if (end > begin) {
      h.begin = begin - p.offset;
      h.count = end - begin;
      h.pos = begin - lo;
    }
  }
  return h;
}

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

void alloc_storage(const at::Tensor& t, BufferPool* pool) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.storage_offset() + t.numel()) * t.element_size();
  if (s->nbytes() >= bytes) return;
  s->set_data_ptr_noswap(pool != nullptr && t.is_cpu() ? pool->take(bytes)
                                                       : s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}

struct BufferPool::Shared {
  std::mutex mu;
  int64_t per_size;
  bool closed = false;
  std::map<size_t, std::vector<at::DataPtr>> free;  // by byte size
  int64_t pooled = 0;
};

namespace {

// The context of a pooled DataPtr: the real allocation, and where to return it.
struct Lease {
  at::DataPtr inner;
  size_t bytes;
  std::shared_ptr<BufferPool::Shared> pool;
};

}  // namespace

BufferPool::BufferPool(int64_t per_size) : shared_(std::make_shared<Shared>()) {
  shared_->per_size = per_size;
}

BufferPool::~BufferPool() {
  std::map<size_t, std::vector<at::DataPtr>> drop;
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared_->closed = true;  // buffers still out are freed when their users let go
    drop.swap(shared_->free);
    shared_->pooled = 0;
  }
}

at::DataPtr BufferPool::take(size_t bytes) {
  at::DataPtr inner;
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    auto it = shared_->free.find(bytes);
    if (it != shared_->free.end() && !it->second.empty()) {
      inner = std::move(it->second.back());
      it->second.pop_back();
      shared_->pooled -= static_cast<int64_t>(bytes);
    }
  }
  if (!inner) inner = c10::GetCPUAllocator()->allocate(bytes);
  void* data = inner.get();
  auto* lease = new Lease{std::move(inner), bytes, shared_};
  return at::DataPtr(
      data, lease,
      [](void* ctx) {
        std::unique_ptr<Lease> l(static_cast<Lease*>(ctx));
        std::lock_guard<std::mutex> lock(l->pool->mu);
        auto& list = l->pool->free[l->bytes];
        if (!l->pool->closed && static_cast<int64_t>(list.size()) < l->pool->per_size) {
          list.push_back(std::move(l->inner));
          l->pool->pooled += static_cast<int64_t>(l->bytes);
        }
      },
      c10::Device(c10::kCPU));
}

at::Tensor BufferPool::empty(int64_t numel, at::TensorOptions options) {
  if (!options.device().is_cpu()) return at::empty({numel}, options);
  const size_t bytes =
      static_cast<size_t>(numel) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, take(bytes), /*allocator=*/nullptr,
                       /*resizable=*/false);
  at::Tensor t = at::empty({0}, options);
  t.set_(storage, 0, {numel}, {1});
  return t;
}

int64_t BufferPool::pooled_bytes() const {
  std::lock_guard<std::mutex> lock(shared_->mu);
  return shared_->pooled;
}

bool storage_allocated(const at::Tensor& t) { return t.storage().nbytes() > 0; }

}  // namespace dtrain::sharding
