// Helpers shared by the fuzz targets: splitting libFuzzer's bytes into the pieces a target
// feeds to the code under test.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::fuzz {

// The bytes as a string.
inline std::string text(const uint8_t* data, size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

// (before the first '\0', after it); no '\0': (all of it, "").
inline std::pair<std::string, std::string> split_nul(const std::string& s) {
  const size_t nul = s.find('\0');
  if (nul == std::string::npos) return {s, ""};
  return {s.substr(0, nul), s.substr(nul + 1)};
}

// The lines of `s` ('\n'-separated; a final '\n' does not add an empty line).
inline std::vector<std::string> lines(const std::string& s, bool keep_empty) {
  std::vector<std::string> out;
  size_t begin = 0;
  while (begin < s.size()) {
    size_t end = s.find('\n', begin);
    if (end == std::string::npos) end = s.size();
    std::string line = s.substr(begin, end - begin);
    if (keep_empty || !line.empty()) out.push_back(std::move(line));
    begin = end + 1;
  }
  return out;
}

// With DTRAIN_FUZZ_VERBOSE set (replaying inputs by hand), each input's outcome is printed:
// "accepted" or the error a user would see.
inline void report(const char* outcome) {
  static const bool verbose = std::getenv("DTRAIN_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "dtrain fuzz: %s\n", outcome);
}

}  // namespace dtrain::fuzz
