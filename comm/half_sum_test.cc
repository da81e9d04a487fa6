// sum_into against c10's scalar arithmetic (c10::BFloat16 / c10::Half: widen, add in fp32,
// round to nearest even), bit for bit, over random bit patterns (every exponent: subnormals,
// overflow to inf, inf + -inf) and lengths around the vector widths. .ci/run runs it under
// each ATEN_CPU_CAPABILITY, which caps the loop (default: scalar; avx2; avx512).
#include "comm/half_sum.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace dtrain::comm {
namespace {

template <typename T>
void check(c10::ScalarType dtype) {
  for (int64_t n : {0, 1, 7, 8, 9, 15, 16, 17, 31, 100003}) {
    at::manual_seed(n);
    at::Tensor a = at::randint(0, 1 << 16, {n}, at::kInt);
    at::Tensor b = at::randint(0, 1 << 16, {n}, at::kInt);
    std::vector<uint16_t> in(n), inout(n), want(n);
    for (int64_t i = 0; i < n; ++i) {
      in[i] = static_cast<uint16_t>(a[i].item<int>());
      inout[i] = static_cast<uint16_t>(b[i].item<int>());
      T x, y;
      std::memcpy(&x, &in[i], 2);
      std::memcpy(&y, &inout[i], 2);
      const T s(static_cast<float>(x) + static_cast<float>(y));
      std::memcpy(&want[i], &s, 2);
    }
    sum_into(in.data(), inout.data(), n, dtype);
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; ++i) {
      T got, expect;
      std::memcpy(&got, &inout[i], 2);
      std::memcpy(&expect, &want[i], 2);
      const bool both_nan =
          std::isnan(static_cast<float>(got)) && std::isnan(static_cast<float>(expect));
      if (inout[i] != want[i] && !both_nan) {
        if (wrong++ == 0) {
          ADD_FAILURE() << c10::toString(dtype) << " n=" << n << " at " << i << ": " << std::hex
                        << in[i] << " + " << b[i].item<int>() << " = " << inout[i] << ", want "
                        << want[i];
        }
      }
    }
    EXPECT_EQ(wrong, 0) << c10::toString(dtype) << " n=" << n;
  }
}

TEST(HalfSum, BFloat16EqualsC10BitForBit) { check<c10::BFloat16>(at::kBFloat16); }
TEST(HalfSum, HalfEqualsC10BitForBit) { check<c10::Half>(at::kHalf); }

TEST(HalfSum, RefusesOtherDtypes) {
  uint16_t x = 0, y = 0;
  EXPECT_THROW(sum_into(&x, &y, 1, at::kFloat), std::invalid_argument);
}

}  // namespace
}  // namespace dtrain::comm
