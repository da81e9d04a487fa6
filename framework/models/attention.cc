#include "framework/models/attention.h"

#include "framework/hardware.h"

namespace dtrain::framework {
namespace {

// Up to this T the explicit kernel wins on a CPU with the dtype's arithmetic (attention.h).
constexpr int64_t kExplicitUpTo = 256;

bool is_16_bit(c10::ScalarType t) { return t == c10::kBFloat16 || t == c10::kHalf; }

std::string short_name(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat:
      return "fp32";
    case c10::kBFloat16:
      return "bf16";
    case c10::kHalf:
      return "fp16";
    case c10::kDouble:
      return "fp64";
    default:
      return c10::toString(t);
  }
}

// Whether this CPU computes `t` natively (read once: the CPU does not change).
bool cpu_native(c10::ScalarType t) {
  static const LowPrecisionSupport cpu = low_precision_support(c10::kCPU);
  return t == c10::kBFloat16 ? cpu.bf16 : cpu.fp16;
}

AttentionKernel rule(c10::DeviceType device, c10::ScalarType dtype, int64_t seq_len) {
  if (device != c10::kCPU || !is_16_bit(dtype) || !cpu_native(dtype)) {
    return AttentionKernel::kFused;
  }
  return seq_len <= kExplicitUpTo ? AttentionKernel::kExplicit : AttentionKernel::kFused;
}

}  // namespace

AttentionChoice choose_attention(c10::DeviceType device, c10::ScalarType dtype, int64_t seq_len,
                                 int64_t head_dim) {
  AttentionChoice c;
  c.kernel = rule(device, dtype, seq_len);
  const std::string what = short_name(dtype) + " at seq_len " + std::to_string(seq_len) +
                           ", head size " + std::to_string(head_dim);
  if (device != c10::kCPU) {
    c.why = "on " + c10::DeviceTypeName(device, /*lower_case=*/true) + ": the fused kernel";
  } else if (!is_16_bit(dtype)) {
    c.why = what + " on the CPU: the fused kernel (faster in 32 bits from seq_len 128 on)";
  } else if (!cpu_native(dtype)) {
    c.why = what + ", which this CPU emulates: the fused kernel (2-3x the explicit one)";
  } else if (c.kernel == AttentionKernel::kExplicit) {
    c.why = what + " on a CPU with " + short_name(dtype) +
            " arithmetic: the explicit softmax (faster up to seq_len " +
            std::to_string(kExplicitUpTo) + ")";
  } else {
    c.why = what + " on a CPU with " + short_name(dtype) +
            " arithmetic: the fused kernel (faster above seq_len " + std::to_string(kExplicitUpTo) +
            ")";
  }
  return c;
}

AttentionKernel resolve_attention(AttentionSetting setting, c10::DeviceType device,
                                  c10::ScalarType dtype, int64_t seq_len, int64_t /*head_dim*/) {
  switch (setting) {
    case AttentionSetting::kFused:
      return AttentionKernel::kFused;
    case AttentionSetting::kExplicit:
      return AttentionKernel::kExplicit;
    case AttentionSetting::kAuto:
      break;
  }
  return rule(device, dtype, seq_len);
}

}  // namespace dtrain::framework
