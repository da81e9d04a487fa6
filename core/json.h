// JSON string escaping, the one copy: the trace file (core/trace.h), the metrics file
// (framework/metrics.h) and checkpoints' meta.json (framework/checkpoint/meta.h) write their
// strings through it. Header-only and free of LibTorch.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

namespace dtrain::json {

// `s` escaped for inside a JSON string: quotes, backslashes and control characters (as
// \u00XX, which YAML reads too).
inline std::string escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

// `s` as a JSON string, quotes included.
inline std::string quote(std::string_view s) { return "\"" + escape(s) + "\""; }

}  // namespace dtrain::json
