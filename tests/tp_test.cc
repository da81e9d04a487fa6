// Tensor parallelism against one process, on every rank of a real multi-process job: the same
// weights and data give the same outputs, losses and gradients (within fp32 rounding: the
// slices' partial sums are added in another order) through each style, the Llama plan, with
// and without sequence parallelism, and composed with FSDP on a 2-D mesh (4 ranks: shard 2 x
// tp 2). A wrong gradient through any collective (a missing all-reduce in backward, a wrong
// slice, a norm weight not summed over the sequence's parts) fails these.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "core/error.h"
#include "framework/models/llama.h"
#include "framework/strategy.h"
#include "optim/fused.h"
#include "sharding/clip_grad.h"
#include "sharding/fsdp.h"
#include "sharding/mesh.h"
#include "sharding/tensor_parallel.h"
#include "sharding/tensor_parallel_plan.h"
#include "tests/multirank.h"

namespace dtrain::sharding {
namespace {

using dtrain::framework::LlamaForCausalLM;
using dtrain::framework::LlamaOptions;
using dtrain::testing::world;
using dtrain::testing::world_ptr;
using Test = dtrain::testing::MultiRankTest;

// max |a - b| / max |b|: relative to the reference's scale.
double rel(const at::Tensor& a, const at::Tensor& b) {
  const double scale = b.abs().max().item<double>();
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>() /
         (scale > 0 ? scale : 1.0);
}

std::shared_ptr<comm::Communicator> tp_group(int tp) {
  static std::map<int, std::shared_ptr<DeviceMesh>> meshes;  // splits are collective: once
  auto& m = meshes[tp];
  if (!m) m = std::make_shared<DeviceMesh>(world_ptr(), MeshShape{1, world().size() / tp, tp, 1});
  return m->tp();
}

// Two Linears, colwise then rowwise (an MLP's pair), through the plan, against the same layers
// whole: outputs and every gradient (weights' slices, biases, the input), with and without
// sequence parallelism.
TEST_F(Test, ColwiseThenRowwiseGiveOneProcessOutputAndGradients) {
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "tensor parallel");
    const int t = world().size();
    auto make = [] {
      at::manual_seed(7);
      torch::nn::Sequential m(torch::nn::Linear(16, 32), torch::nn::Linear(32, 16));
      return m;
    };
    torch::nn::Sequential whole = make(), sliced = make();
    auto group = tp_group(t);
    auto tpz = std::make_shared<TensorParallelism>(group, sp);
    const auto done = tpz->apply(*sliced, {{"0", Style::kColwise}, {"1", Style::kRowwise}});
    EXPECT_EQ(done.size(), 3u);  // both weights and the colwise bias (a rowwise bias stays whole)
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    at::Tensor x = at::randn({2, 4 * t, 16}, gen);
    at::Tensor xr = x.clone().requires_grad_(), xt = x.clone().requires_grad_();
    auto* l0 = sliced[0]->as<torch::nn::Linear>();
    auto* l1 = sliced[1]->as<torch::nn::Linear>();
    auto* w0 = whole[0]->as<torch::nn::Linear>();
    auto* w1 = whole[1]->as<torch::nn::Linear>();
    at::Tensor ref = w1->forward(at::relu(w0->forward(xr)));
    // Under sequence parallelism the input and output are this rank's part of the sequence.
    at::Tensor in = sp ? tp::split_seq(xt, group) : xt;
    at::Tensor h = at::relu(tpz->linear(in, l0->weight, l0->bias));
    at::Tensor out = tpz->linear(h, l1->weight, l1->bias);
    const at::Tensor want = sp ? ref.narrow(1, group->rank() * 4, 4) : ref;
    EXPECT_LT(rel(out, want), 1e-6);
    const at::Tensor g = at::randn(ref.sizes(), gen);
    ref.backward(g);
    out.backward(sp ? g.narrow(1, group->rank() * 4, 4) : g);
    // Under sequence parallelism the whole rowwise bias saw this rank's tokens only.
    EXPECT_EQ(tpz->replicated(), std::vector<std::string>{"1.bias"});
    tpz->sync_replicated_grads({l1->bias.grad()});
    const int64_t r = group->rank();
    EXPECT_LT(rel(l0->weight.grad(), w0->weight.grad().narrow(0, r * 32 / t, 32 / t)), 1e-5);
    EXPECT_LT(rel(l0->bias.grad(), w0->bias.grad().narrow(0, r * 32 / t, 32 / t)), 1e-5);
    EXPECT_LT(rel(l1->weight.grad(), w1->weight.grad().narrow(1, r * 32 / t, 32 / t)), 1e-5);
    EXPECT_LT(rel(l1->bias.grad(), w1->bias.grad()), 1e-5);
    EXPECT_LT(rel(xt.grad(), xr.grad()), 1e-5);
  }
}

