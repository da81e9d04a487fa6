// The widest vector instruction set dtrain's own loops (sharding/widen.h, comm/half_sum.h)
// use on this CPU. ATEN_CPU_CAPABILITY caps it as it caps ATen's kernels (default: scalar
// loops; avx2; avx512), so one machine can test every version. Read once per process.
#pragma once

namespace dtrain {

enum class VectorIsa { kScalar, kAvx2, kAvx512 };

// kAvx2 also needs F16C (every AVX2 CPU has it); kAvx512 needs AVX512F. Always kScalar off
// x86-64 or with a compiler other than GCC and Clang.
VectorIsa vector_isa();

}  // namespace dtrain
