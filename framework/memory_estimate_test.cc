#include "framework/memory_estimate.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <cstdio>

#include "core/error.h"
#include "framework/memory.h"
#include "framework/models/configs.h"
#include "framework/models/llama.h"
#include "framework/models/transformer_lm.h"

namespace dtrain::framework {
namespace {

const bool kRegistered = (register_builtin_model_configs(), true);

RunConfig lm_config(const std::string& strategy, int64_t d_model, int64_t layers) {
  std::string yaml = "model:\n  type: transformer\n  d_model: " + std::to_string(d_model) +
                     "\n  n_layers: " + std::to_string(layers) +
                     "\n  n_heads: 8\n  d_ff: " + std::to_string(4 * d_model) +
                     "\n  seq_len: 64\ntrain:\n  steps: 1\n  batch_size: 4\n  lr: 1.0e-3\n"
                     "parallel:\n  strategy: " +
                     strategy + "\n";
  return parse_config(yaml, "run.yaml");
}

// A small Llama (4 layers; 4 micro-batches of 2 samples) in fp32, with `sets` as --set gives
// them.
RunConfig small_llama(const std::vector<std::string>& sets) {
  return parse_config(
      "model:\n  type: llama\n  vocab_size: 256\n  hidden_size: 128\n"
      "  intermediate_size: 352\n  num_hidden_layers: 4\n  num_attention_heads: 8\n"
      "  num_key_value_heads: 4\n  seq_len: 64\n  tie_word_embeddings: false\ntrain:\n"
      "  steps: 1\n  batch_size: 8\n  micro_batches: 4\n  lr: 1.0e-3\nprecision:\n"
      "  policy: fp32\n",
      "run.yaml", sets);
}

TEST(MemoryEstimate, FsdpShardsParametersGradientsAndOptimizerStateOverTheRanks) {
  const RunConfig ddp = lm_config("ddp", 512, 6), fsdp = lm_config("fsdp", 512, 6);
  const MemoryEstimate a = estimate_memory(ddp, 4), b = estimate_memory(fsdp, 4);
  const double p = static_cast<double>(a.parameter_count);
  EXPECT_DOUBLE_EQ(a.steady(), 16 * p);      // fp32 params + grads + AdamW's two moments
  EXPECT_DOUBLE_EQ(b.steady(), 16 * p / 4);  // ... over four ranks
  EXPECT_LT(b.peak(), a.peak());
  // Stepped in backward, a rank holds two units' gradient shards (of the seven), not them all.
  RunConfig in_backward = fsdp;
  in_backward.train.optimizer_in_backward = true;
  const MemoryEstimate c = estimate_memory(in_backward, 4);
  EXPECT_DOUBLE_EQ(c.parameters + c.optimizer, 12 * p / 4);
  EXPECT_GT(c.gradients, 0);
  EXPECT_LT(c.gradients, b.gradients / 2);
  EXPECT_EQ(a.parameter_count,
            transformer_lm_parameter_count(
                TransformerLMOptions().d_model(512).n_layers(6).d_ff(2048).n_heads(8).seq_len(64)));
}

// The activation term, set against what one process's step really holds (tracked tensor
// bytes above the steady state, gradients kept allocated).
// Recomputed blocks (model.recompute) too: every block, and every 2nd, at 2 and 6 layers.
double measured_activations(int64_t layers, int64_t recompute_every);

TEST(MemoryEstimate, ActivationsAreWithinATenthOfAMeasuredStep) {
  TrackedCpuMemory::install();
  double plain6 = 0, full6 = 0;
  for (int64_t layers : {2, 6}) {
    for (int64_t every : {0, 1, 2}) {
      SCOPED_TRACE("layers " + std::to_string(layers) + " recompute_every " +
                   std::to_string(every));
      RunConfig c = lm_config("none", 128, layers);
      c.model.as<TransformerLMSettings>().recompute_every = every;
      const double measured = measured_activations(layers, every);
      const double estimated = estimate_memory(c, 1).activations;
      std::printf(
          "transformer, %lld layers, recompute_every %lld: activations estimated %.0f B, "
          "measured %.0f B (%.3f)\n",
          static_cast<long long>(layers), static_cast<long long>(every), estimated, measured,
          estimated / measured);
      EXPECT_NEAR(estimated / measured, 1.0, 0.1)
          << "estimated " << estimated << " B, measured " << measured << " B";
      if (layers == 6 && every == 0) plain6 = measured;
      if (layers == 6 && every == 1) full6 = measured;
    }
  }
  // Six blocks recomputed hold less than half the activations of six kept.
  EXPECT_LT(full6, 0.5 * plain6);
}

// Tracked tensor bytes above the steady state during one fp32 step of `m` (tokens [4, 64] of
// a 256-token vocabulary; gradients kept allocated), measured on the second step.
template <typename M>
double measured_step(M& m) {
  torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(1e-3));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  double measured = 0;
  for (int step = 0; step < 2; ++step) {
    at::Tensor x = at::randint(0, 256, {4, 64}, gen), y = at::randint(0, 256, {4, 64}, gen);
    opt.zero_grad(/*set_to_none=*/false);
    const int64_t steady = TrackedCpuMemory::current_bytes();
    TrackedCpuMemory::reset_peak();
    at::cross_entropy_loss(m->forward(x).reshape({-1, 256}), y.reshape(-1)).backward();
    opt.step();
    measured = static_cast<double>(TrackedCpuMemory::peak_bytes() - steady);
  }
  return measured;
}

double measured_activations(int64_t layers, int64_t recompute_every) {
  at::manual_seed(0);
  TransformerLM m(TransformerLMOptions()
                      .d_model(128)
                      .n_layers(layers)
                      .n_heads(8)
                      .d_ff(512)
                      .seq_len(64)
                      .recompute_every(recompute_every));
  return measured_step(m);
}

// The Llama's activation formula (its registration) against a measured fp32 step, and its
// parameter count against the built model's.
TEST(MemoryEstimate, LlamaActivationsAreWithinATenthOfAMeasuredStep) {
  TrackedCpuMemory::install();
  for (int64_t kv : {4, 2}) {
    SCOPED_TRACE("num_key_value_heads " + std::to_string(kv));
    const RunConfig c = parse_config(
        "model:\n  type: llama\n  vocab_size: 256\n  hidden_size: 128\n"
        "  intermediate_size: 352\n  num_hidden_layers: 3\n  num_attention_heads: 8\n"
        "  num_key_value_heads: " +
            std::to_string(kv) +
            "\n  seq_len: 64\ntrain:\n  steps: 1\n  batch_size: 4\n  lr: 1.0e-3\n"
            "parallel:\n  strategy: none\nprecision:\n  policy: fp32\n",
        "run.yaml");
    at::manual_seed(0);
    LlamaOptions o = c.model.as<LlamaSettings>().options;
    o.deferred_init(false);
    LlamaForCausalLM m(o);
    int64_t n = 0;
    for (const auto& p : m->parameters()) n += p.numel();
    EXPECT_EQ(estimate_memory(c, 1).parameter_count, n);
    const double measured = measured_step(m);
    const double estimated = estimate_memory(c, 1).activations;
    std::printf("llama, %lld K/V heads: activations estimated %.0f B, measured %.0f B (%.3f)\n",
                static_cast<long long>(kv), estimated, measured, estimated / measured);
    EXPECT_NEAR(estimated / measured, 1.0, 0.1)
        << "estimated " << estimated << " B, measured " << measured << " B";
  }
}

// checkpoint.async's staging copy: a rank's shards when FSDP saves sharded; the whole model and
// optimizer state on rank 0 when the checkpoint is full, which a TP run's is unless sharded is
// asked for (gathered from every tp rank's slices: not 1/tp of it).
TEST(MemoryEstimate, AsyncStagingUnderTensorParallelismHoldsTheWholeModel) {
  auto config = [](int tp, const char* format = "auto") {
    return parse_config(
        "model:\n  type: llama\n  vocab_size: 256\n  hidden_size: 128\n"
        "  intermediate_size: 352\n  num_hidden_layers: 3\n  num_attention_heads: 8\n"
        "  num_key_value_heads: 4\n  seq_len: 64\ntrain:\n  steps: 1\n  batch_size: 4\n"
        "  lr: 1.0e-3\nparallel:\n  strategy: fsdp\n  tp: " +
            std::to_string(tp) +
            "\nprecision:\n  policy: fp32\ncheckpoint:\n  dir: /tmp/ckpt\n  async: true\n"
            "  format: " +
            format + "\n",
        "run.yaml");
  };
  const MemoryEstimate sharded = estimate_memory(config(1), 4);
  const MemoryEstimate tp = estimate_memory(config(2), 4);
  const double p = static_cast<double>(tp.parameter_count);
  EXPECT_DOUBLE_EQ(sharded.checkpoint_staging, sharded.parameters + sharded.optimizer);
  EXPECT_DOUBLE_EQ(sharded.checkpoint_staging, 12 * p / 4);  // fp32 + AdamW's two moments
  EXPECT_DOUBLE_EQ(tp.checkpoint_staging, 12 * p);
  EXPECT_DOUBLE_EQ(tp.parameters, 4 * p / 4);  // while each rank holds 1/(tp x shard)
  const MemoryEstimate tp_sharded = estimate_memory(config(2, "sharded"), 4);
  EXPECT_DOUBLE_EQ(tp_sharded.checkpoint_staging, 12 * p / 4);  // its shards of its slices
}

// Under a pipeline each rank holds its stages' parameters (together the whole model, once) and
// the activations of as many micro-batches as its schedule keeps: 1f1b's first rank pp of them,
// gpipe's every rank all of them; the report lists every pipeline rank.
TEST(MemoryEstimate, PipelineRanksHoldTheirStagesAndTheirSchedulesMicroBatches) {
  auto config = [](int pp, const std::string& schedule) {
    return small_llama({"parallel.pp=" + std::to_string(pp), "parallel.pp_schedule=" + schedule});
  };
  const RunConfig c = config(2, "1f1b");
  const std::vector<StageEstimate> ranks = estimate_pipeline_ranks(c, 2);
  ASSERT_EQ(ranks.size(), 2u);
  const double p = static_cast<double>(ranks[0].memory.parameter_count);
  EXPECT_DOUBLE_EQ(ranks[0].memory.parameters + ranks[1].memory.parameters, 4 * p);
  EXPECT_EQ(ranks[0].in_flight, 2);
  EXPECT_EQ(ranks[1].in_flight, 1);
  EXPECT_EQ(ranks[0].holds, "stage 0 (the embedding, layers 0-1)");
  EXPECT_EQ(ranks[1].holds, "stage 1 (layers 2-3, the head)");
  const auto gpipe = estimate_pipeline_ranks(config(2, "gpipe"), 2);
  EXPECT_EQ(gpipe[0].in_flight, 4);
  EXPECT_DOUBLE_EQ(gpipe[0].memory.activations, 2 * ranks[0].memory.activations);
  // The estimate is the largest rank's; one process holds more than either.
  const MemoryEstimate largest = estimate_memory(c, 2);
  EXPECT_DOUBLE_EQ(largest.peak(), std::max(ranks[0].memory.peak(), ranks[1].memory.peak()));
  EXPECT_LT(largest.steady(), estimate_memory(config(1, "1f1b"), 1).steady());
  const std::string report = estimate_report(c, 2, 2, -1);
  EXPECT_NE(report.find("pp rank 1: stage 1 (layers 2-3, the head)"), std::string::npos) << report;
  EXPECT_NE(report.find("(2 micro-batch(es) held at once)"), std::string::npos) << report;
}

// A Llama's recomputed layers keep their inputs alone: the activations fall to about one
// layer's, and the report names the other choice's figure.
TEST(MemoryEstimate, LlamaRecomputeKeepsOneLayersActivations) {
  auto config = [](const std::string& recompute) {
    return small_llama({"model.num_hidden_layers=8", "model.recompute=" + recompute});
  };
  const MemoryEstimate none = estimate_memory(config("none"), 1);
  const MemoryEstimate full = estimate_memory(config("full"), 1);
  EXPECT_LT(full.activations, none.activations / 3);
  const std::string report = estimate_report(config("full"), 1, 1, -1);
  EXPECT_NE(report.find("without recompute " + format_bytes(none.activations)), std::string::npos)
      << report;
}

// Sharded stages (strategy fsdp, pp 2 x 2 data-parallel ranks): the masters and the optimizer
// state halve against DDP's stages; the step holds the gathered stage and its whole gradients.
TEST(MemoryEstimate, ShardedPipelineStagesHoldTheirShardsBetweenSteps) {
  auto config = [](const std::string& strategy) {
    return small_llama({"parallel.strategy=" + strategy, "parallel.pp=2"});
  };
  const auto ddp = estimate_pipeline_ranks(config("ddp"), 4);
  const auto fsdp = estimate_pipeline_ranks(config("fsdp"), 4);
  ASSERT_EQ(fsdp.size(), 2u);
  for (size_t r = 0; r < 2; ++r) {
    const MemoryEstimate &d = ddp[r].memory, &f = fsdp[r].memory;
    EXPECT_DOUBLE_EQ(f.parameters, d.parameters / 2);
    EXPECT_DOUBLE_EQ(f.optimizer, d.optimizer / 2);
    EXPECT_DOUBLE_EQ(f.gradients, d.gradients);
    EXPECT_DOUBLE_EQ(f.compute, d.parameters);  // the stage gathered whole, in fp32
    EXPECT_LT(f.steady(), d.steady());
  }
}

// --estimate's report: every term, recompute's effect, and the deepest model that fits, which
// does fit while one layer more does not.
TEST(MemoryEstimate, TheReportNamesEveryTermAndTheDeepestModelThatFits) {
  const RunConfig c = lm_config("fsdp", 512, 6);
  const int64_t available = int64_t{4} << 30;
  const std::string report = estimate_report(c, 2, 2, available);
  for (const char* needle :
       {"memory estimate for run.yaml: model.type transformer", "strategy fsdp full_shard",
        "2 rank(s), 2 on this node", "parameters (fp32 masters)", "gradients", "optimizer state",
        "gathered units, low-precision copies", "activations", "with model.recompute: full",
        "buffers", "construction peak", "peak", "of 4.00 GiB available: fits",
        "deepest of this width that fits: model.n_layers "}) {
    EXPECT_NE(report.find(needle), std::string::npos) << needle << " in\n" << report;
  }
  const int64_t deepest = deepest_that_fits(c, 2, 2, available);
  ASSERT_GT(deepest, 6);
  EXPECT_NE(report.find("model.n_layers " + std::to_string(deepest) + " ("), std::string::npos);
  RunConfig at = c, over = c;
  at.model.as<TransformerLMSettings>().n_layers = deepest;
  over.model.as<TransformerLMSettings>().n_layers = deepest + 1;
  EXPECT_LE(estimate_memory(at, 2).peak() * 2, 0.9 * static_cast<double>(available));
  EXPECT_GT(estimate_memory(over, 2).peak() * 2, 0.9 * static_cast<double>(available));
  // Recompute lets a deeper model fit in the same memory.
  RunConfig r = c;
  r.model.as<TransformerLMSettings>().recompute_every = 1;
  EXPECT_GT(deepest_that_fits(r, 2, 2, available), deepest);
  EXPECT_NE(estimate_report(r, 2, 2, available).find("without recompute"), std::string::npos);
  EXPECT_NE(estimate_report(c, 2, 2, 1 << 20).find("does NOT fit"), std::string::npos);
  EXPECT_NE(estimate_report(c, 2, 2, 1 << 20).find("no depth of this width fits"),
            std::string::npos);
}

TEST(MemoryEstimate, GuardRefusesARunThatCannotFitNamingTheEstimateAndFsdp) {
  // ~0.6B parameters: DDP needs ~10 GiB per rank, two ranks on a 16 GiB machine do not fit;
  // FSDP needs ~6 GiB per rank.
  const RunConfig ddp = lm_config("ddp", 2048, 12);
  const int64_t available = int64_t{16} << 30;
  try {
    check_memory_fits(ddp, 2, 2, available);
    FAIL() << "no ConfigError";
  } catch (const ConfigError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("GiB per rank"), std::string::npos) << what;
    EXPECT_NE(what.find("parallel.strategy: fsdp"), std::string::npos) << what;
    EXPECT_NE(what.find("out-of-memory"), std::string::npos) << what;
  }
  // Sharded over the same two ranks it fits.
  EXPECT_NO_THROW(check_memory_fits(lm_config("fsdp", 2048, 12), 2, 2, available));
  EXPECT_NO_THROW(check_memory_fits(ddp, 2, 2, -1)) << "unknown memory: no check";
}

}  // namespace
}  // namespace dtrain::framework
