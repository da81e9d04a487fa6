// framework::train's two entries compute the same run: the config's MLP through
// train(config) and the same MLP, data and loss handed in through train(module, data, loss,
// config) give bitwise the same losses (one process, so the numbers come from the loop alone).
// With fp16 and the scaler, and with gradient accumulation, clipping and a validation pass.
// Trainer::train_step, driven by hand, takes the same steps as train(). A step reads nothing
// back to the host (counted with ATen's observers). The config becomes
// DDP and FSDP options in one place (ddp_options, fsdp_options), and the metrics file's JSON
// escapes what it is given. Validation runs a user's module in eval mode.
#include "framework/trainer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <regex>
#include <string>
#include <vector>

#include "core/error.h"
#include "framework/data.h"
#include "framework/metrics.h"
#include "framework/models/builtin.h"
#include "framework/models/mlp.h"
#include "framework/strategy.h"
#include "tests/host_reads.h"

namespace dtrain::framework {
namespace {

const bool kRegistered = (register_builtin_models(), true);

// The MLP both entries train: model.type mlp's section, and the custom run's module.
const MLPOptions kMlp = MLPOptions().in_features(16).hidden(32).depth(2).out_features(4);

RunConfig config_with(const std::string& type, const std::vector<std::string>& overrides) {
  const std::string model =
      type == "mlp" ? "model:\n  type: mlp\n  in_features: 16\n  hidden: 32\n  depth: 2\n"
                      "  out_features: 4\n"
                    : "model:\n  type: " + type + "\n";
  return parse_config(model +
                          "train:\n  steps: 6\n  batch_size: 8\n  lr: 0.01\n  clip_grad_norm: 0.5\n"
                          "  eval_every: 3\n  eval_samples: 8\n"
                          "parallel:\n  strategy: none\n"
                          "logging:\n  every_steps: 1\n  progress_bar: false\n",
                      "trainer_test.yaml", overrides);
}

MLP seeded_mlp(const RunConfig& c) {
  at::manual_seed(static_cast<uint64_t>(c.train.seed));  // what train(config) does
  return MLP(kMlp);
}

std::unique_ptr<BatchSource> data_for(const RunConfig& c) {
  return std::make_unique<SyntheticClassificationSource>(kMlp.in_features(), kMlp.out_features(),
                                                         c.train.batch_size / c.train.micro_batches,
                                                         0, static_cast<uint64_t>(c.data.seed));
}

TrainResult custom_run(const RunConfig& c) {
  MLP mlp = seeded_mlp(c);
  return train(mlp, data_for(c), cross_entropy, c, nullptr, "MLP");
}

void expect_same_run(const std::vector<std::string>& overrides) {
  const TrainResult a = train(config_with("mlp", overrides), nullptr);
  const TrainResult b = custom_run(config_with("custom", overrides));
  EXPECT_EQ(a.steps, 6);
  EXPECT_EQ(a.steps, b.steps);
  EXPECT_EQ(a.first_loss, b.first_loss);  // bitwise
  EXPECT_EQ(a.last_loss, b.last_loss);
  EXPECT_EQ(a.skipped_steps, b.skipped_steps);
  EXPECT_EQ(a.final_scale, b.final_scale);
  EXPECT_LT(a.last_loss, a.first_loss) << "the run trained";
}

TEST(Trainer, UsersModelThroughTheApiMatchesTheConfigsModelFp32) { expect_same_run({}); }

TEST(Trainer, UsersModelThroughTheApiMatchesTheConfigsModelFp16AccumulatingWithScaler) {
  expect_same_run({"precision.policy=fp16", "precision.scaler.enabled=true",
                   "precision.scaler.init_scale=256", "train.micro_batches=2"});
}

// A user's module with BatchNorm and Dropout: validation runs it in eval mode, as a PyTorch
// recipe does, so it neither moves the running statistics nor draws dropout masks. A run that
// validates at steps 3 and 6 trains bitwise as one that never validates, and ends with the same
// statistics. (In train mode, the validation at step 3 drew from the generator that steps 4-6
// take their masks from, and the one at step 6 moved the statistics.)
struct NormDropNetImpl : torch::nn::Module {
  NormDropNetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(16, 32))),
        bn(register_module("bn", torch::nn::BatchNorm1d(32))),
        drop(register_module("drop", torch::nn::Dropout(0.5))),
        fc2(register_module("fc2", torch::nn::Linear(32, 4))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2(drop(at::relu(bn(fc1(x))))); }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn;
  torch::nn::Dropout drop;
  torch::nn::Linear fc2;
};
TORCH_MODULE(NormDropNet);

