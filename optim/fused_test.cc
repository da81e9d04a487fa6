// dtrain::optim's fused AdamW and SGD against PyTorch's AdamW(fused=True) and SGD(fused=True):
// the same gradients in, bitwise the same parameters and state out, after every one of K
// steps; alone and under a GradScaler (the kernel unscales and skips; one step has an inf),
// with and without an explicit unscale_ first.
//
// The reference is recorded at the start of the run by tests/fixtures/gen_fused_optim_fixtures.py
// with the venv's torch (--python, --generator), on this machine and under this process's
// ATEN_CPU_CAPABILITY, so both sides run the same kernels.
#include "optim/fused.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "amp/grad_scaler.h"
#include "tests/flags.h"

namespace dtrain::optim {
namespace {

c10::impl::GenericDict g_reference{c10::StringType::get(), c10::AnyType::get()};

c10::IValue get(const c10::IValue& dict, const std::string& key) {
  auto d = dict.toGenericDict();
  auto it = d.find(c10::IValue(key));
  if (it == d.end()) throw std::runtime_error("reference lacks '" + key + "'");
  return it->value();
}

std::vector<at::Tensor> tensors(const c10::IValue& list) {
  std::vector<at::Tensor> out;
  for (const auto& v : list.toList()) out.push_back(v.get().toTensor());
  return out;
}

// Whether two tensors hold the same bits (shape and dtype too).
::testing::AssertionResult same_bits(const at::Tensor& got, const at::Tensor& want) {
  if (got.sizes() != want.sizes() || got.scalar_type() != want.scalar_type()) {
    return ::testing::AssertionFailure()
           << "shape/dtype " << got.sizes() << " " << got.scalar_type() << " vs " << want.sizes()
           << " " << want.scalar_type();
  }
  at::Tensor g = got.contiguous().cpu(), w = want.contiguous().cpu();
  const auto* a = static_cast<const char*>(g.data_ptr());
  const auto* b = static_cast<const char*>(w.data_ptr());
  for (int64_t i = 0; i < g.numel(); ++i) {
    if (std::memcmp(a + i * g.element_size(), b + i * g.element_size(), g.element_size()) != 0) {
      return ::testing::AssertionFailure()
             << "element " << i << " differs: " << g.reshape(-1)[i].item<double>() << " vs "
             << w.reshape(-1)[i].item<double>();
    }
  }
  return ::testing::AssertionSuccess();
}

struct Scenario {
  std::string name;
  bool adamw;
  bool scaler = false, unscale = false;
};

std::unique_ptr<torch::optim::Optimizer> make(const Scenario& s, std::vector<at::Tensor> params) {
  using torch::optim::AdamWOptions;
  using torch::optim::SGDOptions;
  if (s.name == "adamw") {
    return std::make_unique<AdamW>(params, AdamWOptions(1e-3).weight_decay(0.01));
  }
  if (s.name == "adamw_amsgrad") {
    return std::make_unique<AdamW>(
        params, AdamWOptions(3e-3).betas({0.8, 0.95}).eps(1e-6).weight_decay(0.1).amsgrad(true));
  }
  if (s.name == "adamw_scaler" || s.name == "adamw_scaler_unscaled") {
    return std::make_unique<AdamW>(params, AdamWOptions(1e-3));  // Python's defaults otherwise
  }
  if (s.name == "sgd") return std::make_unique<SGD>(params, SGDOptions(0.05));
  if (s.name == "sgd_momentum") {
    return std::make_unique<SGD>(params, SGDOptions(0.05).momentum(0.9).weight_decay(1e-4));
  }
  if (s.name == "sgd_nesterov") {
    return std::make_unique<SGD>(params, SGDOptions(0.05).momentum(0.9).nesterov(true));
  }
  if (s.name == "sgd_dampening") {
    return std::make_unique<SGD>(params, SGDOptions(0.05).momentum(0.9).dampening(0.1));
  }
  if (s.name == "sgd_scaler") return std::make_unique<SGD>(params, SGDOptions(0.05).momentum(0.9));
  throw std::runtime_error("no scenario " + s.name);
}

void PrintTo(const Scenario& s, std::ostream* os) { *os << s.name; }

class Fused : public ::testing::TestWithParam<Scenario> {};

TEST_P(Fused, MatchesPyTorchBitwiseAfterEveryStep) {
  const Scenario& s = GetParam();
  const c10::IValue ref = get(g_reference, s.name);
  std::vector<at::Tensor> params;
  for (const auto& t : tensors(get(ref, "initial"))) params.push_back(t.clone().requires_grad_());
  auto opt = make(s, params);
  // Python's defaults where the scenario sets none: AdamW weight_decay 0.01 (LibTorch's too).
  amp::GradScaler scaler(amp::GradScalerOptions().init_scale(1024).growth_interval(2));
  int64_t k = 0, skipped = 0;
  for (const auto& step_iv : get(ref, "steps").toList()) {
    const c10::IValue step = step_iv.get();
    SCOPED_TRACE(s.name + " step " + std::to_string(k + 1));
    const auto grads = tensors(get(step, "grads"));
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i].clone();
    if (s.scaler) {
      scaler.scale(at::ones({}));  // creates the scale on the first call, as in Python
      if (s.unscale) scaler.unscale_(*opt);
      const bool stepped = scaler.step(*opt);
      EXPECT_EQ(stepped, get(step, "stepped").toTensor().item<bool>());
      skipped += stepped ? 0 : 1;
      scaler.update();
      EXPECT_EQ(scaler.get_scale(), get(step, "scale").toTensor().item<double>());
    } else {
      opt->step();
    }
    const auto want = tensors(get(step, "params"));
    const auto states = get(step, "state").toList();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(same_bits(params[i].detach(), want[i])) << "parameter " << i;
      auto it = opt->state().find(params[i].unsafeGetTensorImpl());
      const auto want_state = states.get(i).toGenericDict();
      EXPECT_EQ(it != opt->state().end() && want_state.size() > 0, want_state.size() > 0)
          << "parameter " << i << ": state present in one only";
      if (it == opt->state().end() || want_state.size() == 0) continue;
      auto key = [&](const char* name) {
        return want_state.at(c10::IValue(std::string(name))).toTensor();
      };
      if (s.adamw) {
        auto& st = dynamic_cast<AdamWState&>(*it->second);
        EXPECT_EQ(st.step_count().item<double>(), key("step").item<double>()) << "parameter " << i;
        EXPECT_TRUE(same_bits(st.exp_avg(), key("exp_avg"))) << "exp_avg " << i;
        EXPECT_TRUE(same_bits(st.exp_avg_sq(), key("exp_avg_sq"))) << "exp_avg_sq " << i;
        if (want_state.contains(c10::IValue(std::string("max_exp_avg_sq")))) {
          EXPECT_TRUE(same_bits(st.max_exp_avg_sq(), key("max_exp_avg_sq"))) << "max " << i;
        }
      } else {
        auto& st = static_cast<torch::optim::SGDParamState&>(*it->second);
        EXPECT_TRUE(same_bits(st.momentum_buffer(), key("momentum_buffer"))) << "buffer " << i;
      }
    }
    ++k;
  }
  EXPECT_EQ(k, 5);
  if (s.scaler) {
    EXPECT_EQ(skipped, 1) << "the injected inf skips one step";
  }
}

