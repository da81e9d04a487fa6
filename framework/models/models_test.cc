#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "framework/hardware.h"
#include "framework/models/attention.h"
#include "framework/models/mlp.h"
#include "framework/models/transformer_lm.h"

namespace dtrain::framework {
namespace {

TEST(TransformerLM, ShapesParameterCountAndTiedHead) {
  auto o =
      TransformerLMOptions().vocab_size(50).seq_len(16).d_model(32).n_layers(2).n_heads(4).d_ff(64);
  TransformerLM tied(o);
  TransformerLM untied(TransformerLMOptions(o).tie_weights(false));
  int64_t n = 0;
  for (const auto& p : tied->parameters()) n += p.numel();
  EXPECT_EQ(n, transformer_lm_parameter_count(o));
  int64_t m = 0;
  for (const auto& p : untied->parameters()) m += p.numel();
  EXPECT_EQ(m, n + 32 * 50);
  at::Tensor logits = tied->forward(at::randint(0, 50, {3, 10}));
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{3, 10, 50}));
}

// The fused attention (ATen's scaled_dot_product_attention) against the explicit one: outputs
// and input gradients within fp32 rounding, and within bf16 rounding in bf16.
TEST(TransformerLM, FusedAttentionMatchesTheExplicitOne) {
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    at::manual_seed(1);
    std::vector<at::Tensor> a, b;
    for (int i = 0; i < 3; ++i) {
      a.push_back(at::randn({2, 4, 256, 48}).to(dtype).requires_grad_());
      b.push_back(a.back().detach().clone().requires_grad_());
    }
    at::Tensor fused = causal_attention(a[0], a[1], a[2], AttentionKernel::kFused);
    at::Tensor plain = causal_attention(b[0], b[1], b[2], AttentionKernel::kExplicit);
    const at::Tensor g = at::randn(fused.sizes()).to(dtype);
    fused.backward(g);
    plain.backward(g);
    const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;  // bf16: 8 bits of mantissa
    auto rel = [](const at::Tensor& x, const at::Tensor& y) {
      return ((x.to(at::kFloat) - y.to(at::kFloat)).abs().max() /
              y.to(at::kFloat).abs().max().clamp_min(1e-12))
          .item<double>();
    };
    EXPECT_LT(rel(fused, plain), tol);
    for (int i = 0; i < 3; ++i) EXPECT_LT(rel(a[i].grad(), b[i].grad()), tol) << "input " << i;
    // The first position attends to itself only: its output is its value.
    EXPECT_LT(rel(fused.select(2, 0), a[2].select(2, 0)), tol);
  }
}

// The kernel rule (framework/models/attention.h): fused on CUDA, in fp32 and in a 16-bit dtype
// the CPU emulates; explicit up to seq_len 256 in one it computes natively. A pinned setting
// wins.
TEST(TransformerLM, AttentionKernelFollowsTheRule) {
  const bool bf16 = low_precision_support(c10::kCPU).bf16;
  const bool fp16 = low_precision_support(c10::kCPU).fp16;
  using K = AttentionKernel;
  const auto expect = [](bool native, int64_t t, int64_t /*d*/) {
    return native && t <= 256 ? K::kExplicit : K::kFused;
  };
  for (int64_t t : {16, 64, 128, 129, 256, 257, 512, 1024}) {
    for (int64_t d : {8, 32, 47, 48, 64, 128}) {
      SCOPED_TRACE("T " + std::to_string(t) + " D " + std::to_string(d));
      EXPECT_EQ(choose_attention(c10::kCPU, at::kFloat, t, d).kernel, K::kFused);
      EXPECT_EQ(choose_attention(c10::kCUDA, at::kBFloat16, t, d).kernel, K::kFused);
      EXPECT_EQ(choose_attention(c10::kCPU, at::kBFloat16, t, d).kernel, expect(bf16, t, d));
      EXPECT_EQ(choose_attention(c10::kCPU, at::kHalf, t, d).kernel, expect(fp16, t, d));
      EXPECT_EQ(resolve_attention(AttentionSetting::kAuto, c10::kCPU, at::kBFloat16, t, d),
                expect(bf16, t, d));
      EXPECT_EQ(resolve_attention(AttentionSetting::kFused, c10::kCPU, at::kBFloat16, t, d),
                K::kFused);
      EXPECT_EQ(resolve_attention(AttentionSetting::kExplicit, c10::kCUDA, at::kFloat, t, d),
                K::kExplicit);
    }
  }
  EXPECT_NE(choose_attention(c10::kCPU, at::kBFloat16, 64, 48).why.find("seq_len 64"),
            std::string::npos);
}

