// sum_into: the SUM reduction MPI runs for bf16 and fp16 buffers (MPI has no such types; dtrain
// registers this as its MPI_Op), vectorized.
//
// inout[i] = round(float(in[i]) + float(inout[i])): one fp32 addition and one
// round-to-nearest-even per pairwise step, exactly what c10::BFloat16 / c10::Half arithmetic
// gives one element at a time (NaN payloads aside), in AVX-512, AVX2 or a scalar loop
// (core/isa.h). MPI calls it on every piece of every 16-bit all-reduce and reduce-scatter,
// so its speed is theirs.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace dtrain::comm {

// dtype: kBFloat16 or kHalf (the bits of n values each at `in` and `inout`).
void sum_into(const uint16_t* in, uint16_t* inout, int64_t n, c10::ScalarType dtype);

}  // namespace dtrain::comm