INSTANTIATE_TEST_SUITE_P(PyTorch, Fused,
                         ::testing::Values(Scenario{"adamw", true}, Scenario{"adamw_amsgrad", true},
                                           Scenario{"sgd", false}, Scenario{"sgd_momentum", false},
                                           Scenario{"sgd_nesterov", false},
                                           Scenario{"sgd_dampening", false},
                                           Scenario{"adamw_scaler", true, true},
                                           Scenario{"adamw_scaler_unscaled", true, true, true},
                                           Scenario{"sgd_scaler", false, true}),
                         [](const auto& info) { return info.param.name; });

TEST(FusedReference, HoldsEveryScenario) { EXPECT_EQ(g_reference.size(), 9u); }

// torch::save(optimizer) mid-run, torch::load into a fresh optimizer, and both go on alike: the
// archive holds the count the kernel has reached, not the one the state was created with.
TEST(FusedAdamW, ResumesFromTorchSaveAtTheStepItReached) {
  at::manual_seed(7);
  const std::vector<at::Tensor> start = {at::randn({5, 3}), at::randn({4})};
  auto copies = [&] {
    std::vector<at::Tensor> out;
    for (const auto& t : start) out.push_back(t.clone().requires_grad_());
    return out;
  };
  auto grads_at = [](int step, const std::vector<at::Tensor>& params) {
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = at::sin(at::arange(params[i].numel(), at::kFloat)
                                             .reshape(params[i].sizes())
                                             .mul(0.37 * (step + 1) + static_cast<double>(i)));
    }
  };
  const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.01);
  std::vector<at::Tensor> a = copies();
  AdamW run(a, options);
  for (int step = 0; step < 3; ++step) {
    grads_at(step, a);
    run.step();
  }
  std::stringstream archive;
  torch::save(run, archive);
  std::vector<at::Tensor> b = copies();
  for (size_t i = 0; i < b.size(); ++i) {
    c10::NoGradGuard no_grad;
    b[i].copy_(a[i]);
  }
  AdamW resumed(b, options);
  torch::load(resumed, archive);
  for (int step = 3; step < 6; ++step) {
    grads_at(step, a);
    grads_at(step, b);
    run.step();
    resumed.step();
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(same_bits(b[i], a[i])) << "parameter " << i;
  const auto& st = static_cast<const AdamWState&>(*run.state().at(a[0].unsafeGetTensorImpl()));
  EXPECT_EQ(st.step_count().item<float>(), 6.0f);
  // A copy of the state is still one, with the same count.
  const auto copy = st.clone();
  ASSERT_NE(dynamic_cast<const AdamWState*>(copy.get()), nullptr);
  EXPECT_EQ(static_cast<const AdamWState&>(*copy).step_count().item<float>(), 6.0f);
}

