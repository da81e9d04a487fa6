// Pipeline parallelism against one process, on every rank of a real multi-process job: a Llama
// split into stages by layer and run under each schedule (gpipe, 1f1b, interleaved_1f1b,
// zero_bubble: each backward split in two, its weights' half run later) with
// 1, 2 and 8 micro-batches gives the loss of one process running the micro-batches in turn,
// and every parameter of every stage the same gradient (within fp32 rounding). Stages built
// of the module patterns the FSDP tests try (a module called twice, frozen and unused
// parameters, a parameter used by some micro-batches only, buffers of four dtypes updated in
// a no-grad forward, a stage that cuts the graph for one micro-batch, gradients accumulated
// over two steps) give one process's gradients and buffers too. Each rank
// computes the one-process reference itself, on a model built from the same seed. A stage
// that sends a wrong activation or gradient, or a schedule that drops or misorders a
// micro-batch's backward, fails these.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>

#include "core/error.h"
#include "framework/config.h"
#include "framework/models/llama.h"
#include "framework/pipeline_strategy.h"
#include "sharding/clip_grad.h"
#include "sharding/mesh.h"
#include "sharding/pipeline.h"
#include "sharding/recompute.h"
#include "tests/multirank.h"

namespace dtrain::sharding::pp {
namespace {

using dtrain::framework::LlamaForCausalLM;
using dtrain::framework::LlamaOptions;
using dtrain::testing::world;
using dtrain::testing::world_ptr;
using Test = dtrain::testing::MultiRankTest;

constexpr int64_t kLayers = 8, kVocab = 96, kSeq = 8, kMicro = 2;

LlamaForCausalLM make_model(at::ScalarType dtype) {
  LlamaOptions o;
  o.vocab_size(kVocab)
      .hidden_size(32)
      .intermediate_size(48)
      .num_hidden_layers(kLayers)
      .num_attention_heads(4)
      .num_key_value_heads(2)
      .tie_word_embeddings(false);
  at::manual_seed(11);
  LlamaForCausalLM m(o);
  // A frozen weight: no gradient in either run.
  m->named_parameters()["model.layers.2.mlp.gate_proj.weight"].requires_grad_(false);
  m->to(dtype);
  return m;
}

at::Tensor loss_of(const at::Tensor& logits, const at::Tensor& targets, int micro_batches) {
  return at::cross_entropy_loss(logits.reshape({-1, kVocab}), targets.reshape({-1})) /
         micro_batches;
}

struct Case {
  ScheduleKind kind;
  int micro_batches;
  int stages_per_rank;
  at::ScalarType dtype = at::kFloat;  // the model's, and the activations' on the wire
  bool recompute = false;             // each stage's forward recomputed in its backward
  double clip = 0;                    // > 0: clip both runs' gradients to this norm first
  std::vector<int64_t> split = {};    // layers per stage; empty: even
  bool local = false;                 // every stage on this rank (a pipeline of one rank)
  bool freeze_first = false;          // stage 0's parameters frozen in both runs
};

// Freezes the embedding and layers [0, end) of `m`: a first stage without gradients.
// The decoder layer a parameter belongs to ("model.layers.<i>.…"), or -1 for the embedding,
// the norm and the head.
int64_t layer_of(const std::string& name) {
  if (name.rfind("model.layers.", 0) != 0) return -1;
  return std::stoll(name.substr(13, name.find('.', 13) - 13));
}

void freeze_first_stage(LlamaForCausalLM& m, int64_t end) {
  for (const auto& kv : m->named_parameters()) {
    const std::string& name = kv.key();
    const int64_t layer = layer_of(name);
    if (layer >= 0 ? layer < end : name.rfind("model.embed_tokens", 0) == 0) {
      kv.value().requires_grad_(false);
    }
  }
}

void run_case(const Case& c) {
  const int p = c.local ? 1 : world().size();
  const int me = c.local ? 0 : world().rank();
  const auto group = c.local ? nullptr : world_ptr();
  SCOPED_TRACE(std::string(schedule_name(c.kind)) + " pp=" + std::to_string(p) +
               " m=" + std::to_string(c.micro_batches) + " v=" + std::to_string(c.stages_per_rank) +
               " " + c10::toString(c.dtype));
  const int M = c.micro_batches;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + M);
  std::vector<at::Tensor> tokens, targets;
  for (int m = 0; m < M; ++m) {
    tokens.push_back(at::randint(kVocab, {kMicro, kSeq}, gen));
    targets.push_back(at::randint(kVocab, {kMicro, kSeq}, gen));
  }
  const int64_t first_end = split_layers(kLayers, p * c.stages_per_rank, c.split)[0].second;
  // One process: the micro-batches in turn.
  LlamaForCausalLM ref = make_model(c.dtype);
  if (c.freeze_first) freeze_first_stage(ref, first_end);
  double ref_loss = 0;
  for (int m = 0; m < M; ++m) {
    at::Tensor loss = loss_of(ref->forward(tokens[m]), targets[m], M);
    loss.backward();
    ref_loss += loss.item<double>();
  }
  // The pipeline.
  LlamaForCausalLM model = make_model(c.dtype);
  if (c.freeze_first) freeze_first_stage(model, first_end);
  Pipeline pipe(make_schedule(c.kind, p, M, c.stages_per_rank), group);
  const int S = pipe.schedule().stages;
  const auto ranges = split_layers(kLayers, S, c.split);
  auto begin = [&](int stage) { return ranges[static_cast<size_t>(stage)].first; };
  auto end = [&](int stage) { return ranges[static_cast<size_t>(stage)].second; };
  Pipeline::Step step;
  step.forward = [&](int stage, int, const at::Tensor& x) {
    if (!c.recompute) return model->forward_stage(x, begin(stage), end(stage));
    // Only the stage's input kept; its layers run again in backward.
    std::vector<at::Tensor> params;
    for (const auto& kv : model->named_parameters()) params.push_back(kv.value());
    return recompute(
        [&, stage](const std::vector<at::Tensor>& in) {
          return std::vector<at::Tensor>{model->forward_stage(in[0], begin(stage), end(stage))};
        },
        {x}, params)[0];
  };
  step.loss = [&](int micro, const at::Tensor& logits) {
    return loss_of(logits, targets[static_cast<size_t>(micro)], M);
  };
  step.inputs = tokens;
  step.activation_shape = {kMicro, kSeq, 32};
  step.activation_dtype = c.dtype;  // a sender of another dtype is refused by the receiver
  std::vector<at::Tensor> losses = pipe.run(step);
  // The loss, agreed: every rank has the last stage's sum.
  EXPECT_NEAR(pipe.loss_sum(losses).item<double>(), ref_loss,
              (c.dtype == at::kFloat ? 1e-6 : 1e-3) * std::abs(ref_loss));
  if (c.clip > 0) {
    // The norm over every stage (each rank's combined once), and the same clipping.
    std::vector<at::Tensor> mine, all;
    for (const auto& kv : model->named_parameters()) {
      if (kv.value().grad().defined()) mine.push_back(kv.value());
    }
    for (const auto& p : ref->parameters()) {
      if (p.grad().defined()) all.push_back(p);
    }
    const double want = clip_grad_norm_(all, c.clip);
    const double got = clip_grad_norm_(mine, c.clip, 2.0, group.get(), false, ShardNorm::kPerRank);
    EXPECT_NEAR(got, want, 1e-6 * want);
    EXPECT_GT(want, c.clip) << "the clip must bite for the test to mean something";
  }
  EXPECT_EQ(pipe.peak_in_flight(), pipe.schedule().promised_in_flight[me]);
  if (pipe.schedule().rank_of(S - 1) == me) {
    ASSERT_EQ(losses.size(), static_cast<size_t>(M));
    double sum = 0;
    for (const auto& l : losses) sum += l.item<double>();
    EXPECT_NEAR(sum, ref_loss, (c.dtype == at::kFloat ? 1e-6 : 1e-3) * std::abs(ref_loss));
  } else {
    EXPECT_TRUE(losses.empty());
  }
  // Every parameter of this rank's stages: the reference's gradient; the others none.
  auto stage_of = [&](const std::string& name) {
    if (name.rfind("model.embed_tokens", 0) == 0) return 0;
    if (name.rfind("model.norm", 0) == 0 || name.rfind("lm_head", 0) == 0) return S - 1;
    const int64_t layer = layer_of(name);
    int stage = 0;
    while (end(stage) <= layer) ++stage;
    return stage;
  };
  auto ref_params = ref->named_parameters();
  int compared = 0;
  double worst = 0;
  for (const auto& kv : model->named_parameters()) {
    const at::Tensor& want = ref_params[kv.key()].grad();
    const at::Tensor& got = kv.value().grad();
    if (pipe.schedule().rank_of(stage_of(kv.key())) != me) {
      EXPECT_FALSE(got.defined()) << kv.key() << " is another rank's";
      continue;
    }
    ASSERT_EQ(got.defined(), want.defined()) << kv.key();
    if (!want.defined()) continue;
    const double scale = want.abs().max().item<double>();
    const double tol = c.dtype == at::kFloat ? 1e-5 : 1e-2;
    const double diff = (got - want).abs().max().item<double>();
    EXPECT_LE(diff, tol * scale + 1e-12) << kv.key();
    worst = std::max(worst, scale > 0 ? diff / scale : diff);
    ++compared;
  }
  EXPECT_GE(compared, c.freeze_first && me == 0 ? 0 : 5);  // a frozen stage has no gradient
  std::printf("%s pp=%d m=%d v=%d %s%s%s: %d gradients, worst difference %.2e of the largest\n",
              schedule_name(c.kind), p, M, c.stages_per_rank, c10::toString(c.dtype),
              c.recompute ? " recomputed" : "", c.clip > 0 ? " clipped" : "", compared, worst);
}

TEST_F(Test, EveryScheduleGivesOneProcessLossAndGradients) {
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
    for (int m : {1, 2, 8}) run_case({kind, m, 1});
  }
  const int p = world().size();
  for (int m : {p, 2 * p}) run_case({ScheduleKind::kInterleaved1F1B, m, 2});
  // Each backward in two halves, the weights' run late.
  for (int m : {1, 2, p, 8}) run_case({ScheduleKind::kZeroBubble, m, 1});
}

