#include "amp/policy.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "amp/numerics.h"
#include "core/error.h"

namespace dtrain::amp {
namespace {

TEST(MixedPrecisionPolicy, PresetsHaveFsdpMeanings) {
  auto fp32 = MixedPrecisionPolicy::fp32();
  EXPECT_EQ(fp32.param_dtype, c10::kFloat);
  EXPECT_EQ(fp32.effective_reduce_dtype(), c10::kFloat);
  EXPECT_FALSE(fp32.buffer_dtype.has_value());
  auto bf16 = MixedPrecisionPolicy::preset("bf16");
  EXPECT_EQ(bf16.param_dtype, c10::kBFloat16);
  EXPECT_EQ(bf16.effective_reduce_dtype(), c10::kBFloat16);
  EXPECT_EQ(bf16.buffer_dtype, c10::kBFloat16);
  EXPECT_FALSE(bf16.needs_grad_scaler());
  EXPECT_TRUE(MixedPrecisionPolicy::fp16().needs_grad_scaler());
  EXPECT_THROW(MixedPrecisionPolicy::preset("int8"), ConfigError);
}

TEST(MixedPrecisionPolicy, UnsetReduceDtypeFollowsParamDtype) {
  MixedPrecisionPolicy p;
  p.param_dtype = c10::kHalf;
  EXPECT_EQ(p.effective_reduce_dtype(), c10::kHalf);
  p.reduce_dtype = c10::kFloat;
  EXPECT_EQ(p.effective_reduce_dtype(), c10::kFloat);
  EXPECT_TRUE(p.needs_grad_scaler());  // fp16 compute
}

TEST(MixedPrecisionPolicy, InvalidCombinationsRaiseConfigError) {
  MixedPrecisionPolicy mixed = MixedPrecisionPolicy::bf16();
  mixed.reduce_dtype = c10::kHalf;
  EXPECT_THROW(mixed.validate(), ConfigError);
  MixedPrecisionPolicy ints;
  ints.reduce_dtype = c10::kInt;
  EXPECT_THROW(ints.validate(), ConfigError);
  MixedPrecisionPolicy keep;
  keep.keep_low_precision_grads = true;
  EXPECT_THROW(keep.validate(), ConfigError);
  EXPECT_NO_THROW(MixedPrecisionPolicy::fp16().validate());
}

TEST(Numerics, StatsCountOverflowUnderflowAndNonFinite) {
  at::Tensor t = at::tensor({1.0f, -70000.0f, 1e-6f, 0.0f, INFINITY, NAN, 3.0f, 1e5f});
  TensorStats s = tensor_stats(t);
  EXPECT_EQ(s.numel, 8);
  EXPECT_EQ(s.nonfinite, 2);
  EXPECT_DOUBLE_EQ(s.max_abs, 1e5);
  EXPECT_DOUBLE_EQ(s.frac_above_fp16_max, 2.0 / 6);
  EXPECT_DOUBLE_EQ(s.frac_below_fp16_normal, 1.0 / 6);
}

TEST(Numerics, MonitorRemembersTheFirstNonFiniteUnitAndIsInertWhenOff) {
  NumericsMonitor off;
  off.record("a", at::full({2}, NAN));
  EXPECT_TRUE(off.records().empty());
  NumericsMonitor m(true);
  m.begin_step(5);
  m.record("embed", at::ones({3}));
  m.record("block.1", at::full({2}, INFINITY));
  m.record("block.2", at::full({2}, NAN));
  m.record_scale(5, 1024.0);
  ASSERT_TRUE(m.first_nonfinite_unit().has_value());
  EXPECT_EQ(*m.first_nonfinite_unit(), "block.1");
  EXPECT_EQ(m.records().size(), 3u);
  EXPECT_NE(m.report().find("first non-finite value produced by: block.1"), std::string::npos);
  m.begin_step(6);
  EXPECT_FALSE(m.first_nonfinite_unit().has_value());
  EXPECT_EQ(m.scale_history().size(), 1u);
}

}  // namespace
}  // namespace dtrain::amp
