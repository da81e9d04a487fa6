// A backward split in two (sharding/split_backward.h) against the plain backward on the same
// graph: the input's gradient and every parameter's, bitwise, over two micro-batches
// accumulated; the weight half really deferred (the parameters have no gradient between the
// halves) where it can be; and the graphs it must not split (a module called twice, a weight
// cast once for two uses under autocast, a recomputed region, a frozen parameter, an input the
// stage does not use) still give the plain gradients, the recompute run once; a no-grad
// forward and buffers of several dtypes leave gradients and buffers the plain ones. Hooks of every
// kind run as often as in the plain backward, .grad keeps the plain layout (strided or sparse),
// and misuse is refused.
#include "sharding/split_backward.h"

#include <gtest/gtest.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "amp/autocast.h"
#include "core/error.h"
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
  std::vector<at::Tensor> input_grads, param_grads, buffers;
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
  for (const auto& b : net.buffers()) o.buffers.push_back(b.clone());
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
  ASSERT_EQ(plain.buffers.size(), split.buffers.size()) << what;
  for (size_t i = 0; i < plain.buffers.size(); ++i) {
    EXPECT_TRUE(at::equal(plain.buffers[i], split.buffers[i])) << what << " buffer " << i;
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

// A stage as the trainer's: a no-grad forward (validation) before each micro-batch's, a
// BatchNorm whose running statistics (fp32, and an int64 count) both forwards update, and
// buffers of other dtypes the forward reads (a bf16 scale, a bool mask) or counts in place.
TEST(SplitBackward, ANoGradForwardAndBuffersOfEveryDtypeGiveThePlainGradientsAndBuffers) {
  auto add_buffers = [](Net& n) {
    n.register_module("bn", torch::nn::BatchNorm1d(8));
    n.register_buffer("scale", at::linspace(0.5, 2.0, 8).to(at::kBFloat16));
    n.register_buffer("mask", at::arange(8).remainder(3).ne(0));
    n.register_buffer("calls", at::zeros({}, at::kLong));
  };
  Forward f = [](Net& n, const at::Tensor& x) {
    auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(n.named_children()["bn"]);
    auto buffers = n.named_buffers(/*recurse=*/false);
    auto stage = [&](const at::Tensor& in) {
      buffers["calls"].add_(1);
      at::Tensor h = bn->forward(n.b(at::relu(n.a(in))));
      h = h * buffers["scale"].to(at::kFloat) * buffers["mask"];
      return n.c(at::gelu(n.norm(h)));
    };
    {
      at::NoGradGuard no_grad;
      stage(x.detach() * 2);
    }
    return stage(x);
  };
  Outcome plain = run(f, false, add_buffers), split = run(f, true, add_buffers);
  expect_same(plain, split, "no-grad forward, buffers");
  EXPECT_TRUE(split.deferred_empty) << "the input half must leave the weights' gradients";
  EXPECT_GE(split.deferred, 2 * 5) << "each micro-batch's a, b, c, norm and bn deferred";
  ASSERT_EQ(split.buffers.size(), 6u);  // bn's three, then the net's own
  EXPECT_EQ(split.buffers[2].item<int64_t>(), 4) << "bn counted each forward";
  EXPECT_EQ(split.buffers[5].item<int64_t>(), 4);
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

// A graph on free parameters, built by `build`, its backward plain or split: the gradients of
// the input, the parameters and the probes (non-leaf tensors with retain_grad), and a count the
// graph's hooks keep.
struct Graph {
  std::vector<at::Tensor> params, probes;
  int calls = 0;
};
using Build = std::function<at::Tensor(Graph&, const at::Tensor&)>;
using Params = std::function<std::vector<at::Tensor>()>;

struct Grads {
  at::Tensor input;
  std::vector<at::Tensor> params, probes;
  int calls = 0;
};

Grads backward_of(const Params& params, const Build& build, bool split) {
  at::manual_seed(5);
  Graph graph;
  graph.params = params();
  at::Tensor x = at::randn({4, 6}).requires_grad_(true);
  at::Tensor out = build(graph, x);
  at::Tensor g = out.dim() == 0 ? at::Tensor() : at::randn(out.sizes());
  Grads r;
  if (split) {
    backward_input(out, g, x, &r.input).run();
  } else {
    out.backward(g);
    r.input = x.grad();
  }
  for (const auto& p : graph.params) r.params.push_back(p.grad());
  for (const auto& p : graph.probes) r.probes.push_back(p.grad());
  r.calls = graph.calls;
  return r;
}

// Values, layout (strides, or sparse) and definedness equal.
void expect_same_tensor(const at::Tensor& want, const at::Tensor& got, const std::string& what) {
  ASSERT_EQ(want.defined(), got.defined()) << what;
  if (!want.defined()) return;
  ASSERT_EQ(want.is_sparse(), got.is_sparse()) << what;
  if (want.is_sparse()) {
    EXPECT_TRUE(at::equal(want.coalesce().to_dense(), got.coalesce().to_dense())) << what;
    return;
  }
  EXPECT_TRUE(at::equal(want, got)) << what;
  EXPECT_EQ(want.strides(), got.strides()) << what;
}

void expect_same_backward(const Params& params, const Build& build, const std::string& what) {
  Grads plain = backward_of(params, build, false), split = backward_of(params, build, true);
  expect_same_tensor(plain.input, split.input, what + ": input");
  ASSERT_EQ(plain.params.size(), split.params.size());
  for (size_t i = 0; i < plain.params.size(); ++i) {
    expect_same_tensor(plain.params[i], split.params[i], what + ": param " + std::to_string(i));
  }
  for (size_t i = 0; i < plain.probes.size(); ++i) {
    expect_same_tensor(plain.probes[i], split.probes[i], what + ": probe " + std::to_string(i));
  }
  EXPECT_GT(plain.calls + static_cast<int>(plain.probes.size()), 0) << what << ": nothing hooked";
  EXPECT_EQ(plain.calls, split.calls) << what << ": hooks ran another number of times";
}

std::vector<at::Tensor> three_params() {
  return {(at::randn({8, 6}) * 0.3).requires_grad_(true), at::randn({8}).requires_grad_(true),
          (at::randn({5, 8}) * 0.3).requires_grad_(true)};
}

TEST(SplitBackward, HooksOnParametersAndActivationsRunAsInThePlainBackward) {
  // A parameter's hook that changes its gradient (the bias: an edge the split defers).
  expect_same_backward(
      three_params,
      [](Graph& g, const at::Tensor& x) {
        g.params[1].register_hook([&g](at::Tensor grad) {
          ++g.calls;
          return grad * 2;
        });
        g.params[0].register_hook([&g](at::Tensor grad) {
          ++g.calls;
          return grad * 3;
        });
        return at::linear(at::tanh(at::linear(x, g.params[0], g.params[1])), g.params[2]);
      },
      "parameter hooks");
  // retain_grad on an activation whose node has a deferred weight edge.
  expect_same_backward(
      three_params,
      [](Graph& g, const at::Tensor& x) {
        at::Tensor h = at::linear(x, g.params[0], g.params[1]);
        h.retain_grad();
        g.probes.push_back(h);
        return at::linear(at::tanh(h), g.params[2]);
      },
      "retain_grad on an activation");
  // retain_grad on a weight-only tensor (a scaled weight).
  expect_same_backward(
      three_params,
      [](Graph& g, const at::Tensor& x) {
        at::Tensor w = g.params[0].t() * 1.5;
        w.retain_grad();
        g.probes.push_back(w);
        return at::linear(at::tanh(at::addmm(g.params[1], x, w)), g.params[2]);
      },
      "retain_grad on a weight-only tensor");
  // A hook on an activation, and a post hook on the node that made one.
  expect_same_backward(
      three_params,
      [](Graph& g, const at::Tensor& x) {
        at::Tensor h = at::linear(x, g.params[0], g.params[1]);
        h.register_hook([&g](at::Tensor grad) {
          ++g.calls;
          return grad;
        });
        h.grad_fn()->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [&g](const torch::autograd::variable_list& out, const torch::autograd::variable_list&) {
              g.calls += 10;
              return out;
            }));
        return at::linear(at::tanh(h), g.params[2]);
      },
      "activation hooks");
}