// Recompute inside the stages, and the gradients clipped over all stages as one process clips
// the whole model's.
TEST_F(Test, RecomputeAndClippingAcrossStagesGiveOneProcessGradients) {
  run_case({ScheduleKind::k1F1B, 4, 1, at::kFloat, /*recompute=*/true});
  run_case({ScheduleKind::kGPipe, 2, 1, at::kFloat, false, /*clip=*/0.05});
  run_case({ScheduleKind::kInterleaved1F1B, 2 * world().size(), 2, at::kFloat, true, 0.05});
  run_case({ScheduleKind::kZeroBubble, 4, 1, at::kFloat, true, 0.05});
}

// Stages of unequal depth (parallel.pp_split): one layer moved from the last stage, which
// also holds the norm, the head and the loss, to the first.
TEST_F(Test, AnUnevenSplitGivesOneProcessGradients) {
  const int p = world().size();
  ASSERT_GE(kLayers / p, 2) << "run at 2 to 4 ranks";
  std::vector<int64_t> split(static_cast<size_t>(p), kLayers / p);
  split[0] += 1;
  split[static_cast<size_t>(p - 1)] -= 1;
  run_case({ScheduleKind::k1F1B, 4, 1, at::kFloat, false, 0, split});
}

// A pipeline of one rank holding every stage (interleaved_1f1b's looping placement on one
// rank): the hand-offs between its stages stay on the rank.
TEST_F(Test, OneRankHoldingEveryStageGivesOneProcessGradients) {
  Case c{ScheduleKind::kInterleaved1F1B, 4, 4};
  c.local = true;
  run_case(c);
}

