// Replays torch.amp.GradScaler trajectories and requires exact equality of scale and growth
// tracker and bitwise-equal parameters after every step.
//
// The reference is recorded at the start of each run, on this machine, by
// tests/fixtures/gen_grad_scaler_fixtures.py with the venv's torch (--python, --generator):
// PyTorch's CPU kernels round differently per instruction set, so a file recorded on one
// machine would compare two machines, not dtrain and PyTorch. The generator inherits this
// process's environment, ATEN_CPU_CAPABILITY included, so both sides run the same kernels.
//   --device=cuda  the same scenarios on the GPU, forward under fp16 autocast (gpu-check)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>

#include "amp/autocast.h"
#include "amp/grad_scaler.h"
#include "sharding/clip_grad.h"
#include "tests/flags.h"

namespace dtrain::amp {
namespace {

std::string g_fixtures;  // written by main() before the tests are registered
c10::Device g_device = c10::kCPU;

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
    static YAML::Node root = YAML::LoadFile(g_fixtures);
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
    params[kv.first.as<std::string>()] =
        tensor_of(kv.second["data"], shape).to(g_device).requires_grad_();
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
      at::Tensor x = tensor_of(m["x"], {-1, 3}).to(g_device);
      at::Tensor y = tensor_of(m["y"], {-1, 2}).to(g_device);
      at::Tensor loss;
      {
        // The generator's CUDA recipe: fp16 autocast around the forward and the loss.
        AutocastGuard autocast(g_device.type(), at::kHalf, /*enabled=*/g_device.is_cuda());
        at::Tensor h = at::relu(at::linear(x, params["w1"], params["b1"]));
        at::Tensor out = at::linear(h, params["w2"], params["b2"]);
        loss = at::mse_loss(out, y) * (loss_mult / static_cast<double>(micro_batches));
      }
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
      at::Tensor got = params[name].detach().cpu();
      int64_t diff = first_bit_difference(got, want);
      EXPECT_EQ(diff, -1) << name << "[" << diff << "]: got "
                          << got.reshape(-1)[std::max<int64_t>(diff, 0)].item<float>()
                          << ", PyTorch "
                          << want.reshape(-1)[std::max<int64_t>(diff, 0)].item<float>();
    }
  }
}

std::string scenario_name(const ::testing::TestParamInfo<int>& info) {
  YAML::Node root = YAML::LoadFile(g_fixtures);
  return root["scenarios"][info.param]["name"].as<std::string>();
}

INSTANTIATE_TEST_SUITE_P(PyTorchFixtures, Conformance, ::testing::Range(0, 10), scenario_name);

TEST(ConformanceFixtures, CoverEveryScenarioTheGeneratorWrote) {
  YAML::Node root = YAML::LoadFile(g_fixtures);
  EXPECT_EQ(root["scenarios"].size(), 10u) << "update the Range() above";
  EXPECT_EQ(root["device"].as<std::string>(), g_device.is_cuda() ? "cuda" : "cpu");
  // The same kernels on both sides: the generator saw the capability this process uses.
  std::cout << "reference: torch " << root["torch_version"].as<std::string>() << " on "
            << root["device"].as<std::string>() << ", CPU capability "
            << root["cpu_capability"].as<std::string>() << std::endl;
}

// Records the reference with the given Python and generator into a temporary file.
// Returns the path, or exits with a message that says what to fix.
std::string record_fixtures(const std::string& python, const std::string& generator,
                            const std::string& device) {
  if (python.empty() || generator.empty()) {
    std::cerr << "grad_scaler_conformance_test: pass --python=<venv python with torch> and "
                 "--generator=tests/fixtures/gen_grad_scaler_fixtures.py (the Bazel and CMake "
                 "targets do)\n";
    std::exit(2);
  }
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string out = std::string(tmp ? tmp : "/tmp") + "/grad_scaler_fixtures_" + device + "_" +
                    std::to_string(::getpid()) + ".json";
  std::string cmd = "'" + python + "' '" + generator + "' --device " + device + " > '" + out + "'";
  int rc = std::system(cmd.c_str());
  if (rc != 0) {
    std::cerr << "grad_scaler_conformance_test: the reference generator failed (" << cmd
              << ", status " << rc << "). Run scripts/bootstrap to install the venv's torch.\n";
    std::exit(2);
  }
  return out;
}

}  // namespace
}  // namespace dtrain::amp

int main(int argc, char** argv) {
  using dtrain::testing::flag_value;
  std::string device = flag_value(argc, argv, "device");
  if (device.empty()) device = "cpu";
  if (device == "cuda" && !at::hasCUDA()) {
    std::cout << "[  SKIPPED ] --device=cuda needs a CUDA device and a CUDA LibTorch" << std::endl;
    return 0;
  }
  dtrain::amp::g_device = c10::Device(device);
  dtrain::amp::g_fixtures = dtrain::amp::record_fixtures(
      flag_value(argc, argv, "python"), flag_value(argc, argv, "generator"), device);
  ::testing::InitGoogleTest(&argc, argv);
  int rc = RUN_ALL_TESTS();
  std::remove(dtrain::amp::g_fixtures.c_str());
  return rc;
}
