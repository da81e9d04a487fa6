// Named choices: an enum whose values are spelled in configs and on command lines. Each enum
// lists its names once, as a table found by argument-dependent lookup beside the enum:
//
//   enum class Strategy { kNone, kDdp, kFsdp };
//   inline constexpr std::array<std::pair<Strategy, const char*>, 3> kStrategies{{
//       {Strategy::kNone, "none"}, {Strategy::kDdp, "ddp"}, {Strategy::kFsdp, "fsdp"}}};
//   constexpr const auto& choices(Strategy) { return kStrategies; }
//
// and everything else reads that table: name_of(Strategy::kDdp) is "ddp",
// choice_from_name<Strategy>("fsdp") the value, choice_list<Strategy>() "none, ddp, fsdp"
// for error messages. Header-only and free of LibTorch.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace dtrain {

template <typename E>
const char* name_of(E value) {
  for (const auto& [v, name] : choices(E{})) {
    if (v == value) return name;
  }
  return "?";
}

template <typename E>
std::optional<E> choice_from_name(std::string_view name) {
  for (const auto& [v, n] : choices(E{})) {
    if (name == n) return v;
  }
  return std::nullopt;
}

// "a, b, c": every name in the table's order, for "expected one of ..." messages.
template <typename E>
std::string choice_list() {
  std::string list;
  for (const auto& [v, name] : choices(E{})) {
    if (!list.empty()) list += ", ";
    list += name;
  }
  return list;
}

}  // namespace dtrain