// A tied head is the embedding: split across stages its gradient would be split too.
TEST_F(Test, TiedEmbeddingsAreNotSplitIntoStages) {
  LlamaOptions o;
  o.vocab_size(kVocab)
      .hidden_size(32)
      .intermediate_size(48)
      .num_hidden_layers(2)
      .num_attention_heads(4)
      .num_key_value_heads(2)
      .tie_word_embeddings(true);
  LlamaForCausalLM m(o);
  at::Tensor tokens = at::zeros({1, 4}, at::kLong);
  EXPECT_THROW(m->forward_stage(tokens, 0, 1), UsageError);
  EXPECT_EQ(m->forward_stage(tokens, 0, 2).sizes(), m->forward(tokens).sizes());
}

// A frozen first stage: no backward runs there, and the others' gradients are one process's.
TEST_F(Test, AFrozenStageRunsNoBackward) {
  // The embedding and first layers frozen: stage 0's output needs no gradient.
  run_case({ScheduleKind::k1F1B, 2, 1, at::kFloat, false, 0, {}, false, /*freeze_first=*/true});
  run_case({ScheduleKind::kZeroBubble, 2, 1, at::kFloat, false, 0, {}, false, true});
}

// Evaluation: a forward-only schedule gives one process's losses, holding nothing and
// leaving no gradient.
TEST_F(Test, ForwardOnlyGivesOneProcessLosses) {
  const int p = world().size();
  for (int v : {1, 2}) {
    const int M = 3;  // not a multiple of the ranks: the last group is short
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    std::vector<at::Tensor> tokens, targets;
    for (int m = 0; m < M; ++m) {
      tokens.push_back(at::randint(kVocab, {kMicro, kSeq}, gen));
      targets.push_back(at::randint(kVocab, {kMicro, kSeq}, gen));
    }
    LlamaForCausalLM model = make_model(at::kFloat);
    std::vector<double> want;
    {
      c10::NoGradGuard no_grad;
      for (int m = 0; m < M; ++m)
        want.push_back(loss_of(model->forward(tokens[m]), targets[m], 1).item<double>());
    }
    Pipeline pipe(make_schedule(ScheduleKind::kForwardOnly, p, M, v), world_ptr());
    const auto ranges = split_layers(kLayers, pipe.schedule().stages);
    Pipeline::Step step;
    step.forward = [&](int stage, int, const at::Tensor& x) {
      return model->forward_stage(x, ranges[stage].first, ranges[stage].second);
    };
    step.loss = [&](int micro, const at::Tensor& logits) {
      return loss_of(logits, targets[static_cast<size_t>(micro)], 1);
    };
    step.inputs = tokens;
    step.activation_shape = {kMicro, kSeq, 32};
    std::vector<at::Tensor> losses = pipe.run(step);
    EXPECT_EQ(pipe.peak_in_flight(), 0);
    if (pipe.schedule().rank_of(pipe.schedule().stages - 1) == world().rank()) {
      ASSERT_EQ(losses.size(), static_cast<size_t>(M));
      for (int m = 0; m < M; ++m) {
        EXPECT_EQ(losses[m].item<double>(), want[m]) << "micro-batch " << m;
        EXPECT_FALSE(losses[m].requires_grad());
      }
    }
    for (const auto& t : model->parameters()) EXPECT_FALSE(t.grad().defined());
  }
}