TEST(Trainer, ValidationRunsTheModelInEvalMode) {
  auto run = [](int64_t eval_every) {
    const RunConfig c = config_with("custom", {"train.eval_every=" + std::to_string(eval_every)});
    at::manual_seed(static_cast<uint64_t>(c.train.seed));
    NormDropNet net;
    const TrainResult r = train(net, data_for(c), cross_entropy, c, nullptr, "NormDropNet");
    EXPECT_TRUE(net->is_training()) << "validation leaves the model in training mode";
    return std::make_pair(r, net->bn->running_mean.clone());
  };
  const auto [validated, validated_mean] = run(3);
  const auto [plain, plain_mean] = run(0);
  EXPECT_EQ(validated.steps, 6);
  EXPECT_EQ(validated.last_loss, plain.last_loss);  // bitwise
  EXPECT_TRUE(at::equal(validated_mean, plain_mean));
  EXPECT_FALSE(at::equal(plain_mean, at::zeros_like(plain_mean))) << "the statistics moved";
}

TEST(Trainer, EachEntryRefusesTheOthersModelType) {
  try {
    train(config_with("custom", {}), nullptr);
    FAIL() << "dtrain-train's entry accepted model.type custom";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("framework::train(module, data, loss, config, comm)"),
              std::string::npos)
        << e.what();
  }
  try {
    custom_run(config_with("mlp", {}));
    FAIL() << "the module entry accepted model.type mlp";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("set model.type: custom"), std::string::npos) << e.what();
  }
}

TEST(Trainer, TrainStepByHandTakesTheStepsTrainTakes) {
  const RunConfig c = config_with("custom", {"train.eval_every=0"});
  MLP mlp = seeded_mlp(c);
  Task task;
  task.make_strategy = [&](amp::NumericsMonitor* monitor) {
    return make_strategy(mlp, nullptr, c, monitor);
  };
  task.loss = cross_entropy;
  Trainer trainer(c, nullptr, std::move(task), data_for(c));
  trainer.setup();
  std::vector<double> losses;
  for (int64_t i = 0; i < c.train.steps; ++i) {
    const StepStats s = trainer.train_step();
    EXPECT_EQ(s.step, i + 1);
    EXPECT_TRUE(s.stepped);
    EXPECT_GT(s.grad_norm, 0);
    losses.push_back(s.loss);
  }
  EXPECT_EQ(trainer.steps_done(), c.train.steps);
  const TrainResult whole = custom_run(c);
  // train() logs every step (logging.every_steps: 1), each loss alone.
  EXPECT_EQ(losses.front(), whole.first_loss);  // bitwise
  EXPECT_EQ(losses.back(), whole.last_loss);
  EXPECT_LT(losses.back(), losses.front());
}

