// A backward split in two (sharding/split_backward.h) against the plain backward on the same
// graph: the input's gradient and every parameter's, bitwise, over two micro-batches
// accumulated; the weight half really deferred (the parameters have no gradient between the
// halves) where it can be; and the graphs it must not split (a module called twice, a weight
// cast once for two uses under autocast, a recomputed region, a frozen parameter, an input the
// stage does not use) still give the plain gradients, the recompute run once.
#include "sharding/split_backward.h"

#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <functional>
#include <string>
#include <vector>

#include "amp/autocast.h"
#include "sharding/recompute.h"

namespace dtrain::sharding {
namespace {

struct Net : torch::nn::Module {
  Net() {
    a = register_module("a", torch::nn::Linear(6, 8));
    b = register_module("b", torch::nn::Linear(8, 8));
    c = register_module("c", torch::nn::Linear(8, 5));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};

using Forward = std::function<at::Tensor(Net&, const at::Tensor&)>;

struct Outcome {
  std::vector<at::Tensor> input_grads, param_grads;
  int deferred = 0;
  bool deferred_empty = true;  // every parameter without .grad between the halves
};

// Two micro-batches through `forward`, each backward plain or split (input half of both
// first, then the weight halves in order, as a zero-bubble schedule runs them).
Outcome run(const Forward& forward, bool split, const std::function<void(Net&)>& prepare = {}) {
  at::manual_seed(3);
  Net net;
  if (prepare) prepare(net);
  Outcome o;
  std::vector<WeightGrad> halves;
  for (int m = 0; m < 2; ++m) {
    at::Tensor x = at::randn({4, 6}).requires_grad_(true);
    at::Tensor out = forward(net, x);
    at::Tensor g = at::randn(out.sizes());
    if (split) {
      at::Tensor gx;
      halves.push_back(backward_input(out, g, x, &gx));
      o.input_grads.push_back(gx);
      o.deferred += halves.back().deferred_nodes();
    } else {
      out.backward(g);
      o.input_grads.push_back(x.grad());
    }
  }
  if (split) {
    for (const auto& p : net.parameters()) o.deferred_empty &= !p.grad().defined();
    for (auto& h : halves) h.run();
  }
  for (const auto& p : net.parameters()) o.param_grads.push_back(p.grad());
  return o;
}

void expect_same(const Outcome& plain, const Outcome& split, const std::string& what) {
  ASSERT_EQ(plain.input_grads.size(), split.input_grads.size()) << what;
  for (size_t i = 0; i < plain.input_grads.size(); ++i) {
    EXPECT_TRUE(at::equal(plain.input_grads[i], split.input_grads[i])) << what << " input " << i;
  }
  ASSERT_EQ(plain.param_grads.size(), split.param_grads.size()) << what;
  for (size_t i = 0; i < plain.param_grads.size(); ++i) {
    ASSERT_EQ(plain.param_grads[i].defined(), split.param_grads[i].defined()) << what << " " << i;
    if (plain.param_grads[i].defined()) {
      EXPECT_TRUE(at::equal(plain.param_grads[i], split.param_grads[i])) << what << " param " << i;
    }
  }
}

TEST(SplitBackward, AChainOfLayersDefersEveryWeightAndGivesThePlainGradients) {
  Forward f = [](Net& n, const at::Tensor& x) {
    return n.c(at::gelu(n.norm(n.b(at::relu(n.a(x))))));
  };
  Outcome plain = run(f, false), split = run(f, true);
  expect_same(plain, split, "chain");
  EXPECT_TRUE(split.deferred_empty) << "the input half must leave the weights' gradients";
  EXPECT_GE(split.deferred, 2 * 4) << "each micro-batch's a, b, c and norm deferred";
}

TEST(SplitBackward, AModuleCalledTwiceGivesThePlainGradients) {
  Forward f = [](Net& n, const at::Tensor& x) { return n.c(n.b(at::tanh(n.b(n.a(x))))); };
  expect_same(run(f, false), run(f, true), "b twice");
}

TEST(SplitBackward, AWeightCastOnceForTwoUsesUnderAutocastGivesThePlainGradients) {
  Forward f = [](Net& n, const at::Tensor& x) {
    amp::AutocastGuard autocast(c10::DeviceType::CPU, at::kBFloat16);
    at::Tensor h = n.a(x);
    return n.c(n.b(at::sin(n.b(h)))).to(at::kFloat);  // the second use downstream of the first
  };
  expect_same(run(f, false), run(f, true), "autocast");
}

TEST(SplitBackward, ARecomputedRegionRunsOnceAndGivesThePlainGradients) {
  int calls = 0;
  Forward f = [&calls](Net& n, const at::Tensor& x) {
    at::Tensor h = n.a(x);
    h = recompute(
        [&n, &calls](const std::vector<at::Tensor>& in) {
          ++calls;
          return std::vector<at::Tensor>{n.norm(n.b(in[0]))};
        },
        {h}, n.parameters())[0];
    return n.c(h);
  };
  Outcome plain = run(f, false);
  EXPECT_EQ(calls, 4);  // each micro-batch's forward and its recompute
  calls = 0;
  Outcome split = run(f, true);
  EXPECT_EQ(calls, 4) << "the weight half must not run the region again";
  expect_same(plain, split, "recompute");
}

TEST(SplitBackward, FrozenParametersAndAnUnusedInputGiveThePlainGradients) {
  auto freeze = [](Net& n) { n.b->weight.requires_grad_(false); };
  Forward f = [](Net& n, const at::Tensor& x) { return n.c(n.b(n.a(x))); };
  expect_same(run(f, false, freeze), run(f, true, freeze), "frozen");
  // The input not used: its gradient is zeros and the whole backward is the weight half.
  Forward unused = [](Net& n, const at::Tensor& x) {
    return n.c(n.b(n.a(at::ones_like(x).detach())));
  };
  Outcome plain = run(unused, false), split = run(unused, true);
  for (const auto& g : split.input_grads) EXPECT_TRUE(at::equal(g, at::zeros({4, 6})));
  EXPECT_EQ(split.deferred, 0);
  plain.input_grads = split.input_grads;  // undefined in the plain run
  expect_same(plain, split, "unused input");
}

TEST(SplitBackward, ALossWithoutInputGradientRunsWholeInTheWeightHalf) {
  at::manual_seed(1);
  Net plain_net;
  at::manual_seed(1);
  Net split_net;
  at::Tensor x = at::randn({4, 6});
  plain_net.c(plain_net.b(plain_net.a(x))).sum().backward();
  WeightGrad w = backward_input(split_net.c(split_net.b(split_net.a(x))).sum(), {}, {}, nullptr);
  for (const auto& p : split_net.parameters()) EXPECT_FALSE(p.grad().defined());
  w.run();
  w.run();  // once only
  auto want = plain_net.parameters(), got = split_net.parameters();
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(want[i].grad().defined(), got[i].grad().defined()) << i;  // the norm's: none
    if (want[i].grad().defined()) {
      EXPECT_TRUE(at::equal(want[i].grad(), got[i].grad())) << i;
    }
  }
}

}  // namespace
}  // namespace dtrain::sharding
