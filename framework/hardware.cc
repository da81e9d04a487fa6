#include "framework/hardware.h"

#include <ATen/ATen.h>
#include <ATen/cpu/Utils.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <mutex>

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

int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return 1;
}

double cpu_matmul_slowdown(c10::ScalarType dtype) {
  static std::mutex mu;
  static std::map<c10::ScalarType, double> measured;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = measured.find(dtype); it != measured.end()) return it->second;
  auto fastest = [](c10::ScalarType t) {
    const at::Tensor a = at::ones({128, 128}, at::TensorOptions().dtype(t));
    double best = std::numeric_limits<double>::infinity();
    for (int i = 0; i < 4; ++i) {  // the first run warms up
      const auto t0 = std::chrono::steady_clock::now();
      at::Tensor c = at::mm(a, a);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (i > 0) best = std::min(best, s);
    }
    return best;
  };
  const double ratio = fastest(dtype) / std::max(fastest(at::kFloat), 1e-9);
  measured[dtype] = ratio;
  return ratio;
}

}  // namespace dtrain::framework