// Nothing in a step reads a value back to the host or copies blocking between host and
// device (on a GPU each waits for the stream): a run of 9 steps waits no more often than a run
// of 4 that logs, validates and reports as often. fp32, bf16 without clipping, fp16 with the
// scaler and accumulation, and SGD; DTRAIN_TEST_DEVICE=cuda runs it on a GPU. The same count
// sees a loss function's own item() in every step.
TEST(Trainer, AStepReadsNothingBackToTheHost) {
  auto reads = [](const std::string& type, std::vector<std::string> overrides, int64_t steps,
                  LossFn loss) {
    overrides.insert(overrides.end(), {"train.steps=" + std::to_string(steps), "train.eval_every=0",
                                       "logging.every_steps=1000"});
    // scripts/gpu-check runs it on the GPU, where each read or blocking copy stalls the stream.
    const char* device = std::getenv("DTRAIN_TEST_DEVICE");
    if (device != nullptr && std::string(device) == "cuda") overrides.push_back("device=cuda");
    const RunConfig c = config_with(type, overrides);
    testing::HostReads counter;
    const TrainResult r =
        type == "custom" ? train(seeded_mlp(c), data_for(c), loss, c, nullptr) : train(c, nullptr);
    EXPECT_EQ(r.steps, steps);
    EXPECT_LT(r.last_loss, r.first_loss);
    return counter.reads();
  };
  for (const auto& o : std::vector<std::vector<std::string>>{
           {},
           {"precision.policy=bf16", "train.clip_grad_norm=0"},
           {"precision.policy=fp16", "precision.scaler.enabled=true",
            "precision.scaler.init_scale=1024",  // no skip: a skipped step is read at once
            "train.micro_batches=2"},
           {"train.optimizer=sgd", "train.momentum=0.9"}}) {
    SCOPED_TRACE(o.empty() ? "fp32" : o.front());
    EXPECT_EQ(reads("mlp", o, 9, nullptr), reads("mlp", o, 4, nullptr));
  }
  const LossFn reading = [](const at::Tensor& out, const Batch& b) {
    at::Tensor loss = cross_entropy(out, b);
    EXPECT_TRUE(std::isfinite(loss.item<double>()));
    return loss;
  };
  // At least one per step (on a GPU the read is also a synchronizing CUDA call: two).
  EXPECT_GE(reads("custom", {}, 9, reading) - reads("custom", {}, 4, reading), 5);
}

TEST(Strategy, TheConfigBecomesDdpAndFsdpOptionsInOnePlace) {
  const RunConfig c = config_with(
      "mlp",
      {"precision.policy=bf16", "parallel.bucket_cap_mb=3", "parallel.find_unused_parameters=true",
       "parallel.broadcast_buffers=false", "parallel.sharding_strategy=shard_grad_op",
       "parallel.forward_prefetch=true", "parallel.backward_prefetch=false",
       "parallel.limit_all_gathers=5", "parallel.wrap_min_params=7"});
  amp::NumericsMonitor monitor;
  const sharding::DDPOptions d = ddp_options(c, &monitor);
  EXPECT_EQ(d.bucket_cap_mb(), 3.0);
  EXPECT_EQ(d.first_bucket_mb(), 3.0) << "an explicit bucket_cap_mb sizes the first bucket too";
  const sharding::DDPOptions defaults = ddp_options(config_with("mlp", {}), nullptr);
  EXPECT_EQ(defaults.bucket_cap_mb(), 25.0);
  EXPECT_EQ(defaults.first_bucket_mb(), 1.0) << "PyTorch's defaults: 25 MB, the first 1 MB";
  EXPECT_TRUE(d.find_unused_parameters());
  EXPECT_FALSE(d.broadcast_buffers());
  EXPECT_EQ(d.reduce_dtype(), c.precision.mixed.effective_reduce_dtype());
  EXPECT_EQ(d.monitor(), &monitor);
  const sharding::FSDPOptions f = fsdp_options(c, &monitor);
  EXPECT_EQ(f.sharding_strategy(), sharding::ShardingStrategy::kShardGradOp);
  EXPECT_EQ(f.mixed_precision().param_dtype, at::kBFloat16);
  EXPECT_TRUE(f.forward_prefetch());
  EXPECT_FALSE(f.backward_prefetch());
  EXPECT_EQ(f.limit_all_gathers(), 5);
  EXPECT_EQ(f.auto_wrap().min_params(), 7);
  EXPECT_EQ(f.monitor(), &monitor);
  // One process: the plain module, whatever the strategy says.
  auto plain = make_strategy(seeded_mlp(c), nullptr, c, &monitor);
  EXPECT_EQ(plain->fsdp(), nullptr);
  EXPECT_EQ(plain->stats(), nullptr);
  EXPECT_TRUE(plain->uses_autocast());
}

