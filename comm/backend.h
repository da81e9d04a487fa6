// The communication backends by name: the one list that the config, the launcher's --backend
// and the communicator factory read (header-only and free of LibTorch, so that the launcher
// can check --backend without linking dtrain's communicators).
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "core/choices.h"

namespace dtrain::comm {

enum class Backend { kAuto, kMpi, kGloo, kNccl };

inline constexpr std::array<std::pair<Backend, const char*>, 4> kBackends{{
    {Backend::kAuto, "auto"},
    {Backend::kMpi, "mpi"},
    {Backend::kGloo, "gloo"},
    {Backend::kNccl, "nccl"},
}};

// The table core/choices.h reads (name_of, choice_from_name, choice_list).
constexpr const auto& choices(Backend) { return kBackends; }

inline const char* to_string(Backend backend) { return name_of(backend); }

inline std::optional<Backend> backend_from_name(std::string_view name) {
  return choice_from_name<Backend>(name);
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
