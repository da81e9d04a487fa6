#include "core/error.h"

#include <algorithm>
#include <cstdlib>
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

namespace {

bool is_source_file(const std::string& path) {
  for (const char* ext : {".cc", ".h", ".cpp", ".hpp"}) {
    const size_t n = std::strlen(ext);
    if (path.size() > n && path.compare(path.size() - n, n, ext) == 0) return true;
  }
  return false;
}

}  // namespace

std::string without_backtrace(const std::string& what) {
  size_t cut = std::string::npos;
  for (const char* marker : {"\nException raised from ", "\nframe #"}) {
    cut = std::min(cut, what.find(marker));
  }
  if (cut == std::string::npos) return what;
  // Keep what follows the backtrace when dtrain appended advice after a c10 message: that
  // text starts after the last frame line.
  std::string head = what.substr(0, cut);
  size_t last_frame = what.rfind("\nframe #");
  if (last_frame != std::string::npos && last_frame >= cut) {
    size_t end = what.find('\n', last_frame + 1);
    if (end != std::string::npos) {
      std::string tail = what.substr(end + 1);
      size_t start = tail.find_first_not_of(" \n");
      if (start != std::string::npos) head += " " + tail.substr(start);
    }
  }
  return head;
}

std::string clause(const std::string& what) {
  std::string text = without_backtrace(what);
  while (!text.empty() && (text.back() == '.' || text.back() == ' ' || text.back() == '\n')) {
    text.pop_back();
  }
  return text;
}

std::string user_message(const std::string& what, bool debug) {
  if (debug) return what;
  std::string text = without_backtrace(what);
  // Drop every " [dir/file.cc:NN]" tag (composed messages can hold several).
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    if (text.compare(i, 2, " [") == 0) {
      size_t close = text.find(']', i + 2);
      if (close != std::string::npos) {
        const std::string inner = text.substr(i + 2, close - i - 2);
        const size_t colon = inner.rfind(':');
        const bool tag = colon != std::string::npos && colon + 1 < inner.size() &&
                         inner.find(' ') == std::string::npos &&
                         inner.find_first_not_of("0123456789", colon + 1) == std::string::npos &&
                         is_source_file(inner.substr(0, colon));
        if (tag) {
          i = close + 1;
          continue;
        }
      }
    }
    out += text[i++];
  }
  return out;
}

std::string strip_location(const std::string& what) {
  if (what.empty() || what.back() != ']') return what;
  auto open = what.rfind(" [");
  return open == std::string::npos ? what : what.substr(0, open);
}

}  // namespace dtrain::detail

namespace dtrain {

std::string message_of(const std::exception& e) {
  const char* level = std::getenv("DTRAIN_LOG_LEVEL");
  const bool debug =
      level != nullptr && (std::strcmp(level, "debug") == 0 || std::strcmp(level, "trace") == 0);
  return detail::user_message(e.what(), debug);
}

}  // namespace dtrain