TEST(Metrics, JsonObjectEscapesAndWritesNonFiniteNumbersAsNull) {
  const std::string text = JsonObject()
                               .string("config", "a \"b\"\\c\n.yaml")
                               .integer("step", 3)
                               .number("loss", std::numeric_limits<double>::quiet_NaN())
                               .number("lr", 0.5, "%.6g")
                               .boolean("restored", true)
                               .object("run", JsonObject().string("k\"", "v"))
                               .text();
  EXPECT_EQ(text,
            "{\"config\":\"a \\\"b\\\"\\\\c\\u000a.yaml\",\"step\":3,\"loss\":null,"
            "\"lr\":0.5,\"restored\":true,\"run\":{\"k\\\"\":\"v\"}}");
}

TEST(Metrics, AResumedRunKeepsTheRowsUpToItsStep) {
  const std::string path = ::testing::TempDir() + "/metrics_resume.jsonl";
  RunConfig c = config_with("mlp", {"logging.metrics_file=" + path});
  {
    MetricsFile m(c, 0, 0, JsonObject().string("config", "first"));
    for (int64_t s = 1; s <= 4; ++s) m.write(JsonObject().integer("step", s));
  }
  {
    MetricsFile m(c, 0, 2, JsonObject().string("config", "resumed"));
    m.write(JsonObject().integer("step", 3));
    MetricsFile other_rank(c, 1, 2, JsonObject().string("config", "rank 1"));  // writes nothing
    other_rank.write(JsonObject().integer("step", 99));
  }
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  EXPECT_EQ(lines, (std::vector<std::string>{"{\"run\":{\"config\":\"resumed\"}}", "{\"step\":1}",
                                             "{\"step\":2}", "{\"step\":3}"}));
  std::remove(path.c_str());
}

// Each validation row's perplexity is exp(val_loss) for the language model, and a classifier
// reports none.
TEST(Metrics, ValidationRowsOfALanguageModelCarryItsPerplexity) {
  for (const std::string type : {"transformer", "mlp"}) {
    SCOPED_TRACE(type);
    const std::string path = ::testing::TempDir() + "/metrics_ppl_" + type + ".jsonl";
    std::vector<std::string> o = {"logging.metrics_file=" + path, "train.steps=4",
                                  "train.eval_every=2"};
    if (type == "transformer") {
      for (const char* k : {"model.vocab_size=256", "model.seq_len=16", "model.d_model=16",
                            "model.n_layers=1", "model.n_heads=2", "model.d_ff=32"}) {
        o.push_back(k);
      }
    }
    RunConfig c = config_with(type, o);
    train(c, nullptr);
    std::ifstream in(path);
    const std::regex val("\"val_loss\":([-0-9.e+]+)"), ppl("\"val_ppl\":([-0-9.e+]+)");
    int rows = 0;
    for (std::string line; std::getline(in, line);) {
      std::smatch v, p;
      if (!std::regex_search(line, v, val)) continue;
      ++rows;
      if (type == "mlp") {
        EXPECT_FALSE(std::regex_search(line, p, ppl)) << line;
        continue;
      }
      ASSERT_TRUE(std::regex_search(line, p, ppl)) << line;
      const double want = std::exp(std::stod(v[1].str()));
      EXPECT_NEAR(std::stod(p[1].str()), want, 1e-5 * want) << line;
    }
    EXPECT_EQ(rows, 2);  // steps 2 and 4
    std::remove(path.c_str());
  }
}

}  // namespace
}  // namespace dtrain::framework
