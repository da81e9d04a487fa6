// Paths matching a shell pattern ("data/train_*.bin"), sorted; a path without wildcards
// matches itself when it exists. Header-only: the config parser and the data sources share
// it, and the config's fuzz target links nothing else.
#pragma once

#include <glob.h>

#include <algorithm>
#include <string>
#include <vector>

namespace dtrain {

inline std::vector<std::string> glob_files(const std::string& pattern) {
  std::vector<std::string> out;
  glob_t g{};
  if (::glob(pattern.c_str(), GLOB_NOSORT, nullptr, &g) == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  }
  ::globfree(&g);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace dtrain
