// sharding::recompute against the same region run plainly: gradients of inputs and
// parameters bitwise equal (fp32 and bf16 autocast, with dropout), the RNG stream after the
// backward unchanged, a region whose parameters are frozen, and the region as one node.
#include "sharding/recompute.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "amp/autocast.h"

namespace dtrain::sharding {
namespace {

struct Params {
  at::Tensor w1, b1, w2, gamma;
  std::vector<at::Tensor> all() const { return {w1, b1, w2, gamma}; }
};

Params make_params(bool requires_grad) {
  at::manual_seed(7);
  Params p{at::randn({64, 32}), at::randn({64}), at::randn({32, 64}), at::ones({32})};
  for (at::Tensor* t : {&p.w1, &p.b1, &p.w2, &p.gamma}) t->requires_grad_(requires_grad);
  return p;
}

// LayerNorm, Linear, GELU, dropout, Linear, and the weight used twice.
at::Tensor body(const Params& p, const at::Tensor& x) {
  at::Tensor h = at::layer_norm(x, {32}, p.gamma);
  h = at::gelu(at::linear(h, p.w1, p.b1), "tanh");
  h = at::dropout(h, 0.3, /*train=*/true);
  return x + at::linear(h, p.w2) + at::linear(at::linear(x, p.w2.t()), p.w2);
}

struct Grads {
  std::vector<at::Tensor> grads;
  double next_random = 0;  // the RNG stream after the backward
};

Grads run(bool with_recompute, bool bf16) {
  Params p = make_params(true);
  at::manual_seed(11);
  at::Tensor x = at::randn({4, 8, 32}).requires_grad_(true);
  at::Tensor loss;
  {
    std::optional<amp::AutocastGuard> autocast;
    if (bf16) autocast.emplace(c10::DeviceType::CPU, c10::kBFloat16);
    at::Tensor y;
    if (with_recompute) {
      y = recompute(
          [&p](const std::vector<at::Tensor>& in) {
            return std::vector<at::Tensor>{body(p, in[0])};
          },
          {x}, p.all())[0];
    } else {
      y = body(p, x);
    }
    loss = y.to(at::kFloat).pow(2).mean();
  }
  loss.backward();
  Grads g;
  g.grads.push_back(x.grad());
  for (const auto& t : p.all()) g.grads.push_back(t.grad());
  g.next_random = at::rand({1}).item<double>();
  return g;
}

void expect_same(const Grads& a, const Grads& b) {
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    ASSERT_TRUE(a.grads[i].defined() && b.grads[i].defined()) << "gradient " << i;
    EXPECT_TRUE(at::equal(a.grads[i], b.grads[i]))
        << "gradient " << i << " differs by "
        << (a.grads[i] - b.grads[i]).abs().max().item<double>();
  }
  EXPECT_EQ(a.next_random, b.next_random) << "the RNG stream after the backward moved";
}

TEST(Recompute, Fp32GradientsAreBitwiseThePlainOnesDropoutIncluded) {
  expect_same(run(false, false), run(true, false));
}

TEST(Recompute, Bf16AutocastGradientsAreBitwiseThePlainOnes) {
  expect_same(run(false, true), run(true, true));
}

TEST(Recompute, WithoutTheRngRestoredTheDropoutMasksWouldDiffer) {
  // The property the RNG restore guards: two draws of the same dropout differ.
  at::manual_seed(1);
  at::Tensor a = at::dropout(at::ones({1000}), 0.5, true);
  at::Tensor b = at::dropout(at::ones({1000}), 0.5, true);
  EXPECT_FALSE(at::equal(a, b));
}

TEST(Recompute, FrozenParametersGetNoGradientAndTheInputStillDoes) {
  Params p = make_params(false);
  at::Tensor x = at::randn({2, 3, 32}).requires_grad_(true);
  at::Tensor y = recompute(
      [&p](const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{at::linear(in[0], p.w2.t())};
      },
      {x}, p.all())[0];
  y.sum().backward();
  EXPECT_FALSE(p.w2.grad().defined());
  at::Tensor plain = x.detach().clone().requires_grad_(true);
  at::linear(plain, p.w2.t()).sum().backward();
  ASSERT_TRUE(x.grad().defined());
  EXPECT_TRUE(at::equal(x.grad(), plain.grad()));
}

TEST(Recompute, TheRegionIsOneNodeOverItsInputAndParameters) {
  // The plain region's graph is a node per op, each keeping what it needs; the recomputed
  // region is one node whose edges lead to its input and its parameters' accumulators.
  Params p = make_params(true);
  at::Tensor x = at::randn({4, 8, 32}).requires_grad_(true);
  at::Tensor y = recompute(
      [&p](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{body(p, in[0])}; },
      {x}, p.all())[0];
  ASSERT_TRUE(y.grad_fn());
  EXPECT_EQ(y.grad_fn()->next_edges().size(), 1u + p.all().size());
  // Under no_grad it just runs.
  {
    at::NoGradGuard off;
    at::Tensor z = recompute(
        [&p](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{body(p, in[0])}; },
        {x}, p.all())[0];
    EXPECT_FALSE(z.requires_grad());
  }
}

}  // namespace
}  // namespace dtrain::sharding
