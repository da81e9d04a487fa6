// framework::train's two entries compute the same run: the config's MLP through
// train(config) and the same MLP, data and loss handed in through train(module, data, loss,
// config) give bitwise the same losses (one process, so the numbers come from the loop alone).
// With fp16 and the scaler, and with gradient accumulation, clipping and a validation pass.
#include "framework/trainer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "framework/data.h"
#include "framework/models/mlp.h"

namespace dtrain::framework {
namespace {

RunConfig config_with(const std::string& type, const std::vector<std::string>& overrides) {
  std::vector<std::string> all = {"model.type=" + type};
  all.insert(all.end(), overrides.begin(), overrides.end());
  return parse_config(
      "model:\n  type: mlp\n  in_features: 16\n  hidden: 32\n  depth: 2\n  out_features: 4\n"
      "train:\n  steps: 6\n  batch_size: 8\n  lr: 0.01\n  clip_grad_norm: 0.5\n"
      "  eval_every: 3\n  eval_samples: 8\n"
      "parallel:\n  strategy: none\n"
      "logging:\n  every_steps: 1\n  progress_bar: false\n",
      "trainer_test.yaml", all);
}

TrainResult custom_run(const RunConfig& c) {
  at::manual_seed(static_cast<uint64_t>(c.train.seed));  // what train(config) does
  MLP mlp(MLPOptions()
              .in_features(c.model.in_features)
              .hidden(c.model.hidden)
              .depth(c.model.depth)
              .out_features(c.model.out_features));
  auto data = std::make_unique<SyntheticClassificationSource>(
      c.model.in_features, c.model.out_features, c.train.batch_size / c.train.micro_batches, 0,
      static_cast<uint64_t>(c.data.seed));
  return train(mlp, std::move(data), cross_entropy, c, nullptr, "MLP");
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

}  // namespace
}  // namespace dtrain::framework