// step_only steps its parameters alone, each to the bits step() gives it; the others keep their
// gradients and values for a later step, which then gives them their bits too.
TEST(FusedOptimizers, StepOnlyStepsItsParametersToTheBitsOfAWholeStep) {
  at::manual_seed(3);
  const std::vector<at::Tensor> start = {at::randn({6}), at::randn({2, 3}), at::randn({5})};
  const std::vector<at::Tensor> grads = {at::randn({6}), at::randn({2, 3}), at::randn({5})};
  auto copies = [&] {
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < start.size(); ++i) {
      out.push_back(start[i].clone().requires_grad_());
      out.back().mutable_grad() = grads[i].clone();
    }
    return out;
  };
  for (bool adamw : {true, false}) {
    SCOPED_TRACE(adamw ? "adamw" : "sgd with momentum");
    auto make = [&](const std::vector<at::Tensor>& ps) -> std::unique_ptr<torch::optim::Optimizer> {
      if (adamw) return std::make_unique<AdamW>(ps, torch::optim::AdamWOptions(1e-2));
      return std::make_unique<SGD>(ps, torch::optim::SGDOptions(0.1).momentum(0.9));
    };
    std::vector<at::Tensor> whole = copies(), parts = copies();
    auto a = make(whole), b = make(parts);
    a->step();
    dynamic_cast<GradScaling&>(*b).step_only({parts[1]});
    EXPECT_TRUE(same_bits(parts[1], whole[1]));
    EXPECT_TRUE(same_bits(parts[0], start[0])) << "a parameter outside step_only moved";
    EXPECT_TRUE(same_bits(parts[2], start[2])) << "a parameter outside step_only moved";
    parts[1].mutable_grad().reset();  // as FSDP drops a stepped unit's gradients
    b->step();
    for (size_t i = 0; i < parts.size(); ++i) {
      EXPECT_TRUE(same_bits(parts[i], whole[i])) << "parameter " << i;
    }
  }
}

}  // namespace
}  // namespace dtrain::optim

int main(int argc, char** argv) {
  using dtrain::testing::flag_value;
  const std::string python = flag_value(argc, argv, "python");
  const std::string generator = flag_value(argc, argv, "generator");
  if (python.empty() || generator.empty()) {
    std::cerr << "fused_test: pass --python=<venv python with torch> and "
                 "--generator=tests/fixtures/gen_fused_optim_fixtures.py (the Bazel and CMake "
                 "targets do)\n";
    return 2;
  }
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string out =
      std::string(tmp ? tmp : "/tmp") + "/fused_optim_" + std::to_string(::getpid()) + ".pt";
  const std::string cmd = "'" + python + "' '" + generator + "' '" + out + "'";
  if (std::system(cmd.c_str()) != 0) {
    std::cerr << "fused_test: the reference generator failed (" << cmd
              << "). Run scripts/bootstrap to install the venv's torch.\n";
    return 2;
  }
  std::ifstream f(out, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::remove(out.c_str());
  dtrain::optim::g_reference = torch::jit::pickle_load(bytes).toGenericDict();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
