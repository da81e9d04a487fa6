#include "core/faults.h"

#include <cstdlib>
#include <limits>
#include <sstream>

#include "core/error.h"

namespace dtrain::faults {

std::optional<std::string> text(const char* name) {
  const std::string var = std::string("DTRAIN_TEST_") + name;
  const char* v = std::getenv(var.c_str());
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

std::optional<StepRank> step_rank(const char* name) {
  std::optional<std::string> v = text(name);
  if (!v) return std::nullopt;
  std::istringstream in(*v);
  StepRank at;
  char colon = 0;
  in >> at.step >> colon >> at.rank;
  DTRAIN_CHECK_AS(UsageError, in && colon == ':' && in.peek() == std::char_traits<char>::eof(),
                  "DTRAIN_TEST_", name, "='", *v, "': expected <step>:<rank>, two integers");
  return at;
}

std::optional<Range> range(const char* name, double default_factor) {
  std::optional<std::string> v = text(name);
  if (!v) return std::nullopt;
  std::istringstream in(*v);
  Range r;
  r.factor = default_factor;
  char colon = 0;
  in >> r.first >> colon >> r.count;
  bool ok = in && colon == ':' && r.first >= 1 && r.count >= 1;
  if (ok && in.peek() == ':') {
    in.get();
    std::string factor;
    in >> factor;
    if (factor == "nan") {
      r.factor = std::numeric_limits<double>::quiet_NaN();
    } else {
      std::istringstream f(factor);
      ok = static_cast<bool>(f >> r.factor) && f.peek() == std::char_traits<char>::eof();
    }
  }
  DTRAIN_CHECK_AS(UsageError, ok && in.peek() == std::char_traits<char>::eof(), "DTRAIN_TEST_",
                  name, "='", *v, "': expected <first>:<count>[:<factor>], first and count >= 1");
  return r;
}

std::vector<std::string> words(const char* name) {
  std::vector<std::string> out;
  std::optional<std::string> v = text(name);
  if (!v) return out;
  std::istringstream in(*v);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

}  // namespace dtrain::faults