// The vocabulary-parallel embedding and cross-entropy (a tied head, logits never gathered)
// against the whole table: the loss, and the table's gradient slice.
TEST_F(Test, VocabParallelEmbeddingAndLossGiveOneProcessLossAndGradients) {
  const int t = world().size();
  auto group = tp_group(t);
  at::manual_seed(9);
  at::Tensor table = at::randn({12 * t, 8});
  at::Tensor whole = table.clone().requires_grad_();
  auto tpz = std::make_shared<TensorParallelism>(group, false);
  torch::nn::Embedding emb(12 * t, 8);
  {
    c10::NoGradGuard no_grad;
    emb->weight.copy_(table);
  }
  tpz->apply(*emb.ptr(), {});  // nothing named: whole
  EXPECT_FALSE(tpz->sliced(emb->weight));
  torch::nn::Sequential holder(emb);
  auto tpv = std::make_shared<TensorParallelism>(group, false);
  tpv->apply(*holder, {{"0", Style::kVocab}});
  ASSERT_TRUE(tpv->sliced(emb->weight));
  EXPECT_EQ(emb->weight.size(0), 12);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  at::Tensor tokens = at::randint(0, 12 * t, {3, 5}, gen);
  at::Tensor targets = at::randint(0, 12 * t, {15}, gen);
  // Reference: lookup, a tied head, cross-entropy.
  at::Tensor ref_h = at::embedding(whole, tokens) * 1.5;
  at::Tensor ref = at::cross_entropy_loss(at::linear(ref_h, whole).reshape({15, -1}), targets);
  at::Tensor h = tpv->embedding(tokens, emb->weight) * 1.5;
  at::Tensor local_logits = tpv->linear(h, emb->weight);
  EXPECT_EQ(local_logits.size(-1), 12);
  at::Tensor loss = tpv->loss(local_logits.reshape({15, -1}), targets, emb->weight);
  EXPECT_LT(std::abs(loss.item<double>() - ref.item<double>()), 1e-5 * ref.item<double>());
  ref.backward();
  loss.backward();
  EXPECT_LT(rel(emb->weight.grad(), whole.grad().narrow(0, group->rank() * 12, 12)), 1e-5);
  // Gathered back, the logits are the whole head's.
  EXPECT_LT(rel(tpv->gather_vocab(local_logits, emb->weight), at::linear(ref_h, whole)), 1e-6);
}

// A table no style names, under sequence parallelism: each rank looks up its part of the
// sequence, and the table's gradient, summed over the group by sync_replicated_grads as the
// norms' are, is the whole sequence's once (looking up the whole sequence and splitting it had
// given every rank the whole gradient, which the sum counted once per rank).
TEST_F(Test, WholeEmbeddingUnderSequenceParallelismGivesOneProcessGradient) {
  const int t = world().size();
  auto group = tp_group(t);
  at::manual_seed(11);
  torch::nn::Sequential holder(torch::nn::Embedding(10, 6));
  auto* emb = holder[0]->as<torch::nn::Embedding>();
  at::Tensor whole = emb->weight.detach().clone().requires_grad_();
  auto tpz = std::make_shared<TensorParallelism>(group, /*sequence_parallel=*/true);
  tpz->apply(*holder, {});
  EXPECT_EQ(tpz->replicated(), std::vector<std::string>{"0.weight"});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  at::Tensor tokens = at::randint(0, 10, {2, 3 * t}, gen);
  at::Tensor g = at::randn({2, 3 * t, 6}, gen);
  at::Tensor ref = at::embedding(whole, tokens);
  (ref * g).sum().backward();
  at::Tensor mine = tpz->embedding(tokens, emb->weight);  // this rank's 3 positions
  const int64_t r = group->rank();
  EXPECT_TRUE(mine.equal(ref.detach().narrow(1, r * 3, 3)));
  (mine * g.narrow(1, r * 3, 3)).sum().backward();
  tpz->sync_replicated_grads({emb->weight.grad()});
  EXPECT_LT(rel(emb->weight.grad(), whole.grad()), 1e-6);
}