// The model runs the kernel its setting names: pinned fused and pinned explicit give the same
// logits within bf16 rounding, and a pinned model runs what it is told whatever the rule says
// (the explicit one keeps the T x T probabilities, so its saved activations differ).
TEST(TransformerLM, AttentionSettingPinsTheKernel) {
  auto make = [](AttentionSetting s) {
    at::manual_seed(3);
    return TransformerLM(TransformerLMOptions()
                             .vocab_size(30)
                             .seq_len(16)
                             .d_model(32)
                             .n_layers(2)
                             .n_heads(4)
                             .d_ff(64)
                             .attention(s));
  };
  TransformerLM fused = make(AttentionSetting::kFused), plain = make(AttentionSetting::kExplicit);
  const at::Tensor tokens = at::randint(0, 30, {2, 16});
  const at::Tensor a = fused->forward(tokens), b = plain->forward(tokens);
  EXPECT_LT((a - b).abs().max().item<double>(), 1e-5);
  EXPECT_FALSE(at::equal(a, b)) << "both settings ran the same kernel";
}

TEST(TransformerLM, IsCausal) {
  at::manual_seed(0);
  TransformerLM lm(
      TransformerLMOptions().vocab_size(20).seq_len(8).d_model(16).n_layers(2).n_heads(2).d_ff(32));
  at::Tensor a = at::randint(0, 20, {1, 8});
  at::Tensor b = a.clone();
  b[0][7] = (a[0][7].item<int64_t>() + 1) % 20;  // change only the last token
  at::Tensor la = lm->forward(a), lb = lm->forward(b);
  EXPECT_TRUE(at::allclose(la.narrow(1, 0, 7), lb.narrow(1, 0, 7)));
  EXPECT_FALSE(at::allclose(la.narrow(1, 7, 1), lb.narrow(1, 7, 1)));
}

TEST(TransformerLM, LearnsToCopyAShortSequence) {
  at::manual_seed(1);
  TransformerLM lm(
      TransformerLMOptions().vocab_size(8).seq_len(8).d_model(32).n_layers(1).n_heads(2).d_ff(64));
  at::Tensor tokens = at::arange(8, at::kLong).remainder(4).unsqueeze(0).repeat({4, 1});
  at::Tensor inputs = tokens.narrow(1, 0, 7), targets = tokens.narrow(1, 1, 7);
  auto loss_of = [&] {
    return at::cross_entropy_loss(lm->forward(inputs).reshape({-1, 8}), targets.reshape(-1));
  };
  double first = loss_of().item<double>();
  for (int i = 0; i < 60; ++i) {
    lm->zero_grad();
    at::Tensor l = loss_of();
    l.backward();
    c10::NoGradGuard g;
    for (auto& p : lm->parameters()) p.sub_(p.grad() * 0.05);
  }
  EXPECT_LT(loss_of().item<double>(), first * 0.5);
}

// Deferred: placeholders with no memory, then materialize() gives the eager build's bits
// under the same seed, in whatever order the parameters are initialized.
TEST(TransformerLM, DeferredInitMaterializesTheEagerValues) {
  const auto o =
      TransformerLMOptions().vocab_size(30).seq_len(8).d_model(16).n_layers(3).n_heads(2).d_ff(32);
  at::manual_seed(9);
  TransformerLM eager(o);
  at::manual_seed(9);
  TransformerLM lazy(TransformerLMOptions(o).deferred_init(true));
  for (const auto& p : lazy->named_parameters()) {
    EXPECT_TRUE(p.value().numel() <= 1 || sharding::is_placeholder(p.value())) << p.key();
  }
  // Reverse order: each parameter has its own generator.
  auto params = lazy->named_parameters();
  const sharding::ParamInit init = lazy->param_init();
  for (auto it = params.end(); it != params.begin();) {
    --it;
    at::Tensor full = at::empty(it->value().sizes());
    init(it->key(), full);
    it->value().set_data(full);
  }
  sharding::materialize(*lazy, init);  // nothing left to do; a no-op
  const auto want = eager->named_parameters();
  for (const auto& p : lazy->named_parameters()) {
    EXPECT_TRUE(at::equal(p.value(), want[p.key()])) << p.key();
  }
  // And materialize() itself, from a fresh deferred build.
  at::manual_seed(9);
  TransformerLM again(TransformerLMOptions(o).deferred_init(true));
  sharding::materialize(*again, again->param_init());
  for (const auto& p : again->named_parameters()) {
    EXPECT_TRUE(at::equal(p.value(), want[p.key()])) << p.key();
  }
  at::Tensor tokens = at::randint(0, 30, {2, 8});
  EXPECT_TRUE(at::equal(again->forward(tokens), eager->forward(tokens)));
}

TEST(MLP, Shapes) {
  MLP mlp(MLPOptions().in_features(5).hidden(7).depth(2).out_features(3));
  EXPECT_EQ(mlp->forward(at::randn({4, 5})).sizes(), (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(mlp->parameters().size(), 6u);
}

}  // namespace
}  // namespace dtrain::framework