// A stage of the module patterns the FSDP tests try: `shared` is called twice (its gradient
// sums both uses), `frozen` has none, `unused` is never called, `gate` is used by the
// even micro-batches only, and four buffers (fp32, double, bf16, int64) are updated under
// NoGradGuard in every forward, then read by it. The stage given `cut` detaches its input for
// micro-batch 1: nothing flows back from there to the stages before it.
struct PatternStageImpl : torch::nn::Module {
  explicit PatternStageImpl(int64_t h) {
    shared = register_module("shared", torch::nn::Linear(h, h));
    frozen = register_module("frozen", torch::nn::Linear(h, h));
    unused = register_module("unused", torch::nn::Linear(h, h));
    for (auto& t : frozen->parameters()) t.requires_grad_(false);
    gate = register_parameter("gate", at::randn({h}) * 0.1);
    mean = register_buffer("mean", at::zeros({h}));
    var = register_buffer("var", at::ones({h}, at::kDouble));
    ema = register_buffer("ema", at::zeros({h}, at::kBFloat16));
    count = register_buffer("count", at::zeros({}, at::kLong));
  }
  at::Tensor forward(at::Tensor x, int micro, bool cut) {
    if (cut && micro == 1) x = x.detach();
    at::Tensor y = at::tanh(shared->forward(x));
    y = at::tanh(shared->forward(y)) + frozen->forward(x);
    if (micro % 2 == 0) y = y * (1 + gate);
    {
      c10::NoGradGuard no_grad;
      const at::Tensor m = y.mean({0, 1});
      mean.mul_(0.9).add_(m, 0.1);
      var.mul_(0.9).add_(y.var({0, 1}).to(at::kDouble), 0.1);
      ema.mul_(0.5).add_(m.to(at::kBFloat16), 0.5);
      count.add_(1);
    }
    return y + mean * count.to(at::kFloat) * 0.01;
  }
  torch::nn::Linear shared{nullptr}, frozen{nullptr}, unused{nullptr};
  at::Tensor gate, mean, var, ema, count;
};
TORCH_MODULE(PatternStage);

void run_pattern_case(ScheduleKind kind, int M, int v) {
  const int p = world().size(), me = world().rank();
  SCOPED_TRACE(std::string(schedule_name(kind)) + " m=" + std::to_string(M) +
               " v=" + std::to_string(v));
  constexpr int64_t kH = 16;
  const int S = p * v;
  const int cut = S > 1 ? 1 : -1;  // stage 1 cuts micro-batch 1's graph
  auto make = [&] {
    at::manual_seed(5);
    std::vector<PatternStage> stages;
    for (int s = 0; s < S; ++s) stages.emplace_back(kH);
    return stages;
  };
  constexpr int kSteps = 2;  // gradients accumulate over both, zeroed by neither run
  auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + M);
  std::vector<std::vector<at::Tensor>> inputs(kSteps), targets(kSteps);
  for (int t = 0; t < kSteps; ++t) {
    for (int m = 0; m < M; ++m) {
      inputs[t].push_back(at::randn({kMicro, kSeq, kH}, gen));
      targets[t].push_back(at::randn({kMicro, kSeq, kH}, gen));
    }
  }
  auto loss_fn = [&](const at::Tensor& y, const at::Tensor& target) {
    return (y - target).pow(2).mean() / M;
  };
  // One process: every micro-batch through every stage in turn.
  std::vector<PatternStage> ref = make();
  std::vector<double> ref_loss(kSteps, 0.0);
  for (int t = 0; t < kSteps; ++t) {
    for (int m = 0; m < M; ++m) {
      at::Tensor y = inputs[t][m];
      for (int s = 0; s < S; ++s) y = ref[s]->forward(y, m, s == cut);
      at::Tensor loss = loss_fn(y, targets[t][m]);
      loss.backward();
      ref_loss[t] += loss.item<double>();
    }
  }
  // The pipeline, run twice.
  std::vector<PatternStage> stages = make();
  Pipeline pipe(make_schedule(kind, p, M, v), world_ptr());
  for (int t = 0; t < kSteps; ++t) {
    Pipeline::Step step;
    step.forward = [&](int stage, int micro, const at::Tensor& x) {
      return stages[stage]->forward(x, micro, stage == cut);
    };
    step.loss = [&](int micro, const at::Tensor& y) {
      return loss_fn(y, targets[t][static_cast<size_t>(micro)]);
    };
    step.inputs = inputs[t];
    step.activation_shape = {kMicro, kSeq, kH};
    std::vector<at::Tensor> losses = pipe.run(step);
    EXPECT_NEAR(pipe.loss_sum(losses).item<double>(), ref_loss[t], 1e-6 * std::abs(ref_loss[t]));
  }
  int grads = 0, none = 0, buffers = 0;
  double worst = 0;
  for (int s = 0; s < S; ++s) {
    const auto want = ref[s]->named_parameters();
    for (const auto& kv : stages[s]->named_parameters()) {
      const at::Tensor& got = kv.value().grad();
      if (pipe.schedule().rank_of(s) != me) {
        EXPECT_FALSE(got.defined()) << "stage " << s << " " << kv.key() << " is another rank's";
        continue;
      }
      const at::Tensor& w = want[kv.key()].grad();
      ASSERT_EQ(got.defined(), w.defined()) << "stage " << s << " " << kv.key();
      if (!w.defined()) {
        ++none;
        continue;
      }
      const double scale = w.abs().max().item<double>();
      const double diff = (got - w).abs().max().item<double>();
      EXPECT_LE(diff, 1e-6 * scale + 1e-12) << "stage " << s << " " << kv.key();
      worst = std::max(worst, scale > 0 ? diff / scale : diff);
      ++grads;
    }
    if (pipe.schedule().rank_of(s) != me) continue;
    const auto want_buffers = ref[s]->named_buffers();
    for (const auto& kv : stages[s]->named_buffers()) {
      EXPECT_TRUE(at::equal(kv.value(), want_buffers[kv.key()]))
          << "stage " << s << " buffer " << kv.key();
      ++buffers;
    }
  }
  // Each of this rank's v stages: shared (2) and gate with gradients; frozen (2), unused (2)
  // without; 4 buffers.
  EXPECT_EQ(grads, 3 * v);
  EXPECT_EQ(none, 4 * v);
  EXPECT_EQ(buffers, 4 * v);
  std::printf(
      "patterns %s pp=%d m=%d v=%d, 2 steps: %d gradients (worst difference %.2e of the "
      "largest), %d none, %d buffers equal\n",
      schedule_name(kind), p, M, v, grads, worst, none, buffers);
}

