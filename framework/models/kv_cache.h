// The keys and values a decoder has computed, layer by layer, so that each generated token runs
// the model over that token alone instead of the whole sequence again (Hugging Face's
// DynamicCache, in buffers allocated once for the model's context: appending copies the new
// positions in, never the old ones). Generation is then linear in its length, not quadratic.
//
//   KVCache cache(context);
//   logits = model->forward_cached(prompt, cache);       // [B, T, V]; cache.length() == T
//   logits = model->forward_cached(next_token, cache);   // [B, 1, V]; one position more
//
// Every layer appends at the same positions during one forward; the model then advances the
// cache by the number of new tokens (advance()).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace dtrain::framework {

class KVCache {
 public:
  explicit KVCache(int64_t capacity) : capacity_(capacity) {}

  int64_t capacity() const { return capacity_; }
  int64_t length() const { return length_; }  // positions cached
  // Layer `layer`'s k and v [B, heads, T, D] stored at positions [length, length + T); returns
  // the cached keys and values of positions [0, length + T).
  std::pair<at::Tensor, at::Tensor> append(size_t layer, const at::Tensor& k, const at::Tensor& v);
  // After every layer appended T positions.
  void advance(int64_t t) { length_ += t; }
  void clear() {
    length_ = 0;
    keys_.clear();
    values_.clear();
  }

 private:
  int64_t capacity_;
  int64_t length_ = 0;
  std::vector<at::Tensor> keys_, values_;  // per layer [B, heads, capacity, D]
};

// Causal attention of queries q [B, H, T, D] at positions [L - T, L) over keys and values
// [B, H, L, D] of positions [0, L): each query sees the keys up to its own position. The
// explicit softmax in fp32, as the models' own explicit kernels.
at::Tensor cached_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

}  // namespace dtrain::framework
