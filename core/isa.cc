#include "core/isa.h"

#include <cstdlib>
#include <string>

namespace dtrain {
namespace {

VectorIsa detect() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
  const std::string limit = cap != nullptr ? cap : "";
  if (limit == "default") return VectorIsa::kScalar;
  if (limit != "avx2" && __builtin_cpu_supports("avx512f")) return VectorIsa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return VectorIsa::kAvx2;
#endif
  return VectorIsa::kScalar;
}

}  // namespace

VectorIsa vector_isa() {
  static const VectorIsa isa = detect();
  return isa;
}

}  // namespace dtrain
