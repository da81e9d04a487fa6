// Which kernel a causal attention runs, chosen as PyTorch's scaled_dot_product_attention
// chooses a backend: by what is fastest for the device, dtype and shape. Two kernels:
//   fused     at::scaled_dot_product_attention(is_causal): flash kernels that keep only the
//             softmax's log-sum-exp for backward;
//   explicit  matmul -> mask -> fp32 softmax -> matmul, which keeps the T x T probabilities.
// The choice is a rule, not a timing: the same on every rank and in every run of a machine, so
// a resumed run and the PyTorch reference (bench/reference/model.py, attention_kernel) compute
// what the uninterrupted run did. `model.attention: fused | explicit` pins it.
//
// The rule, from bench/attention_bench (forward + backward, one thread, as each rank of a
// 2-rank job here; 2026-12-04):
//   - CUDA: fused (cuDNN's or the flash kernel).
//   - CPU, fp32: fused. 1.2-3.1x the explicit one from T 64 to 1024 at head sizes 48-64.
//   - CPU, a 16-bit dtype this CPU emulates (bf16 without AVX512-BF16 or AMX-BF16, fp16
//     without AVX512-FP16 or AMX-FP16): fused, 1.6-2.6x the explicit one (fp16 on an AMD EPYC
//     Zen 4), 1.3-2.9x (bf16 on an Intel Xeon without AVX512-BF16).
//   - CPU, a 16-bit dtype it computes natively: explicit up to T 256, fused above. bf16 on an
//     AMD EPYC Zen 4 with AVX512-BF16: the explicit kernel took 0.23x the fused one's time at
//     T 64, 0.31x at T 128, 0.57-0.70x at T 256 (head sizes 32-128), but 1.2-1.6x at T 320-512
//     (head sizes 48-64) and 3.1x at 1024. Batched bf16 matrix products run at the CPU's bf16
//     rate, while ATen's CPU flash kernel works in small blocks; the explicit kernel's T x T
//     scores outgrow the caches (and come from fresh pages) as T grows. At head size 128 the
//     explicit one stayed ahead to T 384; the rule does not follow that. Not measured on
//     AMX: the same rule is assumed there.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <array>
#include <cstdint>
#include <string>
#include <utility>

#include "core/choices.h"

namespace dtrain::framework {

enum class AttentionKernel { kFused, kExplicit };
inline constexpr std::array<std::pair<AttentionKernel, const char*>, 2> kAttentionKernels{{
    {AttentionKernel::kFused, "fused"},
    {AttentionKernel::kExplicit, "explicit"},
}};
constexpr const auto& choices(AttentionKernel) { return kAttentionKernels; }

// model.attention: auto follows the rule above.
enum class AttentionSetting { kAuto, kFused, kExplicit };
inline constexpr std::array<std::pair<AttentionSetting, const char*>, 3> kAttentionSettings{{
    {AttentionSetting::kAuto, "auto"},
    {AttentionSetting::kFused, "fused"},
    {AttentionSetting::kExplicit, "explicit"},
}};
constexpr const auto& choices(AttentionSetting) { return kAttentionSettings; }

// The kernel the rule picks for queries of `dtype` on `device`, seq_len T and head size D, and
// why (a sentence for the log).
struct AttentionChoice {
  AttentionKernel kernel = AttentionKernel::kFused;
  std::string why;
};
AttentionChoice choose_attention(c10::DeviceType device, c10::ScalarType dtype, int64_t seq_len,
                                 int64_t head_dim);

// The setting resolved: a pinned kernel, or the rule's (which does not read head_dim today).
AttentionKernel resolve_attention(AttentionSetting setting, c10::DeviceType device,
                                  c10::ScalarType dtype, int64_t seq_len, int64_t head_dim);

}  // namespace dtrain::framework
