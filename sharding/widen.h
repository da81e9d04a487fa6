// widen_checked: the loop that writes a reduced 16-bit gradient bucket back into fp32
// gradients, with the GradScaler's work riding on it.
//
// DDP's end of backward widens every reduced bf16/fp16 bucket to fp32 anyway (PyTorch's
// compress hooks do the same copy). This loop does that copy, the post-reduction division,
// the inf/NaN check and the unscale in one pass in vector registers, so a GradScaler adds
// no pass over the gradients: dst = src / divide * multiply.
//
// Numbers: bitwise what ATen's copy_, div_(divide) and mul_(multiply) give one after the
// other. Widening bf16/fp16 to fp32 is exact, and the division and multiplication are single
// IEEE operations at every vector width (AVX-512, AVX2, or the scalar loop on other CPUs), so
// the result does not depend on the CPU (core/isa.h picks the loop; ATEN_CPU_CAPABILITY caps
// it, so one machine can test each). The check looks at the widened
// source values, as PyTorch's GradScaler checks gradients before unscaling them.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace dtrain::sharding {

// src: n values of src_dtype (kFloat, kBFloat16 or kHalf; kFloat may be dst itself). dst: n
// fp32 values. Returns whether any source value is inf or NaN. divide == 1 and multiply == 1
// skip their operation (which would leave every value as it is).
bool widen_checked(const void* src, c10::ScalarType src_dtype, float* dst, int64_t n, float divide,
                   float multiply);

}  // namespace dtrain::sharding
