// What DDP and FSDP need from a module's forward result, whatever its type: the tensors in
// it (FSDP hooks each one that requires grad, so the unit is gathered again before its
// backward; DDP's find_unused_parameters walks the graph from them), and the same value
// with each tensor transformed (FSDP's output_dtype cast).
//
// Understood types, nested to any depth: at::Tensor; std::pair, std::tuple, std::optional;
// std::vector, std::array, std::deque, std::list; std::map and std::unordered_map (their
// values); arithmetic, enum and string values (no tensors). A struct of the user's own
// exposes its tensors with one member template, which visits each of them in place:
//
//   struct BlockOut {
//     at::Tensor hidden;
//     std::optional<at::Tensor> attention;
//     template <typename F>
//     void for_each_tensor(F&& f) { f(hidden); if (attention) f(*attention); }
//   };
//
// Any other type is refused at compile time, naming the type in the instantiation trace: a
// wrapped unit whose output tensors went unseen would be resharded before its backward.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <deque>
#include <list>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace dtrain::sharding::detail {

template <typename T>
struct IsSequence : std::false_type {};
template <typename T, typename A>
struct IsSequence<std::vector<T, A>> : std::true_type {};
template <typename T, size_t N>
struct IsSequence<std::array<T, N>> : std::true_type {};
template <typename T, typename A>
struct IsSequence<std::deque<T, A>> : std::true_type {};
template <typename T, typename A>
struct IsSequence<std::list<T, A>> : std::true_type {};

template <typename T>
struct IsMap : std::false_type {};
template <typename K, typename V, typename C, typename A>
struct IsMap<std::map<K, V, C, A>> : std::true_type {};
template <typename K, typename V, typename H, typename E, typename A>
struct IsMap<std::unordered_map<K, V, H, E, A>> : std::true_type {};

template <typename T>
struct IsOptional : std::false_type {};
template <typename T>
struct IsOptional<std::optional<T>> : std::true_type {};

template <typename T>
struct IsPair : std::false_type {};
template <typename A, typename B>
struct IsPair<std::pair<A, B>> : std::true_type {};

template <typename T>
struct IsTuple : std::false_type {};
template <typename... Ts>
struct IsTuple<std::tuple<Ts...>> : std::true_type {};

struct TensorVisitorProbe {
  void operator()(at::Tensor& /*t*/) const {}
};
template <typename T, typename = void>
struct HasForEachTensor : std::false_type {};
template <typename T>
struct HasForEachTensor<T, std::void_t<decltype(std::declval<T&>().for_each_tensor(
                               std::declval<TensorVisitorProbe&>()))>> : std::true_type {};

template <typename T>
struct Unsupported : std::false_type {};

// Calls f(at::Tensor&) on every tensor inside x, in a fixed order.
template <typename T, typename F>
void for_each_tensor(T& x, F& f) {
  using D = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<D, at::Tensor>) {
    f(x);
  } else if constexpr (IsOptional<D>::value) {
    if (x) for_each_tensor(*x, f);
  } else if constexpr (IsPair<D>::value) {
    for_each_tensor(x.first, f);
    for_each_tensor(x.second, f);
  } else if constexpr (IsTuple<D>::value) {
    std::apply([&](auto&... e) { (for_each_tensor(e, f), ...); }, x);
  } else if constexpr (IsSequence<D>::value) {
    for (auto& e : x) for_each_tensor(e, f);
  } else if constexpr (IsMap<D>::value) {
    for (auto& kv : x) for_each_tensor(kv.second, f);
  } else if constexpr (HasForEachTensor<D>::value) {
    x.for_each_tensor([&](at::Tensor& t) { f(t); });
  } else if constexpr (std::is_arithmetic_v<D> || std::is_enum_v<D> ||
                       std::is_same_v<D, std::string>) {
    // holds no tensor
  } else {
    static_assert(Unsupported<D>::value,
                  "dtrain: a module wrapped by DDP or FSDP returned a type whose tensors dtrain "
                  "cannot find. Return tensors in std containers (pair, tuple, optional, "
                  "vector, array, map), or give the type a member "
                  "`template <typename F> void for_each_tensor(F&& f)` that calls f(at::Tensor&) "
                  "on each of its tensors (see sharding/outputs.h)");
  }
}

// The tensors in `value`, appended to `out`.
template <typename T>
void collect(const T& value, std::vector<at::Tensor>& out) {
  T copy = value;  // tensors are shared, not copied
  auto push = [&](at::Tensor& t) { out.push_back(t); };
  for_each_tensor(copy, push);
}

// `value` with each tensor replaced by f(tensor).
template <typename T, typename F>
T transform(T value, const F& f) {
  auto apply = [&](at::Tensor& t) { t = f(t); };
  for_each_tensor(value, apply);
  return value;
}

}  // namespace dtrain::sharding::detail
