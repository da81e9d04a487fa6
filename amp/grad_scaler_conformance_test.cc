// Replays tests/fixtures/grad_scaler_fixtures.json (recorded from torch.amp.GradScaler by
// tests/fixtures/gen_grad_scaler_fixtures.py) and requires exact equality of scale and
// growth tracker and bitwise-equal parameters after every step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>

#include "amp/grad_scaler.h"
#include "sharding/clip_grad.h"

namespace dtrain::amp {
namespace {

const char* kFixtures = "tests/fixtures/grad_scaler_fixtures.json";

at::Tensor tensor_of(const YAML::Node& values, std::vector<int64_t> shape) {
  std::vector<float> v;
  for (const auto& x : values) v.push_back(static_cast<float>(x.as<double>()));
  return at::tensor(v, at::kFloat).reshape(shape);
}

double value_of(const std::string& s) {
  if (s == "inf") return std::numeric_limits<double>::infinity();
  if (s == "-inf") return -std::numeric_limits<double>::infinity();
  if (s == "nan") return std::numeric_limits<double>::quiet_NaN();
  return std::stod(s);
}

// Index of the first element whose float32 bits differ, or -1.
int64_t first_bit_difference(const at::Tensor& got, const at::Tensor& want) {
  at::Tensor g = got.contiguous(), w = want.contiguous();
  if (g.numel() != w.numel()) return 0;
  for (int64_t i = 0; i < g.numel(); ++i) {
    if (std::memcmp(g.data_ptr<float>() + i, w.data_ptr<float>() + i, sizeof(float)) != 0) {
      return i;
    }
  }
  return -1;
}

GradScalerOptions options_of(const YAML::Node& s) {
  return GradScalerOptions()
      .init_scale(s["init_scale"].as<double>())
      .growth_factor(s["growth_factor"].as<double>())
      .backoff_factor(s["backoff_factor"].as<double>())
      .growth_interval(s["growth_interval"].as<int64_t>());
}

class Conformance : public ::testing::TestWithParam<int> {
 protected:
  static YAML::Node& fixtures() {
    static YAML::Node root = YAML::LoadFile(kFixtures);
    return root;
  }
};

TEST_P(Conformance, MatchesPyTorchTrajectory) {
  at::set_num_threads(1);  // the generator ran single-threaded: same kernels, same order
  YAML::Node sc = fixtures()["scenarios"][GetParam()];
  SCOPED_TRACE(sc["name"].as<std::string>());
  std::map<std::string, at::Tensor> params;
  for (const auto& kv : sc["params"]) {
    auto shape = kv.second["shape"].as<std::vector<int64_t>>();
    params[kv.first.as<std::string>()] = tensor_of(kv.second["data"], shape).requires_grad_();
  }
  std::vector<std::unique_ptr<torch::optim::SGD>> opts;
  std::vector<at::Tensor> all_params;
  for (const auto& o : sc["optimizers"]) {
    std::vector<at::Tensor> group;
    for (const auto& name : o["params"]) {
      group.push_back(params.at(name.as<std::string>()));
      all_params.push_back(group.back());
    }
    opts.push_back(std::make_unique<torch::optim::SGD>(
        group,
        torch::optim::SGDOptions(o["lr"].as<double>()).momentum(o["momentum"].as<double>())));
  }
  auto scaler = std::make_unique<GradScaler>(options_of(sc["scaler"]));
  const double loss_mult = sc["loss_mult"].as<double>();
  const int64_t micro_batches = sc["micro_batches"].as<int64_t>();
  int it = 0;
  for (const auto& entry : sc["iterations"]) {
    SCOPED_TRACE(::testing::Message() << "iteration " << it++);
    for (auto& o : opts) o->zero_grad(/*set_to_none=*/true);
    for (const auto& m : entry["micro"]) {
      at::Tensor x = tensor_of(m["x"], {-1, 3});
      at::Tensor y = tensor_of(m["y"], {-1, 2});
      at::Tensor h = at::relu(at::linear(x, params["w1"], params["b1"]));
      at::Tensor out = at::linear(h, params["w2"], params["b2"]);
      at::Tensor loss = at::mse_loss(out, y) * (loss_mult / static_cast<double>(micro_batches));
      EXPECT_EQ(loss.item<double>(), m["loss"].as<double>());
      scaler->scale(loss).backward();
      for (const auto& inj : m["inject"]) {
        c10::NoGradGuard g;
        params[inj["param"].as<std::string>()].grad().view({-1})[inj["index"].as<int64_t>()].fill_(
            value_of(inj["value"].as<std::string>()));
      }
    }
    if (sc["clip"] && !sc["clip"].IsNull()) {
      for (auto& o : opts) scaler->unscale_(*o);
      sharding::clip_grad_norm_(all_params, sc["clip"].as<double>());
    }
    std::vector<bool> stepped;
    for (auto& o : opts) stepped.push_back(scaler->step(*o));
    if (!entry["new_scale"].IsNull()) {
      scaler->update(entry["new_scale"].as<double>());
    } else {
      scaler->update();
    }
    if (entry["reload_state_dict"].as<bool>()) {
      auto sd = scaler->state_dict();
      for (const auto& kv : entry["state_dict"]) {
        std::string key = kv.first.as<std::string>();
        auto it_key = sd.find(c10::IValue(key));
        ASSERT_NE(it_key, sd.end()) << key;
        const c10::IValue& v = it_key->value();
        EXPECT_EQ(v.isInt() ? double(v.toInt()) : v.toDouble(), kv.second.as<double>()) << key;
      }
      scaler = std::make_unique<GradScaler>(GradScalerOptions()
                                                .init_scale(3.0)
                                                .growth_factor(4.0)
                                                .backoff_factor(0.25)
                                                .growth_interval(99));
      scaler->load_state_dict(sd);
    }
    const auto& expect = entry["expect"];
    EXPECT_EQ(scaler->get_scale(), expect["scale"].as<double>());
    EXPECT_EQ(scaler->get_growth_tracker(), expect["growth_tracker"].as<int64_t>());
    EXPECT_EQ(stepped, expect["stepped"].as<std::vector<bool>>());
    for (const auto& kv : expect["params"]) {
      std::string name = kv.first.as<std::string>();
      at::Tensor want = tensor_of(kv.second, params[name].sizes().vec());
      int64_t diff = first_bit_difference(params[name].detach(), want);
      EXPECT_EQ(diff, -1)
          << name << "[" << diff << "]: got "
          << params[name].detach().reshape(-1)[std::max<int64_t>(diff, 0)].item<float>()
          << ", PyTorch " << want.reshape(-1)[std::max<int64_t>(diff, 0)].item<float>();
    }
  }
}

std::string scenario_name(const ::testing::TestParamInfo<int>& info) {
  YAML::Node root = YAML::LoadFile(kFixtures);
  return root["scenarios"][info.param]["name"].as<std::string>();
}

INSTANTIATE_TEST_SUITE_P(PyTorchFixtures, Conformance, ::testing::Range(0, 10), scenario_name);

TEST(ConformanceFixtures, CoverEveryScenarioTheGeneratorWrote) {
  YAML::Node root = YAML::LoadFile(kFixtures);
  EXPECT_EQ(root["scenarios"].size(), 10u) << "update the Range() above";
  EXPECT_EQ(root["torch_version"].as<std::string>().substr(0, 6), "2.13.0");
}

}  // namespace
}  // namespace dtrain::amp