// A table and a head that share one tensor (two modules register it), named by two styles that
// cut it on dim 0 (vocab and colwise): it is cut once, to V/T rows, and the lookup, the loss and
// its gradient are one process's; styles that cut it two ways are refused, naming it.
struct SharedWeightImpl : torch::nn::Module {
  explicit SharedWeightImpl(const at::Tensor& w) { weight = register_parameter("weight", w); }
  at::Tensor weight;
};
struct TiedPair : torch::nn::Module {
  explicit TiedPair(const at::Tensor& w)
      : emb(register_module("emb", std::make_shared<SharedWeightImpl>(w))),
        head(register_module("head", std::make_shared<SharedWeightImpl>(w))) {}
  std::shared_ptr<SharedWeightImpl> emb, head;
};

TEST_F(Test, ATiedWeightTwoStylesNameIsCutOnce) {
  const int t = world().size();
  auto group = tp_group(t);
  at::manual_seed(12);
  const at::Tensor table = at::randn({4 * t * t, 8});
  at::Tensor whole = table.clone().requires_grad_();
  TiedPair m(table.clone());
  auto tpz = std::make_shared<TensorParallelism>(group, false);
  tpz->apply(m, {{"emb", Style::kVocab}, {"head", Style::kColwise}});
  const at::Tensor w = m.emb->weight;
  ASSERT_TRUE(w.is_same(m.head->weight));
  ASSERT_EQ(w.size(0), 4 * t);  // V / T, not V / T^2
  EXPECT_TRUE(tpz->full("head.weight", w).equal(table));
  EXPECT_TRUE(tpz->full("emb.weight", w).equal(table));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
  at::Tensor tokens = at::randint(0, 4 * t * t, {2, 5}, gen);
  at::Tensor targets = at::randint(0, 4 * t * t, {10}, gen);
  at::Tensor ref = at::cross_entropy_loss(
      at::linear(at::embedding(whole, tokens), whole).reshape({10, -1}), targets);
  at::Tensor loss =
      tpz->loss(tpz->linear(tpz->embedding(tokens, w), w).reshape({10, -1}), targets, w);
  EXPECT_LT(std::abs(loss.item<double>() - ref.item<double>()), 1e-5 * ref.item<double>());
  ref.backward();
  loss.backward();
  EXPECT_LT(rel(w.grad(), whole.grad().narrow(0, group->rank() * 4 * t, 4 * t)), 1e-5);

  TiedPair twoways(table.clone());
  auto tpr = std::make_shared<TensorParallelism>(group, false);
  try {
    tpr->apply(twoways, {{"emb", Style::kVocab}, {"head", Style::kRowwise}});
    ADD_FAILURE() << "a tensor cut on dim 0 and on dim 1 was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("head.weight is a tensor the plan already cut on dim 0"),
              std::string::npos)
        << e.what();
  }
}

