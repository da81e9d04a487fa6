#include "amp/grad_scaler.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <limits>

#include "core/error.h"

namespace dtrain::amp {
namespace {

void expect_usage_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no UsageError; expected '" << needle << "'";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

struct Fixture {
  at::Tensor w = at::ones({3}).requires_grad_();
  torch::optim::SGD opt{std::vector<at::Tensor>{w}, torch::optim::SGDOptions(0.1)};

  at::Tensor loss() { return (w * at::arange(3, at::kFloat)).sum(); }
};

TEST(GradScaler, StateMachineErrorsMatchPyTorch) {
  Fixture f;
  GradScaler s(GradScalerOptions().init_scale(8.0));
  expect_usage_error([&] { s.unscale_(f.opt); }, "Attempted unscale_ but _scale is None");
  expect_usage_error([&] { s.step(f.opt); }, "Attempted step but _scale is None");
  expect_usage_error([&] { s.update(); }, "Attempted update but _scale is None");
  s.scale(f.loss()).backward();
  expect_usage_error([&] { s.update(); }, "No inf checks were recorded prior to update.");
  s.unscale_(f.opt);
  expect_usage_error(
      [&] { s.unscale_(f.opt); },
      "unscale_() has already been called on this optimizer since the last update().");
  EXPECT_TRUE(s.step(f.opt));
  expect_usage_error([&] { s.step(f.opt); },
                     "step() has already been called since the last update().");
  expect_usage_error([&] { s.unscale_(f.opt); }, "unscale_() is being called after step().");
  s.update();
  // After update() the optimizer is READY again.
  f.opt.zero_grad();
  s.scale(f.loss()).backward();
  EXPECT_TRUE(s.step(f.opt));
  s.update();
}

TEST(GradScaler, UnscaleDividesAndStepSkipsAndBacksOffOnInf) {
  Fixture f;
  GradScaler s(GradScalerOptions().init_scale(8.0).growth_interval(2));
  s.scale(f.loss()).backward();
  EXPECT_TRUE(at::equal(f.w.grad(), at::arange(3, at::kFloat) * 8));
  s.unscale_(f.opt);
  EXPECT_TRUE(at::equal(f.w.grad(), at::arange(3, at::kFloat)));
  EXPECT_FALSE(s.found_inf());
  EXPECT_TRUE(s.step(f.opt));
  s.update();
  EXPECT_EQ(s.get_growth_tracker(), 1);
  at::Tensor before = f.w.detach().clone();
  f.opt.zero_grad();
  s.scale(f.loss()).backward();
  f.w.mutable_grad()[1].fill_(std::numeric_limits<float>::infinity());
  EXPECT_FALSE(s.step(f.opt));
  EXPECT_TRUE(at::equal(f.w.detach(), before)) << "a skipped step must not touch parameters";
  s.update();
  EXPECT_EQ(s.get_scale(), 4.0);
  EXPECT_EQ(s.get_growth_tracker(), 0);
}

// A verdict handed over by code that unscaled and checked gradients itself: step() takes the
// gradients as they are (no second division) and skips on its found_inf; withdraw() scales
// them back; a gradient changed after the verdict is refused.
TEST(GradScaler, AcceptsAVerdictOnGradientsUnscaledElsewhere) {
  Fixture plain, handed;
  GradScaler a(GradScalerOptions().init_scale(8.0)), b(GradScalerOptions().init_scale(8.0));
  a.scale(plain.loss()).backward();
  b.scale(handed.loss()).backward();
  ASSERT_EQ(b.exact_unscale_divisor(), 8.0f);
  handed.w.mutable_grad().div_(8.0);
  b.accept_unscaled({{handed.w.grad()}, 8.0f, {false}});
  EXPECT_TRUE(a.step(plain.opt));
  EXPECT_TRUE(b.step(handed.opt));
  EXPECT_TRUE(at::equal(plain.w.detach(), handed.w.detach()));
  a.update();
  b.update();

  // A verdict of inf skips the step; the scale backs off as for any inf.
  handed.opt.zero_grad();
  b.scale(handed.loss()).backward();
  handed.w.mutable_grad().div_(8.0);
  b.accept_unscaled({{handed.w.grad()}, 8.0f, {true}});
  at::Tensor before = handed.w.detach().clone();
  EXPECT_FALSE(b.step(handed.opt));
  EXPECT_TRUE(at::equal(handed.w.detach(), before));
  b.update();
  EXPECT_EQ(b.get_scale(), 4.0);

  // Withdrawn: the gradients are scaled again, and unscale_ divides them itself.
  handed.opt.zero_grad();
  b.scale(handed.loss()).backward();
  const at::Tensor scaled = handed.w.grad().clone();
  handed.w.mutable_grad().div_(4.0);
  GradScaler::Ticket t = b.accept_unscaled({{handed.w.grad()}, 4.0f, {false}});
  b.withdraw(t);
  EXPECT_TRUE(at::equal(handed.w.grad(), scaled));
  b.unscale_(handed.opt);
  EXPECT_TRUE(at::equal(handed.w.grad(), at::arange(3, at::kFloat)));
  b.step(handed.opt);
  b.update();

  // Changed in place after the verdict: unscaling it again would be wrong.
  handed.opt.zero_grad();
  b.scale(handed.loss()).backward();
  handed.w.mutable_grad().div_(4.0);
  b.accept_unscaled({{handed.w.grad()}, 4.0f, {false}});
  handed.w.mutable_grad().add_(1.0);
  expect_usage_error([&] { b.unscale_(handed.opt); }, "handed over as unscaled");
}

TEST(GradScaler, RefusesFp16GradientsWithPyTorchsMessage) {
  at::Tensor w = at::ones({2}, at::kHalf).requires_grad_();
  torch::optim::SGD opt{std::vector<at::Tensor>{w}, torch::optim::SGDOptions(0.1)};
  GradScaler s;
  s.scale(w.sum()).backward();
  expect_usage_error([&] { s.unscale_(opt); }, "Attempting to unscale FP16 gradients.");
}

TEST(GradScaler, SeveralOptimizersShareOneUpdateThatSumsTheirInfs) {
  at::Tensor a = at::ones({2}).requires_grad_(), b = at::ones({2}).requires_grad_();
  torch::optim::SGD oa{std::vector<at::Tensor>{a}, torch::optim::SGDOptions(0.1)};
  torch::optim::SGD ob{std::vector<at::Tensor>{b}, torch::optim::SGDOptions(0.1)};
  GradScaler s(GradScalerOptions().init_scale(16.0));
  s.scale((a * 2 + b * 3).sum()).backward();
  b.mutable_grad()[0].fill_(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(s.step(oa));
  EXPECT_FALSE(s.step(ob));
  EXPECT_TRUE(s.found_inf());
  s.update();
  EXPECT_EQ(s.get_scale(), 8.0);
}

TEST(GradScaler, DisabledIsAPassThrough) {
  Fixture f;
  GradScaler s(GradScalerOptions().enabled(false));
  at::Tensor loss = f.loss();
  EXPECT_TRUE(s.scale(loss).is_same(loss));
  loss.backward();
  s.unscale_(f.opt);
  s.unscale_(f.opt);  // no state machine when disabled
  EXPECT_TRUE(s.step(f.opt));
  s.update();
  s.update(3.0);
  EXPECT_EQ(s.get_scale(), 1.0);
  EXPECT_EQ(s.get_growth_tracker(), 0);
  EXPECT_TRUE(s.state_dict().empty());
  EXPECT_TRUE(at::allclose(f.w.detach(), at::ones({3}) - 0.1 * at::arange(3, at::kFloat)));
}

TEST(GradScaler, UpdateWithNewScaleKeepsTheTracker) {
  Fixture f;
  GradScaler s(GradScalerOptions().init_scale(8.0).growth_interval(5));
  s.scale(f.loss()).backward();
  s.step(f.opt);
  s.update();
  EXPECT_EQ(s.get_growth_tracker(), 1);
  s.scale(f.loss());
  s.update(100.0);
  EXPECT_EQ(s.get_scale(), 100.0);
  EXPECT_EQ(s.get_growth_tracker(), 1);
  s.update(at::full({1}, 50.0));
  EXPECT_EQ(s.get_scale(), 50.0);
  expect_usage_error([&] { s.update(at::ones({2})); }, "new_scale should be a float");
}

TEST(GradScaler, StateDictRoundTripsWithPyTorchKeys) {
  Fixture f;
  GradScaler s(GradScalerOptions().init_scale(32.0).growth_interval(7).growth_factor(3.0));
  s.scale(f.loss()).backward();
  s.step(f.opt);
  s.update();
  auto sd = s.state_dict();
  for (const char* key :
       {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}) {
    EXPECT_NE(sd.find(c10::IValue(std::string(key))), sd.end()) << key;
  }
  GradScaler fresh;
  fresh.load_state_dict(sd);
  EXPECT_EQ(fresh.get_scale(), 32.0);
  EXPECT_EQ(fresh.get_growth_tracker(), 1);
  EXPECT_EQ(fresh.get_growth_interval(), 7);
  EXPECT_EQ(fresh.get_growth_factor(), 3.0);
  GradScaler disabled(GradScalerOptions().enabled(false));
  expect_usage_error([&] { fresh.load_state_dict(disabled.state_dict()); },
                     "The source state dict is empty");
}

TEST(GradScaler, ScaleLivesOnTheOutputsDeviceAndKeepsBf16LossDtypeRules) {
  GradScaler s(GradScalerOptions().init_scale(4.0));
  at::Tensor out = s.scale(at::full({2}, 1.5, at::kBFloat16));
  // As in PyTorch: a 0-dim fp32 scale does not promote a dimensioned bf16 tensor.
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  EXPECT_EQ(out[0].item<float>(), 6.0f);
  auto both = s.scale(std::vector<at::Tensor>{at::ones({1}), at::ones({2})});
  EXPECT_EQ(both[1][1].item<float>(), 4.0f);
}

TEST(GradScaler, RefusesToStepAnOptimizerWithoutGradientsAsPyTorchDoes) {
  Fixture f;
  GradScaler s;
  s.scale(f.loss());  // no backward: no gradient
  expect_usage_error([&] { s.step(f.opt); }, "No inf checks were recorded for this optimizer.");
}

TEST(GradScaler, RejectsBadFactors) {
  expect_usage_error([] { GradScaler(GradScalerOptions().growth_factor(1.0)); },
                     "The growth factor must be > 1.0.");
  expect_usage_error([] { GradScaler(GradScalerOptions().backoff_factor(1.0)); },
                     "The backoff factor must be < 1.0.");
}

}  // namespace
}  // namespace dtrain::amp
