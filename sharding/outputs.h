// What DDP and FSDP need from a module's forward result, whatever its type: the tensors in
// it (at::Tensor, std::vector<at::Tensor>, std::tuple of those; anything else holds none),
// and the same value with each tensor transformed (FSDP's output_dtype cast).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>
#include <utility>
#include <vector>

namespace dtrain::sharding::detail {

inline void collect(const at::Tensor& t, std::vector<at::Tensor>& out) { out.push_back(t); }
inline void collect(const std::vector<at::Tensor>& ts, std::vector<at::Tensor>& out) {
  out.insert(out.end(), ts.begin(), ts.end());
}
template <typename... Ts>
void collect(const std::tuple<Ts...>& t, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... x) { (collect(x, out), ...); }, t);
}
template <typename T>
void collect(const T& /*other*/, std::vector<at::Tensor>& /*out*/) {}

template <typename F>
at::Tensor transform(at::Tensor t, const F& f) {
  return f(t);
}
template <typename F>
std::vector<at::Tensor> transform(std::vector<at::Tensor> ts, const F& f) {
  for (auto& t : ts) t = f(t);
  return ts;
}
template <typename F, typename... Ts>
std::tuple<Ts...> transform(std::tuple<Ts...> t, const F& f) {
  return std::apply([&](auto&&... x) { return std::tuple<Ts...>(transform(std::move(x), f)...); },
                    std::move(t));
}
template <typename T, typename F>
T transform(T other, const F& /*f*/) {
  return other;
}

}  // namespace dtrain::sharding::detail