// One TensorParallelism applied to model after model (the zoo does this): a model built after
// an applied one was destroyed is not taken for sliced, although its parameters may land where
// the old ones lived.
TEST_F(Test, AFreshModelIsNotTakenForADestroyedOnesSlices) {
  const int t = world().size();
  auto tpz = std::make_shared<TensorParallelism>(tp_group(t), false);
  int stale = 0;
  for (int round = 0; round < 20; ++round) {
    {
      torch::nn::Sequential applied(torch::nn::Linear(16, 32), torch::nn::Linear(32, 16));
      tpz->apply(*applied, {{"0", Style::kColwise}, {"1", Style::kRowwise}});
      ASSERT_TRUE(tpz->sliced(applied[0]->as<torch::nn::Linear>()->weight));
    }
    torch::nn::Sequential fresh(torch::nn::Linear(16, 32), torch::nn::Linear(32, 16));
    for (const auto& p : fresh->parameters()) stale += tpz->sliced(p) ? 1 : 0;
  }
  EXPECT_EQ(stale, 0) << "parameters of fresh models taken for a destroyed model's slices";
}

// The vocabulary-parallel loss ignores targets of -100 as cross_entropy does (the mean over the
// other rows, no gradient for theirs; none left: NaN and no gradient), and refuses a target
// outside the vocabulary on every rank.
TEST_F(Test, VocabParallelLossIgnoresMinus100AndRefusesOtherTargetsAsTorch) {
  const int t = world().size();
  auto group = tp_group(t);
  const int64_t r = group->rank(), v = 6 * t;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
  const at::Tensor logits = at::randn({7, v}, gen);
  auto check = [&](const at::Tensor& targets) {
    at::Tensor whole = logits.clone().requires_grad_();
    at::Tensor mine = logits.narrow(1, r * 6, 6).clone().requires_grad_();
    at::Tensor ref = at::cross_entropy_loss(whole, targets);
    at::Tensor loss = tp::vocab_parallel_cross_entropy(mine, targets, r * 6, group);
    if (std::isnan(ref.item<double>())) {
      EXPECT_TRUE(std::isnan(loss.item<double>()));
    } else {
      EXPECT_LT(std::abs(loss.item<double>() - ref.item<double>()), 1e-6 * ref.item<double>());
    }
    ref.backward();
    loss.backward();
    EXPECT_LT(rel(mine.grad(), whole.grad().narrow(1, r * 6, 6)), 1e-6);
  };
  {
    SCOPED_TRACE("some -100");
    check(at::tensor({3, -100, 0, static_cast<int>(v - 1), -100, 7, 1}, at::kLong));
  }
  {
    SCOPED_TRACE("all -100");
    check(at::full({7}, -100, at::kLong));
  }
  for (int64_t bad : {v, int64_t{-1}}) {
    at::Tensor targets = at::tensor({1, 2, 3, 4, 5, 0, 1}, at::kLong);
    targets[3] = bad;
    try {
      tp::vocab_parallel_cross_entropy(logits.narrow(1, r * 6, 6), targets, r * 6, group);
      ADD_FAILURE() << "target " << bad << " was accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("outside [0, the vocabulary size)"), std::string::npos)
          << e.what();
    }
  }
}

LlamaOptions tiny_llama(int t, bool tie) {
  return LlamaOptions()
      .vocab_size(16 * t)
      .hidden_size(32)
      .intermediate_size(24 * t)
      .num_hidden_layers(2)
      .num_attention_heads(2 * t)
      .num_key_value_heads(t)
      .max_position_embeddings(32)
      .tie_word_embeddings(tie);
}

