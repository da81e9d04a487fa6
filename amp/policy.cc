#include "amp/policy.h"

#include <iterator>
#include <map>
#include <mutex>
#include <sstream>
#include <utility>

#include "comm/types.h"
#include "core/error.h"

namespace dtrain::amp {

MixedPrecisionPolicy MixedPrecisionPolicy::fp32() { return {}; }

MixedPrecisionPolicy MixedPrecisionPolicy::bf16() {
  MixedPrecisionPolicy p;
  p.param_dtype = c10::kBFloat16;
  p.reduce_dtype = c10::kBFloat16;
  p.buffer_dtype = c10::kBFloat16;
  return p;
}

MixedPrecisionPolicy MixedPrecisionPolicy::fp16() {
  MixedPrecisionPolicy p;
  p.param_dtype = c10::kHalf;
  p.reduce_dtype = c10::kHalf;
  p.buffer_dtype = c10::kHalf;
  return p;
}

MixedPrecisionPolicy MixedPrecisionPolicy::preset(const std::string& name) {
  if (name == "fp32") return fp32();
  if (name == "bf16") return bf16();
  if (name == "fp16") return fp16();
  DTRAIN_FAIL(ConfigError, "unknown precision policy '", name, "'; expected fp32, bf16 or fp16");
}

bool MixedPrecisionPolicy::needs_grad_scaler() const {
  return param_dtype == c10::kHalf || effective_reduce_dtype() == c10::kHalf;
}

std::string canonical_dtype_name(const std::string& name) {
  const std::string bare = name.rfind("torch.", 0) == 0 ? name.substr(6) : name;
  if (bare == "bfloat16") return "bf16";
  if (bare == "float16" || bare == "half") return "fp16";
  if (bare == "float32" || bare == "float") return "fp32";
  if (bare == "float64" || bare == "double") return "fp64";
  return bare == "bf16" || bare == "fp16" || bare == "fp32" || bare == "fp64" ? bare : name;
}

c10::ScalarType parse_float_dtype(const std::string& name) {
  const std::string n = canonical_dtype_name(name);
  if (n == "fp32") return c10::kFloat;
  if (n == "bf16") return c10::kBFloat16;
  if (n == "fp16") return c10::kHalf;
  if (n == "fp64") return c10::kDouble;
  DTRAIN_FAIL(ConfigError, "unknown dtype '", name,
              "'; expected fp32, bf16, fp16 or fp64 (or PyTorch's bfloat16, float16, float32)");
}

void MixedPrecisionPolicy::validate() const {
  auto check_float = [](const char* what, c10::ScalarType t) {
    DTRAIN_CHECK_AS(ConfigError, c10::isFloatingType(t), what, " must be a floating dtype, got ",
                    t);
  };
  check_float("param_dtype", param_dtype);
  if (reduce_dtype) check_float("reduce_dtype", *reduce_dtype);
  if (buffer_dtype) check_float("buffer_dtype", *buffer_dtype);
  if (output_dtype) check_float("output_dtype", *output_dtype);
  bool has_half = false, has_bf16 = false;
  for (auto t : {std::optional<c10::ScalarType>(param_dtype), reduce_dtype, buffer_dtype}) {
    has_half = has_half || t == c10::kHalf;
    has_bf16 = has_bf16 || t == c10::kBFloat16;
  }
  DTRAIN_CHECK_AS(ConfigError, !(has_half && has_bf16), "policy ", to_string(),
                  " mixes fp16 and bf16; pick one low-precision format");
  DTRAIN_CHECK_AS(ConfigError, !keep_low_precision_grads || is_low_precision(),
                  "keep_low_precision_grads needs a low-precision param_dtype (bf16 or fp16), "
                  "got ",
                  comm::dtype_name(param_dtype));
}

std::string MixedPrecisionPolicy::to_string() const {
  std::ostringstream os;
  auto name = [](const std::optional<c10::ScalarType>& t) {
    return t ? comm::dtype_name(*t) : std::string("unset");
  };
  os << "{param " << comm::dtype_name(param_dtype) << ", reduce " << name(reduce_dtype)
     << ", buffer " << name(buffer_dtype) << ", output " << name(output_dtype) << "}";
  return os.str();
}

namespace {
struct LowPrecisionGrads {
  std::mutex mu;
  // By TensorImpl; the weak pointer tells a live entry from a reused address.
  std::map<const c10::TensorImpl*,
           std::pair<c10::weak_intrusive_ptr<c10::TensorImpl>, c10::ScalarType>>
      by_param;
};
LowPrecisionGrads& low_precision_grads() {
  static auto* registry = new LowPrecisionGrads();  // never destroyed: used at exit too
  return *registry;
}
}  // namespace

void note_low_precision_grads(const at::Tensor& param, c10::ScalarType grad_dtype) {
  auto& r = low_precision_grads();
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto it = r.by_param.begin(); it != r.by_param.end();) {  // drop the dead ones
    it = it->second.first.expired() ? r.by_param.erase(it) : std::next(it);
  }
  r.by_param.insert_or_assign(
      param.unsafeGetTensorImpl(),
      std::make_pair(c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()),
                     grad_dtype));
}

std::optional<c10::ScalarType> low_precision_grad_dtype(const at::Tensor& param) {
  if (!param.defined()) return std::nullopt;
  auto& r = low_precision_grads();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_param.find(param.unsafeGetTensorImpl());
  if (it == r.by_param.end() || it->second.first.expired()) return std::nullopt;
  return it->second.second;
}

}  // namespace dtrain::amp
