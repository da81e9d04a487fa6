// widen_checked against ATen: the widened, divided and multiplied values equal ATen's copy_,
// div_ and mul_ bit for bit, and the verdict equals "some source value is inf/NaN", for fp32
// (in place), bf16 and fp16 sources, lengths around the vector widths, subnormal and
// overflowing results. .ci/run runs it under each ATEN_CPU_CAPABILITY, which caps the loop
// (default: scalar; avx2; avx512).
#include "sharding/widen.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

namespace dtrain::sharding {
namespace {

// Source values: random ones at several magnitudes, fp32 subnormals, the largest finite
// values, and, when `bad` is set, an inf or a NaN at `bad_at`.
at::Tensor source(int64_t n, c10::ScalarType dtype, double bad, int64_t bad_at) {
  at::manual_seed(n);
  at::Tensor x = at::randn({n}, at::kDouble) * at::pow(10.0, at::randint(-6, 6, {n}, at::kDouble));
  if (n > 3) {
    x[0] = 1e-40;    // an fp32 subnormal
    x[1] = -3.0e38;  // near fp32's largest
    x[2] = 6.0e4;    // near fp16's largest
  }
  at::Tensor out = x.to(dtype);  // fp16 saturates large ones to inf: keep them finite
  out = at::where(at::isfinite(out), out, at::zeros_like(out));
  if (bad != 0) out[bad_at] = bad;
  return out;
}

TEST(WidenChecked, EqualsATenCopyDivideMultiplyBitForBit) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (int64_t n : {0, 1, 7, 8, 15, 16, 17, 33, 1000, 4099}) {
      for (float divide : {1.0f, 1.5f, 2.0f}) {
        for (float multiply : {1.0f, 0x1p-16f, 0x1p-3f, 8.0f, 0x1p-126f}) {
          for (double bad : {0.0, inf, -inf, nan}) {
            if (n == 0 && bad != 0) continue;
            const int64_t bad_at = n - 1;  // the last element: the scalar tail, or a vector
            at::Tensor src = source(n, dtype, bad, bad_at);
            at::Tensor expect = src.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
            if (divide != 1.0f) expect.div_(divide);
            if (multiply != 1.0f) expect.mul_(multiply);
            at::Tensor got = dtype == at::kFloat ? src.clone() : at::empty({n}, at::kFloat);
            const void* from = dtype == at::kFloat ? got.data_ptr() : src.data_ptr();
            const bool found =
                widen_checked(from, dtype, got.data_ptr<float>(), n, divide, multiply);
            const std::string what = std::string(c10::toString(dtype)) + " n=" + std::to_string(n) +
                                     " divide=" + std::to_string(divide) +
                                     " multiply=" + std::to_string(multiply) +
                                     " bad=" + std::to_string(bad);
            EXPECT_EQ(found, bad != 0) << what;
            at::Tensor nans = at::isnan(expect);
            EXPECT_TRUE(at::equal(nans, at::isnan(got))) << what;
            // Bitwise, NaN payloads aside.
            at::Tensor e = at::where(nans, at::zeros_like(expect), expect).view(at::kInt);
            at::Tensor g = at::where(nans, at::zeros_like(got), got).view(at::kInt);
            EXPECT_TRUE(at::equal(e, g)) << what;
          }
        }
      }
    }
  }
}

TEST(WidenChecked, RefusesOtherDtypes) {
  at::Tensor src = at::zeros({4}, at::kDouble);
  at::Tensor dst = at::zeros({4}, at::kFloat);
  EXPECT_THROW(widen_checked(src.data_ptr(), at::kDouble, dst.data_ptr<float>(), 4, 1, 1),
               std::invalid_argument);
}

}  // namespace
}  // namespace dtrain::sharding