// The Llama plan against the same Llama whole: the loss (vocabulary-parallel) and every
// parameter's gradient, gathered from the slices, with tied and untied heads, with and without
// sequence parallelism (gathering the column-wise inputs again in backward, or keeping them);
// and the plan's gradient norm (summed over the slices, the norms' weights
// once) equals the whole model's.
TEST_F(Test, LlamaPlanGivesOneProcessLossAndGradients) {
  const int t = world().size();
  auto group = tp_group(t);
  for (bool tie : {true, false}) {
    for (int mode : {0, 1, 2}) {
      const bool sp = mode > 0, regather = mode == 1;
      SCOPED_TRACE(std::string(tie ? "tied" : "untied") +
                   (sp ? regather ? ", sequence parallel" : ", sequence parallel, kept" : ""));
      at::manual_seed(21);
      LlamaForCausalLM whole(tiny_llama(t, tie));
      at::manual_seed(21);
      LlamaForCausalLM sliced(tiny_llama(t, tie));
      auto tpz = std::make_shared<TensorParallelism>(group, sp, regather);
      const auto done = sliced->parallelize(tpz);
      EXPECT_EQ(done.size(), tie ? 15u : 16u) << "14 layer weights, the embedding, the head";
      auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
      at::Tensor tokens = at::randint(0, 16 * t, {2, 4 * t}, gen);
      at::Tensor targets = at::randint(0, 16 * t, {2 * 4 * t}, gen);
      at::Tensor ref = at::cross_entropy_loss(whole->forward(tokens).reshape({8 * t, -1}), targets);
      at::Tensor logits = sliced->forward(tokens);
      at::Tensor loss = tpz->loss(logits.reshape({8 * t, -1}), targets, sliced->head_weight());
      EXPECT_LT(std::abs(loss.item<double>() - ref.item<double>()), 1e-5 * ref.item<double>());
      ref.backward();
      loss.backward();
      std::map<std::string, at::Tensor> want;
      for (const auto& p : whole->named_parameters()) want[p.key()] = p.value().grad();
      std::vector<at::Tensor> replicated_grads;
      for (const auto& name : tpz->replicated()) {
        replicated_grads.push_back(sliced->named_parameters()[name].grad());
      }
      tpz->sync_replicated_grads(replicated_grads);  // sequence parallelism: the norms' weights
      std::vector<at::Tensor> params;
      std::vector<bool> flags;
      for (const auto& p : sliced->named_parameters()) {
        const at::Tensor full = tpz->full(p.key(), p.value().grad());
        EXPECT_LT(rel(full, want.at(p.key())), 2e-5) << p.key();
        params.push_back(p.value());
        flags.push_back(tpz->sliced(p.key()));
      }
      const at::Tensor norm = norm_of_grad_norms_tp(
          [&] {
            std::vector<at::Tensor> n;
            for (const auto& p : params) n.push_back(local_grad_norm(p));
            return n;
          }(),
          2.0, nullptr, group.get(), flags);
      EXPECT_LT(std::abs(norm.item<double>() - grad_norm(whole->parameters()).item<double>()),
                1e-5 * norm.item<double>());
    }
  }
}

