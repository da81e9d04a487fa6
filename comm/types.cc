#include "comm/types.h"

#include <mutex>
#include <set>

#include "core/error.h"

namespace dtrain::comm {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "?";
}

const char* interned_name(const std::string& name) {
  static std::mutex mu;
  static auto* names = new std::set<std::string>();  // node-based: c_str() stays put; never freed
  std::lock_guard<std::mutex> lock(mu);
  return names->insert(name).first->c_str();
}

Backend parse_backend(const std::string& name) {
  if (std::optional<Backend> b = backend_from_name(name)) return *b;
  DTRAIN_FAIL(ConfigError, "unknown communication backend '", name, "'; expected one of ",
              backend_choices());
}

std::string dtype_name(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
      return "fp32";
    case c10::kDouble:
      return "fp64";
    case c10::kHalf:
      return "fp16";
    case c10::kBFloat16:
      return "bf16";
    case c10::kInt:
      return "int32";
    case c10::kLong:
      return "int64";
    case c10::kByte:
      return "uint8";
    default:
      return c10::toString(dtype);
  }
}

bool is_supported_dtype(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
    case c10::kDouble:
    case c10::kHalf:
    case c10::kBFloat16:
    case c10::kInt:
    case c10::kLong:
    case c10::kByte:
      return true;
    default:
      return false;
  }
}

}  // namespace dtrain::comm
