// "--name=value" arguments of test binaries: the paths Bazel ($(location ...)) and CMake
// ($<TARGET_FILE:...>) pass to tests that run other programs.
#pragma once

#include <string>

namespace dtrain::testing {

// The value of --name=value among argv, or "" when absent.
inline std::string flag_value(int argc, char** argv, const std::string& name) {
  const std::string prefix = "--" + name + "=";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind(prefix, 0) == 0) return a.substr(prefix.size());
  }
  return "";
}

}  // namespace dtrain::testing