TEST_F(Test, ModulePatternsGiveOneProcessGradientsAndBuffers) {
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
    for (int m : {2, 4}) run_pattern_case(kind, m, 1);
  }
  run_pattern_case(ScheduleKind::kInterleaved1F1B, 2 * world().size(), 2);
  for (int m : {2, 4}) run_pattern_case(ScheduleKind::kZeroBubble, m, 1);
}

// The trainer's PipelineStrategy on a user's model whose layers hold buffers of four dtypes,
// updated by every forward: after the steps, share() gives every rank each buffer as its
// stage's rank holds it (what a checkpoint or an export reads), and share(to_first) gives them
// to rank 0, which writes a checkpoint. Both equal one process's buffers after the same
// micro-batches; each stage's gradients are one process's too.
struct BufferedLayerImpl : torch::nn::Module {
  explicit BufferedLayerImpl(int64_t h) {
    lin = register_module("lin", torch::nn::Linear(h, h));
    mean = register_buffer("mean", at::zeros({h}));
    var = register_buffer("var", at::ones({h}, at::kDouble));
    ema = register_buffer("ema", at::zeros({h}, at::kBFloat16));
    count = register_buffer("count", at::zeros({}, at::kLong));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = at::tanh(lin->forward(x));
    c10::NoGradGuard no_grad;
    const at::Tensor m = y.detach().mean({0, 1});
    mean.mul_(0.9).add_(m, 0.1);
    var.mul_(0.9).add_(y.detach().var({0, 1}).to(at::kDouble), 0.1);
    ema.mul_(0.5).add_(m.to(at::kBFloat16), 0.5);
    count.add_(1);
    return y;
  }
  torch::nn::Linear lin{nullptr};
  at::Tensor mean, var, ema, count;
};
TORCH_MODULE(BufferedLayer);

struct BufferedStackImpl : torch::nn::Module {
  BufferedStackImpl(int64_t layers, int64_t h) {
    embed = register_parameter("embed", at::randn({h}));
    auto list = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < layers; ++i) {
      blocks.emplace_back(h);
      list->push_back(blocks.back());
    }
    head = register_module("head", BufferedLayer(h));
  }
  // Layers [begin, end): the embedding first when begin is 0, the head last at the end.
  at::Tensor forward(at::Tensor x, int64_t begin, int64_t end) {
    if (begin == 0) x = x.unsqueeze(-1) * embed;
    for (int64_t i = begin; i < end; ++i) x = blocks[static_cast<size_t>(i)]->forward(x);
    if (end == static_cast<int64_t>(blocks.size())) x = head->forward(x);
    return x;
  }
  at::Tensor embed;
  std::vector<BufferedLayer> blocks;
  BufferedLayer head{nullptr};
};
TORCH_MODULE(BufferedStack);

// `groups` lists of `micro` batches: inputs [kMicro, kSeq] and targets [kMicro, kSeq, h].
std::vector<std::vector<framework::Batch>> stack_batches(size_t groups, int64_t micro, int64_t h,
                                                         uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<std::vector<framework::Batch>> out(groups);
  for (auto& group : out) {
    for (int64_t m = 0; m < micro; ++m) {
      group.push_back({at::randn({kMicro, kSeq}, gen), at::randn({kMicro, kSeq, h}, gen)});
    }
  }
  return out;
}

// A stack of `layers` (parameters "embed", "layers.<i>.*", then the head's) as a PipelineModel.
template <typename Stack>
framework::PipelineModel stack_model(Stack model, int64_t layers, int64_t h) {
  framework::PipelineModel pm;
  pm.module = model.ptr();
  pm.layers = layers;
  pm.hidden = h;
  pm.forward = [model](const at::Tensor& x, int64_t begin, int64_t end) mutable {
    return model->forward(x, begin, end);
  };
  pm.layer_of = [layers](const std::string& name) -> int64_t {
    if (name.rfind("layers.", 0) == 0) return std::stoll(name.substr(7, name.find('.', 7) - 7));
    return name == "embed" ? -1 : layers;
  };
  return pm;
}

