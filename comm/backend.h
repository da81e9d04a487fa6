// The communication backends by name: the one list that the config, the launcher's --backend
// and the communicator factory read (header-only and free of LibTorch, so that the launcher
// can check --backend without linking dtrain's communicators).
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtrain::comm {

enum class Backend { kAuto, kMpi, kGloo, kNccl };

inline constexpr std::array<std::pair<Backend, const char*>, 4> kBackends{{
    {Backend::kAuto, "auto"},
    {Backend::kMpi, "mpi"},
    {Backend::kGloo, "gloo"},
    {Backend::kNccl, "nccl"},
}};

inline const char* to_string(Backend backend) {
  for (const auto& [b, name] : kBackends) {
    if (b == backend) return name;
  }
  return "?";
}

inline std::optional<Backend> backend_from_name(std::string_view name) {
  for (const auto& [b, n] : kBackends) {
    if (name == n) return b;
  }
  return std::nullopt;
}

// Every name, in order: a config's list of choices.
inline std::vector<std::string> backend_names() {
  std::vector<std::string> names;
  for (const auto& [b, name] : kBackends) names.emplace_back(name);
  return names;
}

// "auto, mpi, gloo or nccl", for messages.
inline std::string backend_choices() {
  std::string s;
  for (size_t i = 0; i < kBackends.size(); ++i) {
    if (i > 0) s += i + 1 == kBackends.size() ? " or " : ", ";
    s += kBackends[i].second;
  }
  return s;
}

}  // namespace dtrain::comm
