#include "core/error.h"

#include <cstring>

namespace dtrain::detail {

const char* short_path(const char* file) {
  // Bazel passes paths relative to the workspace; CMake passes absolute ones.
  for (const char* top : {"/core/", "/comm/", "/amp/", "/sharding/", "/framework/", "/launcher/",
                          "/bench/", "/tests/"}) {
    if (const char* at = std::strstr(file, top)) return at + 1;
  }
  return file;
}

std::string strip_location(const std::string& what) {
  if (what.empty() || what.back() != ']') return what;
  auto open = what.rfind(" [");
  return open == std::string::npos ? what : what.substr(0, open);
}

}  // namespace dtrain::detail