TEST_F(Test, PipelineStrategySharesEachStagesBuffers) {
  const int p = world().size();
  constexpr int64_t kH = 8, kM = 2;
  const int64_t layers = 2 * p;
  framework::RunConfig c;
  c.parallel.pp = p;
  c.parallel.pp_schedule = ScheduleKind::k1F1B;
  c.train.micro_batches = kM;
  auto make = [&] {
    at::manual_seed(9);
    return BufferedStack(layers, kH);
  };
  const auto batches = stack_batches(/*steps=*/2, kM, kH, 21);
  auto loss_of = [&](const at::Tensor& y, const framework::Batch& b) {
    return (y - b.targets).pow(2).mean() / kM;
  };
  // One process: the micro-batches in turn, gradients accumulated over both steps.
  BufferedStack ref = make();
  for (const auto& step : batches) {
    for (const auto& b : step) loss_of(ref->forward(b.inputs, 0, layers), b).backward();
  }
  BufferedStack model = make();
  sharding::MeshShape shape;
  shape.pp = p;
  framework::PipelineStrategy strategy(stack_model(model, layers, kH),
                                       std::make_shared<sharding::DeviceMesh>(world_ptr(), shape),
                                       c);
  for (const auto& step : batches) {
    strategy.train(
        step, [&](int micro, const at::Tensor& y) { return loss_of(y, step[micro]); },
        [](const at::Tensor& l) { return l; });
  }
  // This rank's stages' gradients: one process's.
  const auto want_params = ref->named_parameters();
  int grads = 0;
  for (const auto& kv : model->named_parameters()) {
    if (!kv.value().grad().defined()) continue;
    EXPECT_TRUE(at::allclose(kv.value().grad(), want_params[kv.key()].grad(), 1e-5, 1e-7))
        << kv.key();
    ++grads;
  }
  EXPECT_GT(grads, 0);
  auto expect_buffers = [&](const char* what) {
    const auto want = ref->named_buffers();
    int equal = 0;
    for (const auto& kv : model->named_buffers()) {
      EXPECT_TRUE(at::equal(kv.value(), want[kv.key()])) << what << ": " << kv.key();
      equal += at::equal(kv.value(), want[kv.key()]) ? 1 : 0;
    }
    std::printf("%s: %d of %zu buffers equal one process's\n", what, equal,
                model->named_buffers().size());
  };
  // A checkpoint's: rank 0 receives every stage's buffers.
  strategy.share(nullptr, /*to_first=*/true);
  if (world().rank() == 0) expect_buffers("share(to_first) on rank 0");
  strategy.hold_whole(false);
  // An export's: every rank.
  strategy.share(nullptr);
  expect_buffers("share()");
  EXPECT_EQ(model->named_buffers().size(), static_cast<size_t>(4 * (layers + 1)));
}

// A stack whose layers each scale by (1 + gate) only when `use_gate`: a parameter that one data-
// parallel rank's micro-batches use and another's do not (as routing or a data-dependent branch).
struct GatedLayerImpl : torch::nn::Module {
  explicit GatedLayerImpl(int64_t h) {
    lin = register_module("lin", torch::nn::Linear(h, h));
    gate = register_parameter("gate", at::randn({h}) * 0.1);
  }
  at::Tensor forward(const at::Tensor& x, bool use_gate) {
    at::Tensor y = at::tanh(lin->forward(x));
    return use_gate ? y * (1 + gate) : y;
  }
  torch::nn::Linear lin{nullptr};
  at::Tensor gate;
};
TORCH_MODULE(GatedLayer);

struct GatedStackImpl : torch::nn::Module {
  GatedStackImpl(int64_t layers, int64_t h) {
    embed = register_parameter("embed", at::randn({h}));
    auto list = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < layers; ++i) {
      blocks.emplace_back(h);
      list->push_back(blocks.back());
    }
    head = register_module("head", torch::nn::Linear(h, h));
  }
  at::Tensor forward(at::Tensor x, int64_t begin, int64_t end) {
    if (begin == 0) x = x.unsqueeze(-1) * embed;
    for (int64_t i = begin; i < end; ++i) x = blocks[static_cast<size_t>(i)]->forward(x, use_gate);
    if (end == static_cast<int64_t>(blocks.size())) x = head->forward(x);
    return x;
  }
  at::Tensor embed;
  std::vector<GatedLayer> blocks;
  torch::nn::Linear head{nullptr};
  bool use_gate = true;
};
TORCH_MODULE(GatedStack);