TEST(SplitBackward, AccumulateGradHooksAndGradientLayoutsAreThePlainBackwards) {
  // Post hooks on the AccumulateGrad of a parameter the input half takes whole (used three
  // times) and of one it defers, as DDP's and FSDP's gradient-ready hooks are.
  expect_same_backward(
      three_params,
      [](Graph& g, const at::Tensor& x) {
        at::Tensor h =
            at::linear(at::tanh(at::linear(x, g.params[0], g.params[1])), g.params[0].t());
        at::Tensor out = at::linear(at::linear(h, g.params[0]), g.params[2]);
        for (int i : {0, 2}) {
          torch::autograd::impl::grad_accumulator(g.params[static_cast<size_t>(i)])
              ->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
                  [&g, i](const torch::autograd::variable_list& o,
                          const torch::autograd::variable_list&) {
                    g.calls += i == 0 ? 1 : 100;
                    return o;
                  }));
        }
        return out;
      },
      "AccumulateGrad post hooks");
  // Transposed parameters: .grad takes their strides, taken or deferred.
  expect_same_backward(
      [] {
        return std::vector<at::Tensor>{(at::randn({6, 8}) * 0.3).t().detach().requires_grad_(true),
                                       (at::randn({8, 5}) * 0.3).t().detach().requires_grad_(true)};
      },
      [](Graph& g, const at::Tensor& x) {
        at::Tensor h = at::linear(x, g.params[0]);
        h = at::linear(at::tanh(h), g.params[0].mm(g.params[0].t()) * 0.1);  // taken
        g.probes.push_back(g.params[1]);    // a leaf: its .grad, compared with strides
        return at::linear(h, g.params[1]);  // deferred
      },
      "transposed parameters");
}