// FSDP over the data-parallel ranks of a 2-D mesh (shard 2 x tp 2 at 4 ranks), each FSDP rank
// with its half of the batch, trains as one process with the whole batch: the losses of every
// step within rounding, clipping by the norm over both dimensions, AdamW; and the parameters at
// the end, gathered over both.
TEST_F(Test, FsdpTimesTpTrainsAsOneProcess) {
  if (world().size() != 4) GTEST_SKIP() << "a 2 x 2 mesh needs 4 ranks";
  DeviceMesh mesh(world_ptr(), MeshShape{1, 2, 2, 1});
  at::manual_seed(31);
  LlamaForCausalLM whole(tiny_llama(2, true));
  at::manual_seed(31);
  LlamaForCausalLM sliced(tiny_llama(2, true));
  auto tpz = std::make_shared<TensorParallelism>(mesh.tp(), /*sequence_parallel=*/true);
  sliced->parallelize(tpz);
  FullyShardedDataParallel<LlamaForCausalLM> fsdp(
      sliced, mesh.dp(),
      FSDPOptions().sync_module_states(false).auto_wrap(
          AutoWrapPolicy().module_types({"LlamaDecoderLayer"})));
  optim::AdamW ref_opt(whole->parameters(), torch::optim::AdamWOptions(1e-2));
  optim::AdamW opt(fsdp.parameters(), torch::optim::AdamWOptions(1e-2));
  std::vector<bool> sliced_flags;
  for (const auto& [name, master] : fsdp.state().all_parameters()) {
    sliced_flags.push_back(tpz->sliced(name));
  }
  std::map<std::string, at::Tensor> start;
  for (const auto& p : whole->named_parameters()) start[p.key()] = p.value().detach().clone();
  for (int step = 0; step < 4; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
    at::Tensor tokens = at::randint(0, 32, {4, 8}, gen);
    at::Tensor targets = at::randint(0, 32, {4, 8}, gen);
    ref_opt.zero_grad();
    at::Tensor ref =
        at::cross_entropy_loss(whole->forward(tokens).reshape({32, -1}), targets.reshape({-1}));
    ref.backward();
    const double ref_norm = clip_grad_norm_(whole->parameters(), 0.5);
    ref_opt.step();
    // This data-parallel rank's half; the TP ranks of a group take the same.
    const int64_t d = mesh.dp_rank();
    {  // A forward without grad (validation) between steps gives the same loss.
      c10::NoGradGuard no_grad;
      at::Tensor eval = tpz->loss(fsdp.forward(tokens.narrow(0, 2 * d, 2)).reshape({16, -1}),
                                  targets.narrow(0, 2 * d, 2).reshape({-1}), sliced->head_weight());
      mesh.dp()->all_reduce(eval).wait();
      EXPECT_LT(std::abs(eval.item<double>() / 2 - ref.item<double>()), 2e-5 * ref.item<double>())
          << "no-grad forward, step " << step;
    }
    opt.zero_grad();
    at::Tensor logits = fsdp.forward(tokens.narrow(0, 2 * d, 2));
    at::Tensor loss = tpz->loss(logits.reshape({16, -1}), targets.narrow(0, 2 * d, 2).reshape({-1}),
                                sliced->head_weight());
    loss.backward();
    // The norms' weights saw this rank's part of the sequence: summed over the TP group.
    std::vector<at::Tensor> grads;
    for (const auto& [name, master] : fsdp.state().all_parameters()) {
      if (!tpz->sliced(name)) grads.push_back(master.grad());
    }
    tpz->sync_replicated_grads(grads);
    const at::Tensor norm = clip_grad_norm_tp_(
        fsdp.parameters(), 0.5, 2.0, fsdp.state().shard_group(), mesh.tp().get(), sliced_flags);
    opt.step();
    at::Tensor mean = loss.detach().reshape({1}).clone();
    mesh.dp()->all_reduce(mean).wait();
    EXPECT_LT(std::abs(mean.item<double>() / 2 - ref.item<double>()), 2e-5 * ref.item<double>())
        << "step " << step;
    EXPECT_LT(std::abs(norm.item<double>() - ref_norm), 2e-5 * ref_norm) << "step " << step;
  }
  // Against how far the weights moved: AdamW's normalized steps carry rounding of near-zero
  // gradients into the weights at lr scale, and a wrong gradient moves them by a step's order.
  const auto full = fsdp.state().full_parameters();
  std::map<std::string, at::Tensor> want;
  for (const auto& p : whole->named_parameters()) want[p.key()] = p.value();
  for (const auto& [name, local] : full) {
    const at::Tensor moved = (want.at(name) - start.at(name)).abs().max();
    const at::Tensor off = (tpz->full(name, local) - want.at(name)).abs().max();
    EXPECT_LT(off.item<double>(), 2e-3 * moved.item<double>()) << name;
  }
}