// Two data-parallel pipelines (pp 2 x dp 2 at 4 ranks), DDP's and sharded: the gates only data-
// parallel rank 0's micro-batches use get the average of its gradient and the other ranks'
// zeros on every rank (every shard of them), as DDP's find_unused_parameters gives; after an
// SGD step of 1 the whole model is one process's that ran both ranks' micro-batches. (Before,
// the sharded stages left the gates' shards on the rank that had no gradient unstepped, and
// DDP's stages sent messages of other sizes.)
TEST_F(Test, DataParallelPipelinesStepAParameterOnlyOneRanksMicroBatchesUsed) {
  const int w = world().size();
  if (w < 4 || w % 2 != 0) GTEST_SKIP() << "needs pp 2 x a data-parallel group of 2 or more";
  constexpr int64_t kH = 6, kM = 2, kLayers = 4;
  const int dp = w / 2;
  auto make = [&] {
    at::manual_seed(13);
    return GatedStack(kLayers, kH);
  };
  const auto batches = stack_batches(static_cast<size_t>(dp), kM, kH, 31);
  auto loss_of = [&](const at::Tensor& y, const framework::Batch& b) {
    return (y - b.targets).pow(2).mean() / kM;
  };
  // One process: each data-parallel rank's micro-batches (the gates used by rank 0's only),
  // the gradients averaged over the ranks, a step of 1.
  GatedStack ref = make();
  for (int d = 0; d < dp; ++d) {
    ref->use_gate = d == 0;
    for (const auto& b : batches[static_cast<size_t>(d)]) {
      loss_of(ref->forward(b.inputs, 0, kLayers), b).backward();
    }
  }
  {
    c10::NoGradGuard no_grad;
    for (auto& p : ref->parameters()) p.sub_(p.grad() / dp);
  }
  for (auto kind : {framework::ParallelStrategy::kDdp, framework::ParallelStrategy::kFsdp}) {
    const bool sharded = kind == framework::ParallelStrategy::kFsdp;
    SCOPED_TRACE(sharded ? "sharded stages" : "DDP's stages");
    framework::RunConfig c;
    c.parallel.pp = 2;
    c.parallel.strategy = kind;
    c.parallel.pp_schedule = ScheduleKind::k1F1B;
    c.train.micro_batches = kM;
    sharding::MeshShape shape;
    shape.pp = 2;
    (sharded ? shape.shard : shape.replicate) = dp;
    auto mesh = std::make_shared<sharding::DeviceMesh>(world_ptr(), shape);
    GatedStack model = make();
    model->use_gate = mesh->dp_rank() == 0;
    framework::PipelineStrategy strategy(stack_model(model, kLayers, kH), mesh, c);
    const auto& mine = batches[static_cast<size_t>(mesh->dp_rank())];
    strategy.train(
        mine, [&](int micro, const at::Tensor& y) { return loss_of(y, mine[micro]); },
        [](const at::Tensor& l) { return l; });
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(1.0));
    sgd.step();
    strategy.share(nullptr);  // every stage's whole parameters on every rank
    const auto want = ref->named_parameters();
    int gates = 0;
    for (const auto& kv : model->named_parameters()) {
      EXPECT_TRUE(at::allclose(kv.value(), want[kv.key()], 1e-5, 1e-6)) << kv.key();
      gates += kv.key().find("gate") != std::string::npos ? 1 : 0;
    }
    EXPECT_EQ(gates, kLayers);
  }
}

// Data-parallel pipelines of DDP's stages (broadcast_buffers, the default) start each step from
// data-parallel rank 0's buffers, as DDP accumulating over micro-batches does: after two steps
// each rank's buffers are rank 0's after the first step, updated by its own second step's
// micro-batches. (Before, each rank's buffers went their own way.)
TEST_F(Test, DataParallelPipelinesStartEachStepFromRankZerosBuffers) {
  const int w = world().size();
  if (w < 4 || w % 2 != 0) GTEST_SKIP() << "needs pp 2 x a data-parallel group of 2 or more";
  constexpr int64_t kH = 8, kM = 2, kLayers = 4;
  const int dp = w / 2;
  auto make = [&] {
    at::manual_seed(17);
    return BufferedStack(kLayers, kH);
  };
  // Step s of data-parallel rank d: batches[s * dp + d].
  const auto batches = stack_batches(static_cast<size_t>(2 * dp), kM, kH, 41);
  auto batch_of = [&](int s, int d) { return batches[static_cast<size_t>(s * dp + d)]; };
  framework::RunConfig c;
  c.parallel.pp = 2;
  c.parallel.strategy = framework::ParallelStrategy::kDdp;
  c.parallel.pp_schedule = ScheduleKind::k1F1B;
  c.train.micro_batches = kM;
  sharding::MeshShape shape;
  shape.pp = 2;
  shape.replicate = dp;
  auto mesh = std::make_shared<sharding::DeviceMesh>(world_ptr(), shape);
  const int d = mesh->dp_rank();
  // One process: rank 0's first step, then this rank's second.
  BufferedStack ref = make();
  for (int s = 0; s < 2; ++s) {
    for (const auto& b : batch_of(s, s == 0 ? 0 : d)) ref->forward(b.inputs, 0, kLayers);
  }
  BufferedStack model = make();
  framework::PipelineStrategy strategy(stack_model(model, kLayers, kH), mesh, c);
  for (int s = 0; s < 2; ++s) {
    const auto mine = batch_of(s, d);
    strategy.train(
        mine,
        [&](int micro, const at::Tensor& y) { return (y - mine[micro].targets).pow(2).mean(); },
        [](const at::Tensor& l) { return l; });
  }
  strategy.share(nullptr);  // every stage's buffers on every rank of the pipeline
  const auto want = ref->named_buffers();
  int equal = 0;
  for (const auto& kv : model->named_buffers()) {
    EXPECT_TRUE(at::equal(kv.value(), want[kv.key()]))
        << "data-parallel rank " << d << " " << kv.key();
    equal += at::equal(kv.value(), want[kv.key()]) ? 1 : 0;
  }
  EXPECT_EQ(equal, static_cast<int>(4 * (kLayers + 1)));
}

