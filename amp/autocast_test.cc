#include "amp/autocast.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include "core/error.h"

namespace dtrain::amp {
namespace {

at::Tensor mm() { return at::matmul(at::ones({4, 4}), at::ones({4, 4})); }

TEST(Autocast, MatmulRunsInTheAutocastDtypeAndFp32ListOpsInFp32) {
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    AutocastGuard g(c10::kCPU, dtype);
    EXPECT_EQ(mm().scalar_type(), dtype);
    at::Tensor low = at::ones({4, 4}, dtype);
    // mse_loss is on the CPU fp32 list in LibTorch's autocast_mode.cpp.
    EXPECT_EQ(at::mse_loss(low, low).scalar_type(), at::kFloat);
    EXPECT_EQ(at::linear(at::ones({2, 4}), at::ones({3, 4})).scalar_type(), dtype);
  }
  EXPECT_EQ(mm().scalar_type(), at::kFloat);
}

TEST(Autocast, NestingInnermostWinsAndExitRestores) {
  EXPECT_FALSE(autocast_enabled(c10::kCPU));
  c10::ScalarType original = autocast_dtype(c10::kCPU);
  {
    AutocastGuard outer(c10::kCPU, at::kBFloat16);
    EXPECT_EQ(mm().scalar_type(), at::kBFloat16);
    {
      AutocastGuard inner(c10::kCPU, at::kHalf);
      EXPECT_EQ(mm().scalar_type(), at::kHalf);
      {
        auto off = AutocastGuard::disabled(c10::kCPU);
        EXPECT_FALSE(autocast_enabled(c10::kCPU));
        EXPECT_EQ(mm().scalar_type(), at::kFloat);
      }
      EXPECT_EQ(mm().scalar_type(), at::kHalf);
    }
    EXPECT_TRUE(autocast_enabled(c10::kCPU));
    EXPECT_EQ(autocast_dtype(c10::kCPU), at::kBFloat16);
    EXPECT_EQ(mm().scalar_type(), at::kBFloat16);
  }
  EXPECT_FALSE(autocast_enabled(c10::kCPU));
  EXPECT_EQ(autocast_dtype(c10::kCPU), original);
}

// The cast cache holds low-precision copies of fp32 leaf weights; it survives an inner
// region's exit (as in PyTorch) and is cleared when the outermost region exits, so an
// update between iterations is seen.
TEST(Autocast, CastCacheIsClearedWhenTheOutermostRegionExits) {
  at::Tensor x = at::ones({1, 2});
  at::Tensor w = at::ones({1, 2}).requires_grad_();
  auto forward = [&] { return at::linear(x, w).item<float>(); };
  {
    AutocastGuard outer(c10::kCPU, at::kBFloat16);
    EXPECT_EQ(forward(), 2.0f);
    { AutocastGuard inner(c10::kCPU, at::kBFloat16); }
    {
      c10::NoGradGuard g;
      w.add_(1.0);
    }
    EXPECT_EQ(forward(), 2.0f) << "inside the region the cached bf16 weight is reused";
  }
  AutocastGuard again(c10::kCPU, at::kBFloat16);
  EXPECT_EQ(forward(), 4.0f) << "a stale cast survived the outermost exit";
}

TEST(Autocast, CacheDisabledSeesUpdatesImmediately) {
  at::Tensor x = at::ones({1, 2});
  at::Tensor w = at::ones({1, 2}).requires_grad_();
  AutocastGuard g(c10::kCPU, at::kBFloat16, /*enabled=*/true, /*cache_enabled=*/false);
  EXPECT_EQ(at::linear(x, w).item<float>(), 2.0f);
  {
    c10::NoGradGuard ng;
    w.add_(1.0);
  }
  EXPECT_EQ(at::linear(x, w).item<float>(), 4.0f);
}

TEST(Autocast, RefusesDtypesAutocastCannotUse) {
  EXPECT_THROW(AutocastGuard(c10::kCPU, at::kFloat), UsageError);
  EXPECT_THROW(AutocastGuard(c10::kCPU, at::kDouble), UsageError);
  EXPECT_NO_THROW(AutocastGuard(c10::kCPU, at::kFloat, /*enabled=*/false));
  EXPECT_FALSE(autocast_enabled(c10::kCPU));
}

TEST(Autocast, CustomOpRegionCastsInputsAndTurnsAutocastOff) {
  at::Tensor a = at::ones({2, 2}, at::kBFloat16);
  {
    AutocastGuard g(c10::kCPU, at::kBFloat16);
    CustomOpRegion region(c10::kCPU, at::kFloat);
    EXPECT_TRUE(region.casting());
    EXPECT_FALSE(autocast_enabled(c10::kCPU));
    at::Tensor fa = region.cast(a);
    EXPECT_EQ(fa.scalar_type(), at::kFloat);
    EXPECT_EQ(at::matmul(fa, fa).scalar_type(), at::kFloat);
    EXPECT_EQ(region.cast(at::ones({2}, at::kInt)).scalar_type(), at::kInt);
  }
  CustomOpRegion outside(c10::kCPU, at::kFloat);
  EXPECT_FALSE(outside.casting());
  EXPECT_EQ(outside.cast(a).scalar_type(), at::kBFloat16) << "no autocast: inputs untouched";
}

}  // namespace
}  // namespace dtrain::amp