TEST(SplitBackward, ASparseEmbeddingUsedTwiceGivesThePlainSparseGradient) {
  expect_same_backward(
      [] {
        return std::vector<at::Tensor>{at::randn({10, 6}).requires_grad_(true)};
      },
      [](Graph& g, const at::Tensor& x) {
        const at::Tensor idx = at::tensor({1, 2, 3, 1}, at::kLong);
        at::Tensor e1 = at::embedding(g.params[0], idx, -1, false, /*sparse=*/true);
        at::Tensor e2 = at::embedding(g.params[0], idx.flip(0), -1, false, /*sparse=*/true);
        g.probes.push_back(g.params[0]);
        return (x * e1 + e2).sum();
      },
      "sparse embedding");
}

TEST(SplitBackward, AnInputNotALeafAndAnOutputWithoutItsGradientAreRefused) {
  at::Tensor w = at::randn({5, 6}).requires_grad_(true);
  at::Tensor leaf = at::randn({4, 6}).requires_grad_(true);
  at::Tensor made = leaf * 2;  // the gradient of `leaf` would be lost
  at::Tensor gx;
  try {
    backward_input(at::linear(made, w), at::ones({4, 5}), made, &gx);
    ADD_FAILURE() << "a non-leaf input was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("must be a leaf"), std::string::npos) << e.what();
  }
  try {
    backward_input(at::linear(leaf, w), {}, leaf, &gx);
    ADD_FAILURE() << "an output of 20 elements without its gradient was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("20 elements needs its gradient"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(w.grad().defined());
}

}  // namespace
}  // namespace dtrain::sharding
