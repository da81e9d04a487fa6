#include "framework/hardware.h"

#include <ATen/cpu/Utils.h>
#include <ATen/detail/CUDAHooksInterface.h>

namespace dtrain::framework {
namespace {

bool has(const std::unordered_map<std::string, c10::IValue>& caps, const char* name) {
  auto it = caps.find(name);
  return it != caps.end() && it->second.isBool() && it->second.toBool();
}

}  // namespace

LowPrecisionSupport low_precision_support(c10::DeviceType device) {
  LowPrecisionSupport s;
  if (device == c10::kCUDA) {
    s.fp16 = true;
    s.fp16_how = "CUDA tensor cores";
    // True from compute capability 8.0 (the hook checks the device's major version).
    s.bf16 = at::detail::getCUDAHooks().supportsBFloat16ConvolutionWithCuDNNv8();
    s.bf16_how = s.bf16 ? "compute capability >= 8.0" : "a GPU older than Ampere (sm_80)";
    return s;
  }
  const auto caps = at::cpu::get_cpu_capabilities();
  s.bf16 = has(caps, "avx512_bf16") || has(caps, "amx_bf16");
  s.bf16_how = has(caps, "amx_bf16")      ? "AMX-BF16"
               : has(caps, "avx512_bf16") ? "AVX512-BF16"
                                          : "no AVX512-BF16 or AMX-BF16 on this CPU";
  s.fp16 = has(caps, "avx512_fp16") || has(caps, "amx_fp16");
  s.fp16_how = has(caps, "amx_fp16")      ? "AMX-FP16"
               : has(caps, "avx512_fp16") ? "AVX512-FP16"
                                          : "no AVX512-FP16 or AMX-FP16 on this CPU";
  return s;
}

}  // namespace dtrain::framework
