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

}  // namespace dtrain::detail