// Two data-parallel pipelines of DDP's stages reducing in fp16 average as DDP does: divided
// before the sum. Both ranks see the same micro-batches, scaled so that the largest gradient is
// 40000 on each: the average is that gradient within fp16 rounding, where a sum and then a
// division (ReduceOp::kAvg, as before) overflowed the fp16 sum of 80000 to inf.
TEST_F(Test, DataParallelPipelinesAverageFp16GradientsAsDdpDoes) {
  const int w = world().size();
  if (w < 4 || w % 2 != 0) GTEST_SKIP() << "needs pp 2 x a data-parallel group of 2 or more";
  constexpr int64_t kH = 6, kM = 2, kLayers = 4;
  auto make = [&] {
    at::manual_seed(17);
    return GatedStack(kLayers, kH);
  };
  const auto batches = stack_batches(1, kM, kH, 41)[0];  // every data-parallel rank's
  auto loss_of = [&](const at::Tensor& y, const framework::Batch& b) {
    return (y - b.targets).pow(2).mean() / kM;
  };
  GatedStack ref = make();
  for (const auto& b : batches) loss_of(ref->forward(b.inputs, 0, kLayers), b).backward();
  double largest = 0;
  for (const auto& p : ref->parameters()) {
    largest = std::max(largest, p.grad().abs().max().item<double>());
  }
  const double scale = 40000.0 / largest;
  framework::RunConfig c;
  c.parallel.pp = 2;
  c.parallel.strategy = framework::ParallelStrategy::kDdp;
  c.parallel.pp_schedule = ScheduleKind::k1F1B;
  c.precision.mixed.reduce_dtype = at::kHalf;
  c.train.micro_batches = kM;
  sharding::MeshShape shape;
  shape.pp = 2;
  shape.replicate = w / 2;
  auto mesh = std::make_shared<sharding::DeviceMesh>(world_ptr(), shape);
  GatedStack model = make();
  framework::PipelineStrategy strategy(stack_model(model, kLayers, kH), mesh, c);
  strategy.train(
      batches, [&](int micro, const at::Tensor& y) { return loss_of(y, batches[micro]); },
      [scale](const at::Tensor& l) { return l * scale; });
  const auto want = ref->named_parameters();
  int compared = 0;
  for (const auto& kv : model->named_parameters()) {
    const at::Tensor& g = kv.value().grad();
    if (!g.defined()) continue;  // another stage's
    ASSERT_TRUE(at::isfinite(g).all().item<bool>()) << kv.key() << " overflowed";
    const at::Tensor expected = want[kv.key()].grad() * scale;
    EXPECT_LE((g - expected).abs().max().item<double>(), 1e-3 * 40000) << kv.key();
    ++compared;
  }
  EXPECT_GT(compared, 0);
}

// A zero-bubble list that lost a weight half is refused when the run ends, on the rank whose
// stage's gradients it would have left short.
TEST_F(Test, ARunThatDropsAWeightHalfIsRefused) {
  const int p = world().size(), me = world().rank();
  Schedule s = make_schedule(ScheduleKind::kZeroBubble, p, 2);
  auto& mine = s.actions[static_cast<size_t>(me)];
  mine.erase(std::find(mine.begin(), mine.end(), Action{Op::kBackwardWeight, me, 1}));
  LlamaForCausalLM model = make_model(at::kFloat);
  Pipeline pipe(s, world_ptr());
  const auto ranges = split_layers(kLayers, p);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
  Pipeline::Step step;
  step.forward = [&](int stage, int, const at::Tensor& x) {
    return model->forward_stage(x, ranges[stage].first, ranges[stage].second);
  };
  step.loss = [&](int, const at::Tensor& logits) {
    return loss_of(logits, at::randint(kVocab, {kMicro, kSeq}, gen), 2);
  };
  step.inputs = {at::randint(kVocab, {kMicro, kSeq}, gen),
                 at::randint(kVocab, {kMicro, kSeq}, gen)};
  step.activation_shape = {kMicro, kSeq, 32};
  try {
    pipe.run(step);
    ADD_FAILURE() << "a run without W " << me << ".1 was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("1 backward(s) ran without their weight half, the first "
                                         "of stage " +
                                         std::to_string(me) + " micro-batch 1"),
              std::string::npos)
        << e.what();
  }
}

// A GradScaler's found-inf flag: one stage's inf makes every stage skip.
TEST_F(Test, AnyStagesFoundInfIsEveryStages) {
  Pipeline pipe(make_schedule(ScheduleKind::k1F1B, world().size(), 2), world_ptr());
  for (int culprit = 0; culprit < world().size(); ++culprit) {
    const at::Tensor mine = at::full({}, world().rank() == culprit ? 1.0f : 0.0f);
    EXPECT_EQ(pipe.any_found_inf(mine).item<float>(), 1.0f);
  }
  EXPECT_EQ(pipe.any_found_inf(at::zeros({})).item<float>(), 0.0f);
}

// A bf16 model: activations and gradients cross the ranks in bf16, losing nothing.
TEST_F(Test, Bf16ActivationsGiveOneProcessGradients) {
  run_case({ScheduleKind::k1F1B, 4, 1, at::kBFloat16});
  run_case({ScheduleKind::kInterleaved1F1B, 2 * world().size(), 2, at::kBFloat16});
  run_case({ScheduleKind::kZeroBubble, 4, 1, at::kBFloat16});
}

}  // namespace
}  // namespace dtrain::sharding::pp

int main(int argc, char** argv) { return dtrain::testing::multirank_main(argc, argv); }
