// What the device computes in 16 bits natively, so the config can warn before an emulated
// dtype makes every step several times slower, and `precision.policy: auto` can choose.
//   CPU   bf16: AVX512-BF16 or AMX-BF16; fp16: AVX512-FP16 or AMX-FP16 (ATen's cpuinfo).
//         Without them ATen converts element by element: fp16 steps of configs/default.yaml
//         took 11x fp32's (1.86 s vs 0.17 s) on an AVX-512 CPU with BF16 but no FP16, where
//         bf16 steps took 0.42x.
//   CUDA  fp16 on every GPU CUDA 13 supports; bf16 from compute capability 8.0 (Ampere).
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <string>

namespace dtrain::framework {

struct LowPrecisionSupport {
  bool bf16 = false;
  bool fp16 = false;
  std::string bf16_how, fp16_how;  // the feature that gives it, or why not
};

// What `device` (this machine's CPU, or its GPU) runs natively in bf16 and fp16.
LowPrecisionSupport low_precision_support(c10::DeviceType device);

// How many times longer a 128x128 matmul takes in `dtype` than in fp32 on this CPU, measured
// now (the fastest of a few runs each way, about 10 ms in all; the first call measures, later
// ones return the same figure). For the warning about an emulated 16-bit dtype.
double cpu_matmul_slowdown(c10::ScalarType dtype);

// The CPUs this process may run on (its affinity mask: what taskset, Slurm or a container
// left it), at least 1.
int usable_cpus();

}  // namespace dtrain::framework