// The trainer's FSDP strategy over a 2 x 2 mesh with tensor parallelism, on a Llama with a frozen
// weight: the gradient norm (and the clip) over both dimensions is one process's over its
// trainable parameters. (Before, the strategy listed the frozen weight among the sliced flags
// and the norm refused the mismatch: 19 flags for 18 parameters.)
TEST_F(Test, FsdpStrategyTimesTpClipsAModelWithAFrozenWeightAsOneProcess) {
  if (world().size() != 4) GTEST_SKIP() << "a 2 x 2 mesh needs 4 ranks";
  auto mesh = std::make_shared<DeviceMesh>(world_ptr(), MeshShape{1, 2, 2, 1});
  const std::string frozen = "model.layers.0.mlp.up_proj.weight";
  at::manual_seed(33);
  LlamaForCausalLM whole(tiny_llama(2, false));
  at::manual_seed(33);
  LlamaForCausalLM sliced(tiny_llama(2, false));
  whole->named_parameters()[frozen].requires_grad_(false);
  sliced->named_parameters()[frozen].requires_grad_(false);
  auto tpz = std::make_shared<TensorParallelism>(mesh->tp(), /*sequence_parallel=*/true);
  sliced->parallelize(tpz);
  framework::FsdpStrategy<LlamaForCausalLM> strategy(
      sliced, mesh->dp(),
      FSDPOptions().sync_module_states(false).auto_wrap(
          AutoWrapPolicy().module_types({"LlamaDecoderLayer"})));
  strategy.set_tensor_parallel(tpz, [sliced] { return sliced->head_weight(); });
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  at::Tensor tokens = at::randint(0, 32, {4, 8}, gen);
  at::Tensor targets = at::randint(0, 32, {4, 8}, gen);
  at::cross_entropy_loss(whole->forward(tokens).reshape({32, -1}), targets.reshape({-1}))
      .backward();
  const double want = clip_grad_norm_(whole->parameters(), 0.5);
  const int64_t d = mesh->dp_rank();
  tpz->loss(strategy.forward(tokens.narrow(0, 2 * d, 2)).reshape({16, -1}),
            targets.narrow(0, 2 * d, 2).reshape({-1}), sliced->head_weight())
      .backward();
  strategy.finish_backward();
  const double got = strategy.clip_grad_norm(0.5).item<double>();
  EXPECT_LT(std::abs(got - want), 2e-5 * want);
  EXPECT_GT(want, 0.5) << "the clip must bite";
}

// The trainer's summed loss under tensor parallelism against cross_entropy's sum over one
// process's logits: targets of -100 add nothing, and none left sums to 0 with no gradient.
// (It was the mean times every target: off by the ignored share, and NaN when all were.)
TEST_F(Test, StrategyLossSumUnderTpIgnoresMinus100AsCrossEntropy) {
  if (world().size() % 2 != 0) GTEST_SKIP() << "tp 2 needs an even number of ranks";
  auto mesh = std::make_shared<DeviceMesh>(world_ptr(), MeshShape{world().size() / 2, 1, 2, 1});
  at::manual_seed(34);
  LlamaForCausalLM whole(tiny_llama(2, false));
  at::manual_seed(34);
  LlamaForCausalLM sliced(tiny_llama(2, false));
  auto tpz = std::make_shared<TensorParallelism>(mesh->tp(), /*sequence_parallel=*/false);
  sliced->parallelize(tpz);
  framework::PlainStrategy<LlamaForCausalLM> strategy(sliced);
  strategy.set_tensor_parallel(tpz, [sliced] { return sliced->head_weight(); });
  auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
  const at::Tensor tokens = at::randint(0, 32, {2, 8}, gen);
  const std::string norm = "model.norm.weight";  // replicated: its gradient is whole on each rank
  for (const std::string kind : {"no -100", "some -100", "all -100"}) {
    SCOPED_TRACE(kind);
    at::Tensor targets = at::randint(0, 32, {2, 8}, gen);
    if (kind == "some -100") targets.view({-1}).slice(0, 0, 16, 3).fill_(-100);
    if (kind == "all -100") targets.fill_(-100);
    whole->zero_grad();
    sliced->zero_grad();
    at::Tensor want = at::cross_entropy_loss(whole->forward(tokens).reshape({16, -1}),
                                             targets.reshape({-1}), {}, at::Reduction::Sum);
    at::Tensor got = strategy.cross_entropy_sum(strategy.forward(tokens), targets);
    const double w = want.item<double>();
    EXPECT_LE(std::abs(got.item<double>() - w), 1e-5 * std::max(1.0, std::abs(w)))
        << got.item<double>() << " against " << w;
    want.backward();
    got.backward();
    at::Tensor gw = whole->named_parameters()[norm].grad(),
               gs = sliced->named_parameters()[norm].grad();
    ASSERT_TRUE(gw.defined() && gs.defined());
    EXPECT_LE((gs - gw).abs().max().item<double>(),
              1e-5 * std::max(1.0, gw.abs().max().item<double>()));
    if (kind == "all -100") {
      EXPECT_EQ(gs.abs().max().item<double>(), 0.0);
    }
  }
}

}  // namespace
}  // namespace dtrain::sharding

int main(int argc, char** argv) { return dtrain::testing::multirank_main(argc, argv); }
