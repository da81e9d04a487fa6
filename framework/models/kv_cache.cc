#include "framework/models/kv_cache.h"

#include <cmath>
#include <limits>

#include "core/error.h"

namespace dtrain::framework {

std::pair<at::Tensor, at::Tensor> KVCache::append(size_t layer, const at::Tensor& k,
                                                  const at::Tensor& v) {
  const int64_t t = k.size(2);
  DTRAIN_CHECK_AS(UsageError, length_ + t <= capacity_, "KVCache: ", length_, " + ", t,
                  " positions exceed the model's context of ", capacity_);
  if (keys_.size() <= layer) {
    keys_.resize(layer + 1);
    values_.resize(layer + 1);
  }
  at::Tensor& K = keys_[layer];
  at::Tensor& V = values_[layer];
  if (!K.defined() || K.size(0) != k.size(0) || K.scalar_type() != k.scalar_type()) {
    K = at::empty({k.size(0), k.size(1), capacity_, k.size(3)}, k.options());
    V = at::empty({v.size(0), v.size(1), capacity_, v.size(3)}, v.options());
  }
  K.narrow(2, length_, t).copy_(k);
  V.narrow(2, length_, t).copy_(v);
  return {K.narrow(2, 0, length_ + t), V.narrow(2, 0, length_ + t)};
}

at::Tensor cached_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t T = q.size(2), L = k.size(2), D = q.size(3);
  at::Tensor att = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(D)));
  if (T > 1) {
    // Query i sits at position L - T + i and sees keys 0 .. L - T + i.
    at::Tensor mask =
        at::ones({T, L}, at::TensorOptions().dtype(at::kBool).device(q.device())).triu(L - T + 1);
    att = att.masked_fill(mask, -std::numeric_limits<float>::infinity());
  }
  att = at::softmax(att.to(at::kFloat), -1).to(v.scalar_type());
  return at::matmul(att, v);
}

}  // namespace dtrain::framework
